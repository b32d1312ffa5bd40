"""Evaluation report: plots (PNG bytes), one self-contained HTML page, report.json, a stdout table.

The HTML embeds every plot as a base64 PNG so the file can be mailed or archived alone.
Section ids (tested): baselines, settings, generator, metrics, gap, calibration, samples, k-law, gaussianity,
tail, compare. Every plot has a caption underneath (<figcaption>); the settings table states n, d and every
test's setup.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
from pathlib import Path

import numpy as np

from search.figures import png_bytes, pyplot

logger = logging.getLogger(__name__)

SECTIONS = (
    "baselines",
    "settings",
    "generator",
    "metrics",
    "gap",
    "calibration",
    "samples",
    "k-law",
    "gaussianity",
    "tail",
    "compare",
)


def plot_samples(q: np.ndarray, p: np.ndarray, titles: list[str], top: int = 40) -> bytes:
    """Ideal q(j|x) vs learned p(j|x) for a few queries: the `top` database items by q, in q order."""
    plt = pyplot()
    n = q.shape[0]
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.0), squeeze=False)
    for ax, qi, pi, title in zip(axes[0], q, p, titles):
        order = np.lexsort((-pi, -qi))[:top]  # by q, ties (e.g. uniform same-class q) by p
        x = np.arange(order.size)
        ax.bar(x, qi[order], width=0.9, alpha=0.5, label="ideal q")
        ax.plot(x, pi[order], "r.-", ms=3, lw=0.8, label="learned p")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel(f"top {order.size} items by q")
    axes[0][0].set_ylabel("probability")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return png_bytes(fig)


def log_axis(ax, axis: str = "x") -> None:
    """Readable log axis: labelled major ticks only (decades, or 1-2-5 steps when the range is under two
    decades), unlabelled minor ticks, plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    a = ax.xaxis if axis == "x" else ax.yaxis
    lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
    decades = math.log10(max(hi, 1e-300) / max(lo, 1e-300))
    a.set_major_locator(LogLocator(base=10, subs=(1.0,) if decades >= 2 else (1.0, 2.0, 5.0)))
    a.set_minor_locator(LogLocator(base=10, subs=tuple(range(2, 10))))
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a.set_minor_formatter(NullFormatter())


def plot_gap_vs_tau(
    curve_tau, curve_kl, tau_star: float, train_tau: float | None, serving_tau: float | None = None
) -> bytes:
    """Mean KL(q||p) against tau (log x) with tau* (and the training / serving tau) marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 3.5))
    ax.plot(curve_tau, curve_kl, "o-", ms=3)
    ax.axvline(tau_star, color="C2", ls="--", label=f"calibrated τ* = {tau_star:.4g}")
    if train_tau is not None:
        ax.axvline(train_tau, color="C3", ls=":", label=f"training τ = {train_tau:.4g}")
    if serving_tau is not None and serving_tau not in (train_tau, tau_star):
        ax.axvline(serving_tau, color="C4", ls="-.", label=f"serving τ = {serving_tau:.4g}")
    ax.set_xscale("log")
    log_axis(ax, "x")
    ax.set_xlabel("search temperature τ")
    ax.set_ylabel("mean KL(q || p)  [nats]")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig)


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return "nan" if math.isnan(v) else f"{v:.{digits}g}"
    return html.escape(str(v))


def _table(header: list[str], rows: list[list]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def metric_rows(metrics: dict | None) -> list[list]:
    """[[name, mean, low, high], ...] from retrieval_metrics' output."""
    if not metrics:
        return []
    return [
        [k, v["mean"], v["low"], v["high"]] for k, v in metrics.items() if isinstance(v, dict) and "mean" in v
    ]


def gap_rows(gaps: dict) -> list[list]:
    rows = []
    for label, s in gaps.items():
        if s:
            rows.append(
                [
                    label,
                    s["temperature"],
                    s["cross_entropy"],
                    s["cross_entropy_se"],
                    s["ideal_entropy"],
                    s["kl"],
                    s["kl_se"],
                ]
            )
    return rows


