"""Evaluation report: plots (PNG bytes), one self-contained HTML page, report.json, a stdout table.

The HTML embeds every plot as a base64 PNG so the file can be mailed or archived alone.
Section ids (tested): generator, metrics, gap, calibration, samples, k-law, gaussianity, tail, compare.
"""
from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SECTIONS = ("generator", "metrics", "gap", "calibration", "samples", "k-law", "gaussianity", "tail", "compare")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    _plt().close(fig)
    return buf.getvalue()


def plot_samples(q: np.ndarray, p: np.ndarray, titles: list[str], top: int = 40) -> bytes:
    """Ideal q(j|x) vs learned p(j|x) for a few queries: the `top` database items by q, in q order."""
    plt = _plt()
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
    return _png(fig)


def plot_gap_vs_tau(curve_tau, curve_kl, tau_star: float, train_tau: float | None, serving_tau: float | None = None) -> bytes:
    """Mean KL(q||p) against tau (log x) with tau* (and the training / serving tau) marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.0, 3.4))
    ax.plot(curve_tau, curve_kl, "o-", ms=3)
    ax.axvline(tau_star, color="C2", ls="--", label=f"calibrated tau* = {tau_star:.4g}")
    if train_tau is not None:
        ax.axvline(train_tau, color="C3", ls=":", label=f"training tau = {train_tau:.4g}")
    if serving_tau is not None and serving_tau not in (train_tau, tau_star):
        ax.axvline(serving_tau, color="C4", ls="-.", label=f"serving tau = {serving_tau:.4g}")
    ax.set_xscale("log")
    ax.set_xlabel("tau")
    ax.set_ylabel("mean KL(q || p)  [nats]")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


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


def _img(png: bytes | None, alt: str) -> str:
    if not png:
        return f"<p class='note'>{html.escape(alt)}: not available</p>"
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'/>"


def _table(header: list[str], rows: list[list]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def metric_rows(metrics: dict | None) -> list[list]:
    """[[name, mean, low, high], ...] from retrieval_metrics' output."""
    if not metrics:
        return []
    return [[k, v["mean"], v["low"], v["high"]] for k, v in metrics.items() if isinstance(v, dict) and "mean" in v]


def gap_rows(gaps: dict) -> list[list]:
    rows = []
    for label, s in gaps.items():
        if s:
            rows.append([label, s["temperature"], s["cross_entropy"], s["cross_entropy_se"], s["ideal_entropy"],
                         s["kl"], s["kl_se"]])
    return rows