def _figure(png: bytes | None, alt: str, caption: str) -> str:
    """An embedded plot with its caption underneath (or a note when the plot is missing)."""
    if not png:
        return f"<p class='note'>{html.escape(alt)}: not available</p>"
    return (
        f"<figure><img alt='{html.escape(alt)}' "
        f"src='data:image/png;base64,{base64.b64encode(png).decode()}'/>"
        f"<figcaption>{caption}</figcaption></figure>"
    )


def _pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.3g} %"


def _checkpoint_text(ck) -> str:
    if not isinstance(ck, dict):
        return _fmt(ck)
    sha = (ck.get("sha256") or "")[:12]
    return f"{_fmt(ck.get('file'))} (sha256 {html.escape(sha)}…, step {_fmt(ck.get('step'))})"


def _training_text(ck) -> str:
    t = (ck.get("training") if isinstance(ck, dict) else None) or {}
    parts = []
    if t.get("loss"):
        parts.append(f"loss {_fmt(t['loss'])}")
    if t.get("schedule"):
        opts = ", ".join(f"{k}={_fmt(v)}" for k, v in (t.get("schedule_options") or {}).items())
        parts.append(f"temperature schedule {_fmt(t['schedule'])} ({opts})")
    if t.get("steps"):
        parts.append(f"{_fmt(t['steps'])} steps of batch {_fmt(t.get('batch_size'))}")
    if "gaussian_reg" in t:
        parts.append(
            f"Gaussianity regulariser weight alpha_0 = {_fmt(t['gaussian_reg'])} "
            f"(decay {_fmt(t.get('gaussian_reg_decay'))} steps)"
        )
    else:
        parts.append("Gaussianity regulariser weight: not recorded in the checkpoint")
    return "; ".join(parts)


def _settings(report: dict) -> str:
    db, q = report.get("database", {}), report.get("queries", {})
    st, temps = report.get("settings", {}), report.get("temperatures", {})
    src = report.get("temperature_sources", {})
    ga = report.get("gaussianity") or {}
    idx = report.get("index")
    kl_note = report.get("k_law_note")
    tail = report.get("tail") or {}
    rows = [
        ["database", f"{_fmt(db.get('description'))}: {_fmt(db.get('count'))} items"],
        ["queries", f"{_fmt(q.get('description'))}"],
        ["embedding dimension d", _fmt(st.get("embed_dim"))],
        ["encoder", _checkpoint_text(report.get("checkpoint"))],
        ["training", _training_text(report.get("checkpoint"))],
    ]
    if idx:
        rows.append(["index", f"{_fmt(idx.get('root'))}, version {_fmt(idx.get('version'))}"])
    rows += [
        [
            "search temperature",
            f"serving τ = {_fmt(temps.get('serving'))} ({_fmt(src.get('serving'))}); training "
            f"τ = {_fmt(temps.get('train'))}",
        ],
        [
            "normality tests",
            f"n = {_fmt(ga.get('n'))} query features, d = {_fmt(ga.get('d'))}, level "
            f"{_pct(ga.get('alpha'))}; {_fmt(st.get('n_projections'))} random projections; Mardia "
            f"null from {_fmt(st.get('mardia_null'))} Gaussian samples"
            if ga
            else "not computed",
        ],
        ["1/k law", _fmt(kl_note)],
        [
            "tail",
            (
                f"{_fmt((tail.get('gpd') or {}).get('n_queries'))} queries × "
                f"{_fmt((tail.get('gpd') or {}).get('n_items'))} items; "
                f"negatives: {_fmt(tail.get('negatives_rule'))}"
            )
            if tail
            else "not computed",
        ],
        [
            "bootstrap",
            f"{_fmt(st.get('n_boot'))} resamples of the queries (metrics), "
            f"{_fmt(((tail.get('gpd') or {}).get('fits') or [{}])[0].get('n_boot'))} (tail); seed "
            f"{_fmt(st.get('seed'))}",
        ],
    ]
    body = "".join(f"<tr><th>{html.escape(k)}</th><td class='l'>{v}</td></tr>" for k, v in rows)
    return f"<section id='settings'><h2>Data and settings</h2><table>{body}</table></section>"


def _k_law_section(report: dict, figures: dict) -> list[str]:
    kl = report.get("k_law")
    out = ["<section id='k-law'><h2>InfoNCE risk vs search cross-entropy: the O(1/k) law</h2>"]
    if not (kl and kl.get("ks")):
        out.append(f"<p class='note'>skipped: {_fmt(report.get('k_law_note', 'not computed'))}</p></section>")
        return out
    summary = (kl.get("summary") or {}).get("text", "")
    out.append(f"<p><b>{html.escape(summary)}</b></p>")
    out.append(
        f"<p class='note'>Estimator (table and plot): {_fmt(kl.get('estimator'))}. "
        f"{_fmt(report.get('k_law_note'))}.</p>"
    )
    z = 1.96
    rows = []
    for i, k in enumerate(kl["ks"]):
        rows.append(
            [
                k,
                kl["ce_marginal"][i],
                z * kl["ce_marginal_se"][i],
                kl["risk_est"][i],
                z * kl["risk_est_se"][i],
                kl["diff"][i],
                z * kl["diff_se"][i],
                kl["k_times_diff"][i],
                z * kl["k_times_diff_se"][i],
                kl["risk"][i],
                z * kl["risk_se"][i],
            ]
        )
    out.append(
        _table(
            [
                "k",
                "E H(q,p)",
                "±",
                "risk",
                "±",
                "gap = risk − E H",
                "±",
                "k × gap",
                "±",
                "risk, plain MC (check)",
                "±",
            ],
            rows,
        )
    )
    out.append(
        _figure(
            figures.get("k_law"),
            "k law",
            "Left: InfoNCE risk with k negatives and the expected search cross-entropy E H(q,p) over "
            "random databases of k + 1 items, both from the table's estimator, with 95 % intervals; "
            "crosses: the plain Monte-Carlo risk with sampled positives alone (a check). Right: k × gap, "
            "the table's column with its 95 % intervals; the title states what the curve shows.",
        )
    )
    out.append("</section>")
    return out


def _gaussianity_section(report: dict, figures: dict) -> list[str]:
    ga = report.get("gaussianity")
    out = ["<section id='gaussianity'><h2>Gaussianity of the representation</h2>"]
    if not ga:
        out.append(
            "<p class='note'>not computed (needs pre-normalisation features of at least 8 queries)</p>"
        )
    else:
        n, d = ga["n"], ga["d"]
        c, p = ga["coordinates"], ga["projections"]
        out.append(
            f"<p>Pre-normalisation features h of n = {n} held-out queries, d = {d}; every test at level "
            f"{_pct(ga.get('alpha', 0.05))}. Norm concentration: coefficient of variation of |h| = "
            f"{_fmt(ga['norm_cv'])}.</p>"
        )
        rows = [
            [
                f"{test}, {label}",
                f"{n} × {part['n_tests']} {unit}",
                _pct(part["alpha"]),
                _pct(part[f"{key}_fraction_not_rejected"]),
                _pct(part["expected_fraction_not_rejected"]),
            ]
            for label, unit, part in (
                ("per coordinate", "coordinates", c),
                ("random projections", "projections", p),
            )
            for test, key in (("D'Agostino K²", "k2"), ("Anderson-Darling", "ad"))
        ]
        out.append(
            _table(
                ["test", "data (n × columns)", "level", "columns not rejected", "expected if Gaussian"], rows
            )
        )
        m = ga.get("mardia")
        if m:
            rows = [
                [
                    "skewness b1",
                    f"{m['n']} × rank {m['rank']} (of d = {m['d']})",
                    _pct(m["alpha"]),
                    m["skewness"],
                    m["skewness_z"],
                    m["skewness_pvalue_chi2"],
                    m["skewness_pvalue"],
                ],
                [
                    "kurtosis b2",
                    f"{m['n']} × rank {m['rank']} (of d = {m['d']})",
                    _pct(m["alpha"]),
                    m["kurtosis"],
                    m["kurtosis_z"],
                    m["kurtosis_pvalue_normal"],
                    m["kurtosis_pvalue"],
                ],
            ]
            out.append("<h3>Mardia's multivariate tests</h3>")
            out.append(
                _table(
                    [
                        "statistic",
                        "data (n × rank)",
                        "level",
                        "value",
                        "z (finite-sample moments)",
                        "p (closed form)",
                        "p (simulated null)",
                    ],
                    rows,
                )
            )
            floor = 1 / (m["n_null"] + 1) if m.get("n_null") else None
            out.append(
                f"<p class='note'>p-values from {html.escape(m['calibration'])}"
                + (f" (smallest attainable p: {floor:.3g}; kurtosis two-sided)" if floor else "")
                + f". Kurtosis z uses the exact null mean {_fmt(m['kurtosis_expected'])} and sd "
                f"{_fmt(m['kurtosis_sd'])}; the skewness closed form is the small-sample corrected χ² "
                f"with {int(m['skewness_dof'])} degrees of freedom, whose variance is too small at this "
                f"(n, rank), hence the simulated null. Verdict at {_pct(m['alpha'])}: "
                + ("<b>rejected</b>" if m["rejected"] else "not rejected")
                + ".</p>"
            )
    out.append(
        _figure(
            figures.get("qq"),
            "QQ plots",
            f"Normal QQ plots of the standardised pre-normalisation features of the "
            f"{_fmt((ga or {}).get('n'))} held-out queries: two coordinates, one random projection and "
            f"the norm |h|. Points on the diagonal are Gaussian.",
        )
    )
    out.append("</section>")
    return out