def render_html(report: dict, figures: dict[str, bytes | None]) -> str:
    """One self-contained HTML page for a report dict (as written to report.json) and its figures."""
    g = report.get("generator", {})
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>softsearch evaluation</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}"
        "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "th{background:#eee}.note{color:#555;font-size:90%}.warn{color:#a40}img{max-width:100%}</style></head><body>",
        "<h1>softsearch evaluation</h1>",
        f"<p class='note'>database: {_fmt(report.get('database', {}).get('description'))} "
        f"({_fmt(report.get('database', {}).get('count'))} items); queries: "
        f"{_fmt(report.get('queries', {}).get('description'))} ({_fmt(report.get('queries', {}).get('count'))}); "
        f"checkpoint: {_fmt(report.get('checkpoint'))}</p>",
        "<section id='generator'><h2>Positive generator</h2>",
        f"<p><b>{_fmt(g.get('name'))}</b>: {_fmt(g.get('description'))}</p>",
        f"<p>log r is <b>{'exact' if g.get('exact') else 'an approximation'}</b>"
        + ("" if g.get("exact") else " (point-mass q on the source item): the ideal search and the gap below are "
           "approximations") + ".</p></section>",
        "<section id='metrics'><h2>Retrieval metrics</h2>",
        f"<p class='note'>{_fmt(report.get('metrics_note'))}; mean and "
        f"{100 * (1 - report.get('metrics', {}).get('alpha', 0.05)):.0f} % bootstrap CI over queries.</p>",
        _table(["metric", "mean", "CI low", "CI high"], metric_rows(report.get("metrics"))),
        "</section>",
        "<section id='gap'><h2>Cross-entropy gap H(q,p) - H(q)</h2>",
        _table(["tau", "value", "H(q,p)", "se", "H(q)", "KL", "KL se"], gap_rows(report.get("gap", {}))),
        "</section>",
        "<section id='calibration'><h2>Temperature calibration</h2>",
        f"<p>calibrated tau* = {_fmt(report.get('calibration', {}).get('temperature'))} (training tau "
        f"{_fmt(report.get('calibration', {}).get('train_temperature'))})</p>",
        _img(figures.get("gap_vs_tau"), "gap vs tau"), "</section>",
        "<section id='samples'><h2>Ideal vs learned search for sample queries</h2>",
        _img(figures.get("samples"), "sample queries"), "</section>",
        "<section id='k-law'><h2>InfoNCE risk vs search cross-entropy: the O(1/k) law</h2>",
    ]
    kl = report.get("k_law")
    if kl and kl.get("ks"):
        parts.append(_table(["k", "risk", "se", "E H(q,p)", "se", "k x diff", "se"],
                            [[k, a, b, c, d, e, f] for k, a, b, c, d, e, f in zip(
                                kl["ks"], kl["risk"], kl["risk_se"], kl["ce_marginal"], kl["ce_marginal_se"],
                                kl["k_times_diff"], kl["k_times_diff_se"])]))
        parts.append(_img(figures.get("k_law"), "k law"))
    else:
        parts.append(f"<p class='note'>skipped: {_fmt(report.get('k_law_note', 'not computed'))}</p>")
    parts.append("</section><section id='gaussianity'><h2>Gaussianity of the representation</h2>")
    ga = report.get("gaussianity")
    if ga:
        rows = [["norm CV (pre-normalisation)", ga["norm_cv"]],
                ["coordinates not rejected (K^2)", ga["coordinates"]["k2_fraction_not_rejected"]],
                ["coordinates not rejected (Anderson-Darling)", ga["coordinates"]["ad_fraction_not_rejected"]],
                ["random projections not rejected (K^2)", ga["projections"]["k2_fraction_not_rejected"]],
                ["random projections not rejected (Anderson-Darling)", ga["projections"]["ad_fraction_not_rejected"]]]
        if ga.get("mardia"):
            rows += [["Mardia dimension (covariance rank)", ga["mardia"].get("rank")],
                     ["Mardia skewness (p-value)", ga["mardia"]["skewness_pvalue"]],
                     ["Mardia kurtosis z", ga["mardia"]["kurtosis_z"]],
                     ["Mardia kurtosis (p-value)", ga["mardia"]["kurtosis_pvalue"]]]
        parts.append(_table(["statistic", "value"], rows))
    parts.append(_img(figures.get("qq"), "QQ plots"))
    parts.append("</section><section id='tail'><h2>Extreme-value tail of negative similarities</h2>")
    tail = report.get("tail")
    if tail:
        gp = tail["gpd"]
        rows = [["GPD shape xi", gp["xi"]], ["xi CI low", gp["xi_low"]], ["xi CI high", gp["xi_high"]],
                ["finite endpoint (CI below 0)", gp["finite_endpoint"]], ["endpoint", gp["endpoint"]],
                ["threshold", gp["threshold"]], ["exceedances", gp["n_exceedances"]]]
        wg = tail.get("weibull_gumbel")
        if wg:
            rows += [["Weibull-vs-Gumbel dAIC (median)", wg["daic_median"]],
                     ["fraction of queries favouring Weibull", wg["fraction_weibull"]]]
        parts.append(_table(["statistic", "value"], rows))
    parts.append(_img(figures.get("tail"), "tail fit"))
    parts.append("</section><section id='compare'><h2>Before / after</h2>")
    cmp_ = report.get("compare")
    if cmp_:
        names = [k for k in cmp_["rows"]]
        parts.append(_table(["quantity", "this checkpoint", "compared checkpoint"],
                            [[n, cmp_["rows"][n]["this"], cmp_["rows"][n]["other"]] for n in names]))
        parts.append(f"<p class='note'>compared checkpoint: {_fmt(cmp_.get('checkpoint'))}</p>")
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
    lines = [f"generator: {report['generator']['name']} ({'exact' if report['generator']['exact'] else 'approximation'})"]
    queries, database = report.get("queries") or {}, report.get("database") or {}
    if queries.get("skipped") or database.get("skipped"):
        lines.append(f"skipped files (unreadable or over a limit): {queries.get('skipped', 0)} held-out, "
                     f"{database.get('skipped', 0)} database; each listed with its reason in report.json")
    for name, m, lo, hi in metric_rows(report.get("metrics")):
        lines.append(f"  {name:<18} {m:8.4f}  [{lo:.4f}, {hi:.4f}]")
    for label, tau, ce, ce_se, h, kl, kl_se in gap_rows(report.get("gap", {})):
        lines.append(f"  gap @ {label:<12} tau={tau:<8.4g} H(q,p)={ce:.4f}±{ce_se:.4f}  H(q)={h:.4f}  KL={kl:.4f}±{kl_se:.4f}")
    cal = (report.get("calibration") or {}).get("temperature")
    serving = (report.get("gap", {}).get("serving") or {}).get("temperature")
    if cal is not None and serving is not None and abs(serving - cal) > 0.01 * cal:
        # index build stores a calibrated tau; this shows when the serving one came from elsewhere
        lines.append(f"  calibrated tau* = {cal:.4g} differs from the serving tau {serving:.4g}; "
                     f"to serve at it: softsearch index rebuild ... --search-temperature {cal:.4g}")
    if report.get("compare"):
        lines.append("  before/after (this vs compared):")
        for n, r in report["compare"]["rows"].items():
            lines.append(f"    {n:<22} {_fmt(r['this']):>10}  {_fmt(r['other']):>10}")
    return "\n".join(lines)