def _tail_section(report: dict, figures: dict) -> list[str]:
    tail = report.get("tail")
    out = ["<section id='tail'><h2>Extreme-value tail of negative similarities</h2>"]
    if not tail:
        out.append("<p class='note'>not computed</p></section>")
        return out
    gp = tail["gpd"]
    fits, k = gp["fits"], gp["chosen"]
    ch = fits[k]
    nb = ch["n_boot"]
    out.append(
        _figure(
            figures.get("threshold_stability"),
            "threshold stability",
            f"Threshold stability. Left: GPD shape ξ fitted by maximum likelihood to the negative "
            f"similarities above each threshold u (top axis: u as a quantile of all "
            f"{_fmt(gp['n_pairs'])} negative pairs), with 95 % intervals from {nb} bootstrap resamples of "
            f"the {_fmt(gp['n_queries'])} queries; circled: the chosen threshold. Right: the fitted "
            f"endpoint u + σ/(−ξ) (none when ξ ≥ 0) and the fit constrained to an endpoint within the "
            f"cosine bound s ≤ 1.",
        )
    )
    within = "within" if ch["endpoint_within_bound"] else "<b>outside</b>"
    out.append(
        f"<p>Chosen threshold u = {_fmt(ch['threshold'])} (quantile {_fmt(ch['quantile'])}, "
        f"{ch['n_exceedances']} excesses from {ch['n_queries']} queries): "
        f"{html.escape(gp['chosen_reason'])}. "
        f"There ξ = {_fmt(ch['xi'])} [{_fmt(ch['xi_low'])}, {_fmt(ch['xi_high'])}]; the fitted endpoint "
        f"{_fmt(ch['endpoint'])} is {within} the bound 1"
        + (
            ""
            if ch["endpoint_within_bound"]
            else f"; constrained to it, ξ = {_fmt(ch['xi_constrained'])} (likelihood-ratio statistic "
            f"{_fmt(ch['lr_bound'])})"
        )
        + ".</p>"
    )
    rows = []
    for i, f in enumerate(fits):
        rows.append(
            [
                ("▶ " if i == k else "") + f"{f['quantile']:.3g}",
                f["threshold"],
                f["n_exceedances"],
                f["xi"],
                f["xi_low"],
                f["xi_high"],
                f["endpoint"],
                "yes" if f["endpoint_within_bound"] else "no",
                _pct(f["endpoint_boot_fraction_within_bound"]),
                f["xi_constrained"],
                f["lr_bound"],
            ]
        )
    out.append(
        _table(
            [
                "quantile",
                "threshold u",
                "excesses",
                "ξ",
                "95 % low",
                "95 % high",
                "endpoint",
                "endpoint ≤ 1",
                "bootstrap endpoints ≤ 1",
                "ξ (endpoint ≤ 1)",
                "LR",
            ],
            rows,
        )
    )
    out.append(
        f"<p class='note'>Negatives: {_fmt(tail.get('negatives_rule'))}; "
        f"{_fmt(tail.get('negatives_per_query'))} per query on average. LR: twice the log-likelihood "
        f"drop when the endpoint is held within the bound.</p>"
    )
    out.append(
        _figure(
            figures.get("tail"),
            "tail fit",
            f"Survival of the negative similarities above the chosen threshold u = {_fmt(ch['threshold'])} "
            f"({ch['n_exceedances']} excesses, log scale) and the fitted generalised Pareto law.",
        )
    )
    wg = tail.get("weibull_gumbel")
    if wg:
        out.append("<h3>Weibull vs Gumbel domain, per query</h3>")
        rows = [
            ["ΔAIC = AIC(Gumbel) − AIC(Weibull), median", wg["daic_median"]],
            ["ΔAIC mean (se)", f"{_fmt(wg['daic_mean'])} ({_fmt(wg['daic_se'])})"],
            ["queries favouring Weibull (ΔAIC > 0)", _pct(wg["fraction_weibull"])],
            ["clearly Weibull (ΔAIC > 2)", _pct(wg["fraction_weibull_decisive"])],
            ["clearly Gumbel (ΔAIC < −2)", _pct(wg["fraction_gumbel_decisive"])],
            ["power-law exponent β, median", wg["beta_median"]],
            ["WEINCE's least-squares proxy (not an AIC): median", wg["proxy_daic_median"]],
            ["WEINCE's proxy: fraction > 0", _pct(wg["proxy_fraction_weibull"])],
        ]
        out.append(_table(["statistic", "value"], rows))
        out.append(
            f"<p class='note'>{wg['n_queries']} queries, top m = {wg['m']} negatives each, "
            f"{html.escape(wg['method'])}: Gumbel = exponential excesses over the (m+1)-th similarity, "
            f"Weibull = a power law F(δ) ∝ δ^β in the shortfall δ = 1 − s (endpoint at the bound); one "
            f"parameter each, so ΔAIC = 2 (log L_Weibull − log L_Gumbel).</p>"
        )
        out.append(
            _figure(
                figures.get("daic"),
                "dAIC histogram",
                f"Per-query ΔAIC of the top {wg['m']} negatives; right of 0 favours the Weibull (bounded) "
                f"tail, |ΔAIC| > 2 is the usual threshold for a clear preference.",
            )
        )
    out.append("</section>")
    return out


def baseline_rows(baselines: dict | None) -> list[list]:
    """[[name, prec@10, prec@1, trained - it @10 (mean), low, high], ...] for the baselines table."""
    if not baselines:
        return []
    k0, k1 = baselines["ks"]
    out = [
        [
            "trained encoder (this checkpoint)",
            baselines["trained"][f"precision@{k0}"],
            baselines["trained"][f"precision@{k1}"],
            None,
            None,
            None,
        ]
    ]
    for r in baselines["rows"]:
        d = r[f"difference@{k0}"]
        out.append([r["name"], r[f"precision@{k0}"], r[f"precision@{k1}"], d["mean"], d["low"], d["high"]])
    return out


def _baselines_section(report: dict) -> list[str]:
    """The verdict first, then the plain searches a user could run instead (paired over queries)."""
    b = report.get("baselines")
    if not b:
        return [
            "<section id='baselines'><p class='note'>no label baselines: the database or the queries have "
            "no class labels</p></section>"
        ]
    k0, k1 = b["ks"]
    return [
        "<section id='baselines'>",
        f"<p class='verdict'><b>{html.escape(b.get('verdict', ''))}</b> (label precision@{k0} on "
        f"{b['n_queries']} held-out queries; paired 95 % bootstrap interval over queries)</p>",
        _table(
            ["search", f"precision@{k0}", f"precision@{k1}", f"trained - it @{k0}", "CI low", "CI high"],
            baseline_rows(b),
        ),
        "</section>",
    ]


def render_html(report: dict, figures: dict[str, bytes | None]) -> str:
    """One self-contained HTML page for a report dict (as written to report.json) and its figures."""
    g = report.get("generator", {})
    nq = (report.get("queries") or {}).get("count")
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>softsearch evaluation</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}"
        "table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "th{background:#eee;white-space:nowrap}td.l{text-align:left}"
        ".note{color:#555;font-size:90%}.warn{color:#a40}"
        "img{max-width:100%}figure{margin:1em 0}figcaption{color:#333;font-size:90%;max-width:900px}</style>"
        "</head><body>",
        "<h1>softsearch evaluation</h1>",
        *_baselines_section(report),
        _settings(report),
        "<section id='generator'><h2>Positive generator</h2>",
        f"<p><b>{_fmt(g.get('name'))}</b>: {_fmt(g.get('description'))}</p>",
        f"<p>log r is <b>{'exact' if g.get('exact') else 'an approximation'}</b>"
        + (
            ""
            if g.get("exact")
            else " (point-mass q on the source item): the ideal search and the gap below are approximations"
        )
        + ".</p></section>",
        "<section id='metrics'><h2>Retrieval metrics</h2>",
        f"<p class='note'>{_fmt(report.get('metrics_note'))}; mean and "
        f"{100 * (1 - report.get('metrics', {}).get('alpha', 0.05)):.0f} % bootstrap CI "
        f"over {_fmt(nq)} queries.</p>",
        _table(["metric", "mean", "CI low", "CI high"], metric_rows(report.get("metrics"))),
        "</section>",
        "<section id='gap'><h2>Cross-entropy gap H(q,p) - H(q)</h2>",
        _table(["tau", "value", "H(q,p)", "se", "H(q)", "KL", "KL se"], gap_rows(report.get("gap", {}))),
        "</section>",
        "<section id='calibration'><h2>Temperature calibration</h2>",
        f"<p>calibrated tau* = {_fmt(report.get('calibration', {}).get('temperature'))} (training tau "
        f"{_fmt(report.get('calibration', {}).get('train_temperature'))})</p>",
        _figure(
            figures.get("gap_vs_tau"),
            "gap vs tau",
            f"Mean KL(q‖p) over the {_fmt(nq)} held-out queries against the search temperature τ (log axis); "
            "dashed: the calibrated τ* that minimises the held-out cross-entropy; dotted: the training τ; "
            "dash-dotted: the serving τ when it differs.",
        ),
        "</section>",
        "<section id='samples'><h2>Ideal vs learned search for sample queries</h2>",
        _figure(
            figures.get("samples"),
            "sample queries",
            "Ideal q(j|x) (bars) and learned p(j|x) at the serving τ (red) over the database items with the "
            "largest q, for the first held-out queries; the title gives each query's KL(q‖p).",
        ),
        "</section>",
    ]
    parts += _k_law_section(report, figures)
    parts += _gaussianity_section(report, figures)
    parts += _tail_section(report, figures)
    parts.append("<section id='compare'><h2>Before / after</h2>")
    cmp_ = report.get("compare")
    if cmp_:
        names = [k for k in cmp_["rows"]]
        parts.append(
            _table(
                ["quantity", "this checkpoint", "compared checkpoint"],
                [[n, cmp_["rows"][n]["this"], cmp_["rows"][n]["other"]] for n in names],
            )
        )
        parts.append(f"<p class='note'>compared checkpoint: {_checkpoint_text(cmp_.get('checkpoint'))}</p>")
    else:
        parts.append("<p class='note'>no --compare checkpoint given</p>")
    parts.append("</section></body></html>")
    return "\n".join(parts)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else (None if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def write_report(out_dir, report: dict, figures: dict[str, bytes | None]) -> tuple[Path, Path]:
    """Write report.json and report.html into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = _jsonable(report)
    jpath, hpath = out / "report.json", out / "report.html"
    jpath.write_text(json.dumps(data, indent=2) + "\n")
    hpath.write_text(render_html(data, figures), encoding="utf-8")
    logger.info("wrote %s and %s", jpath, hpath)
    return jpath, hpath


def summary_table(report: dict) -> str:
    """A short plain-text table for stdout."""
    lines = []
    if (report.get("baselines") or {}).get("verdict"):
        lines.append(report["baselines"]["verdict"])
        for name, p10, p1, d, lo, hi in baseline_rows(report["baselines"])[1:]:
            lines.append(
                f"  {name:<42} precision@10 {p10:.4f}  precision@1 {p1:.4f}  trained - it {d:+.4f} "
                f"[{lo:+.4f}, {hi:+.4f}]"
            )
    lines.append(
        f"generator: {report['generator']['name']} "
        f"({'exact' if report['generator']['exact'] else 'approximation'})"
    )
    queries, database = report.get("queries") or {}, report.get("database") or {}
    if queries.get("skipped") or database.get("skipped"):
        lines.append(
            f"skipped files (unreadable or over a limit): {queries.get('skipped', 0)} held-out, "
            f"{database.get('skipped', 0)} database; each listed with its reason in report.json"
        )
    for name, m, lo, hi in metric_rows(report.get("metrics")):
        lines.append(f"  {name:<18} {m:8.4f}  [{lo:.4f}, {hi:.4f}]")
    for label, tau, ce, ce_se, h, kl, kl_se in gap_rows(report.get("gap", {})):
        lines.append(
            f"  gap @ {label:<12} tau={tau:<8.4g} H(q,p)={ce:.4f}±{ce_se:.4f}  "
            f"H(q)={h:.4f}  KL={kl:.4f}±{kl_se:.4f}"
        )
    cal = (report.get("calibration") or {}).get("temperature")
    serving = (report.get("gap", {}).get("serving") or {}).get("temperature")
    if cal is not None and serving is not None and abs(serving - cal) > 0.01 * cal:
        # index build stores a calibrated tau; this shows when the serving one came from elsewhere
        lines.append(
            f"  calibrated tau* = {cal:.4g} differs from the serving tau {serving:.4g}; "
            f"to serve at it: softsearch index rebuild ... --search-temperature {cal:.4g}"
        )
    ga = (report.get("gaussianity") or {}).get("mardia")
    if ga:
        lines.append(
            f"  Mardia (n={ga['n']}, rank {ga['rank']}, {ga['calibration']}): "
            f"skewness z={ga['skewness_z']:.3g} p={ga['skewness_pvalue']:.3g}, "
            f"kurtosis z={ga['kurtosis_z']:.3g} p={ga['kurtosis_pvalue']:.3g}"
        )
    tail = report.get("tail")
    if tail:
        gp = tail["gpd"]
        ch = gp["fits"][gp["chosen"]]
        lines.append(
            f"  tail: GPD xi={ch['xi']:.3f} [{ch['xi_low']:.3f}, {ch['xi_high']:.3f}] "
            f"at u={ch['threshold']:.4g} (quantile {ch['quantile']:.3g}); "
            f"xi over thresholds {min(f['xi'] for f in gp['fits']):.3f}.."
            f"{max(f['xi'] for f in gp['fits']):.3f}; endpoint {ch['endpoint']:.4g}"
        )
        wg = tail.get("weibull_gumbel")
        if wg:
            lines.append(
                f"  Weibull vs Gumbel (MLE, m={wg['m']}): median dAIC {wg['daic_median']:.3g}, "
                f"{100 * wg['fraction_weibull']:.0f} % of queries favour Weibull"
            )
    kl = report.get("k_law")
    if kl and kl.get("summary"):
        lines.append(f"  1/k law: {kl['summary']['text']}")
    if report.get("compare"):
        lines.append("  before/after (this vs compared):")
        for n, r in report["compare"]["rows"].items():
            lines.append(f"    {n:<22} {_fmt(r['this']):>10}  {_fmt(r['other']):>10}")
    return "\n".join(lines)
