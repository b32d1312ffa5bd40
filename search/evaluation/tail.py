"""Extreme-value tail of the negative similarities (docs/theory.md §2), with its sensitivity.

Input: a (Q, N) block of query-item similarities with a mask of the pairs that count as negatives.

GPD peaks over threshold. Above a threshold u the excesses y = s - u are fitted with a generalised
Pareto law (shape xi, scale sigma) by maximum likelihood, through the profile likelihood in
theta = xi / sigma (Grimshaw 1993): for fixed theta the likelihood is maximised at
xi(theta) = mean log(1 + theta y), leaving l*(theta) = -n (log(xi(theta) / theta) + 1 + xi(theta)),
maximised over a grid with parabolic refinement (xi >= -1, where the MLE exists). Every fit is
repeated on a grid of threshold quantiles (the threshold-stability plot), each with a percentile
bootstrap over queries (pairs of one query are not independent); the chosen threshold is the
lowest whose xi lies inside the interval of every higher threshold. The cosine bound s <= 1 caps
the endpoint u + sigma / (-xi): an unconstrained endpoint above 1 is reported as such, beside the
constrained fit (endpoint <= 1, i.e. theta <= -1 / (1 - u)) and the likelihood-ratio statistic.

Weibull vs Gumbel per query by maximum likelihood: given the (m+1)-th largest negative similarity
s_(m+1), the top-m excesses y = s - s_(m+1) are i.i.d. from the conditional tail. Gumbel domain:
exponential excesses (the GPD with xi = 0), rate lambda, MLE 1 / mean y. Weibull domain: a power law
at the bound, F(delta) ~ delta^beta in the shortfall delta = 1 - s, i.e. P(Y > y) = (1 - y/t)^beta
with t = 1 - s_(m+1) (the GPD with xi = -1/beta and endpoint 1), MLE beta = m / sum log(t / delta).
Both have one parameter, so dAIC = AIC_gumbel - AIC_weibull = 2 (l_weibull - l_gumbel); > 0 favours
Weibull. (`training.weince.tail_fit`'s least-squares log-CDF regression, which WEINCE gates on, is
reported beside it as the loss's proxy; it is not an AIC.)
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from scipy import stats

from search.figures import png_bytes, pyplot
from training.weince import tail_fit

logger = logging.getLogger(__name__)

THRESHOLD_QUANTILES = (0.8, 0.85, 0.9, 0.925, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998)


def _group_sums(y: np.ndarray, starts: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """(n_groups, G): per-group sums of log(1 + theta_g y_i); `y` sorted by group, `starts` each group's first
    row."""
    out = np.empty((starts.size, theta.size))
    for c0 in range(0, theta.size, 32):  # column blocks keep the (n, 32) temporary small
        out[:, c0 : c0 + 32] = np.add.reduceat(
            np.log1p(y[:, None] * theta[None, c0 : c0 + 32]), starts, axis=0
        )
    return out


def _profile_max(
    sums: np.ndarray, counts: np.ndarray, theta: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per weight row: the maximum over the theta grid of l*(theta) -> (theta_hat, xi_hat, loglik, grid
    index); sums (W, G) = sum_i w_i log(1 + theta_g y_i), counts (W,) = sum_i w_i. NaN rows where nothing is
    feasible."""
    xi = sums / counts[:, None]  # (W, G): xi(theta)
    with np.errstate(divide="ignore", invalid="ignore"):
        ll = -counts[:, None] * (np.log(xi / theta[None, :]) + 1.0 + xi)
    ll = np.where(np.isfinite(ll) & (xi >= -1.0), ll, -np.inf)
    j = np.argmax(ll, axis=1)
    rows = np.arange(ll.shape[0])
    th, x, l1 = theta[j].copy(), xi[rows, j].copy(), ll[rows, j].copy()
    # parabolic refinement through the two neighbours (the fine grid is uniform): vertex at offset h steps
    jm, jp = np.clip(j - 1, 0, None), np.clip(j + 1, None, theta.size - 1)
    l0, l2 = ll[rows, jm], ll[rows, jp]
    with np.errstate(invalid="ignore"):
        den = l0 - 2 * l1 + l2
        ok = (j > 0) & (j < theta.size - 1) & np.isfinite(den) & (den < 0)
        h = np.where(ok, 0.5 * (l0 - l2) / np.where(ok, den, -1.0), 0.0)  # |h| <= 1/2
    nb = np.where(h >= 0, jp, jm)
    frac = np.abs(h)
    with np.errstate(invalid="ignore"):  # rows without a finite neighbour keep their grid value
        th = np.where(ok, th + frac * (theta[nb] - theta[j]), th)
        x = np.where(ok, x + frac * (xi[rows, nb] - x), x)
        l1 = np.where(ok, l1 - 0.25 * (l0 - l2) * h, l1)
    bad = ~np.isfinite(ll[rows, j])
    th[bad], x[bad], l1[bad] = np.nan, np.nan, np.nan
    return th, x, l1, j


def _theta_grid(y_max: float, y_mean: float) -> np.ndarray:
    """Coarse theta grid: dense near the support bound -1/y_max (xi < 0) and log-spaced for xi > 0."""
    neg = (
        np.concatenate([-(1.0 - np.logspace(-5, 0, 80, endpoint=False)), -np.linspace(1.0, 0.0, 41)[1:-1]])
        / y_max
    )
    pos = np.logspace(-4, 3, 60) / y_mean
    return np.unique(np.concatenate([neg, pos]))


def gpd_fit(excesses, groups=None, weights=None, upper: float | None = None) -> dict:
    """Maximum-likelihood GPD of `excesses` y >= 0. `groups` (ints, one per excess) and `weights`
    (W, n_groups) refit under W reweightings of the groups (bootstrap counts); `upper` bounds the
    endpoint sigma / (-xi) <= upper (constrained fit). Returns arrays xi, sigma, loglik, theta of length W."""
    y = np.asarray(excesses, dtype=np.float64).ravel()
    if y.size < 10 or np.any(y < 0) or not np.all(np.isfinite(y)):
        raise ValueError(f"need at least 10 finite non-negative excesses, got {y.size}")
    g = np.zeros(y.size, np.int64) if groups is None else np.asarray(groups, np.int64).ravel()
    order = np.argsort(g, kind="stable")
    y, g = y[order], g[order]
    labels, starts = np.unique(g, return_index=True)
    n_groups = int(g.max()) + 1
    w_full = np.ones((1, n_groups)) if weights is None else np.atleast_2d(np.asarray(weights, np.float64))
    w = w_full[:, labels]  # groups with no excess add nothing
    counts = w @ np.diff(np.append(starts, y.size)).astype(np.float64)
    y_sums = w @ np.add.reduceat(y, starts)
    y_max = float(y.max())
    theta = _theta_grid(y_max, float(y.mean()))
    cap = None
    if upper is not None:
        if not upper >= y_max:
            raise ValueError(f"upper bound {upper} is below the largest excess {y_max}")
        cap = -1.0 / upper
        theta = np.append(theta[theta < cap], cap)
    _, _, _, j = _profile_max(w @ _group_sums(y, starts, theta), counts, theta)
    # fine uniform grid over the coarse bracket of every row's maximum
    lo, hi = theta[max(int(j.min()) - 1, 0)], theta[min(int(j.max()) + 1, theta.size - 1)]
    fine = np.linspace(lo, hi, 201)
    if cap is not None:
        fine = np.unique(np.append(fine[fine < cap], cap))
    th, xi, ll, _ = _profile_max(w @ _group_sums(y, starts, fine), counts, fine)
    small = ~(np.abs(th) > 1e-12)
    sigma = np.where(
        small, y_sums / counts, xi / np.where(small, 1.0, th)
    )  # theta -> 0: exponential, sigma = mean y
    return {"xi": xi, "sigma": sigma, "loglik": ll, "theta": th}


def gpd_threshold_fit(
    values,
    groups,
    threshold: float,
    bound: float = 1.0,
    n_boot: int = 200,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """GPD above `threshold` with a query bootstrap: `values` (n,) similarities, `groups` (n,) query ids."""
    v = np.asarray(values, np.float64).ravel()
    gq = np.asarray(groups, np.int64).ravel()
    sel = v > threshold
    y, gid = v[sel] - threshold, gq[sel]
    if y.size < 30:
        raise ValueError(f"only {y.size} values exceed the threshold {threshold:.4g}; need at least 30")
    uq, g = np.unique(gid, return_inverse=True)
    rng = np.random.default_rng(seed)
    q_all = int(np.unique(gq).size)
    # bootstrap over all queries (also those without exceedances at this threshold): multinomial counts
    counts = (
        rng.multinomial(q_all, np.full(q_all, 1.0 / q_all), size=n_boot)
        if n_boot > 1
        else np.zeros((0, q_all))
    )
    q_index = np.searchsorted(np.unique(gq), uq)
    w = np.vstack([np.ones(uq.size), counts[:, q_index]])
    w = w[w.sum(1) > 0]
    fit = gpd_fit(y, g, w)
    xi, sigma, ll = fit["xi"][0], fit["sigma"][0], fit["loglik"][0]
    boot = fit["xi"][1:]
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2]) if boot.size > 1 else (math.nan, math.nan)
    endpoint = threshold + sigma / -xi if xi < 0 else math.inf
    out = {
        "threshold": float(threshold),
        "n_exceedances": int(y.size),
        "n_queries": int(uq.size),
        "xi": float(xi),
        "scale": float(sigma),
        "xi_low": float(lo),
        "xi_high": float(hi),
        "alpha": alpha,
        "n_boot": int(boot.size),
        "endpoint": float(endpoint),
        "bound": bound,
        "endpoint_within_bound": bool(endpoint <= bound),
        # share of bootstrap fits whose endpoint respects the bound (xi >= 0: no endpoint)
        "endpoint_boot_fraction_within_bound": float(
            np.mean((boot < 0) & (fit["sigma"][1:] <= (bound - threshold) * -boot))
        )
        if boot.size
        else math.nan,
    }
    if out["endpoint_within_bound"]:
        out.update(xi_constrained=out["xi"], scale_constrained=out["scale"], lr_bound=0.0)
    else:
        c = gpd_fit(y, g, None, upper=bound - threshold)
        out.update(
            xi_constrained=float(c["xi"][0]),
            scale_constrained=float(c["sigma"][0]),
            lr_bound=float(max(0.0, 2 * (ll - c["loglik"][0]))),
        )
    out["endpoint_constrained"] = (
        threshold + out["scale_constrained"] / -out["xi_constrained"]
        if out["xi_constrained"] < 0
        else math.inf
    )
    return out


def choose_threshold(fits: list[dict]) -> tuple[int, str]:
    """Index of the lowest threshold whose xi lies inside the bootstrap interval of every higher one, and
    why."""
    for k, f in enumerate(fits):
        if all(h["xi_low"] <= f["xi"] <= h["xi_high"] for h in fits[k + 1 :]):
            if k == len(fits) - 1:
                return k, (
                    "no stable range: xi drifts with the threshold (each estimate lies outside the interval "
                    "of some higher threshold), so the highest threshold, the least biased, is used; read "
                    "xi with the threshold-stability plot"
                )
            return k, (
                f"lowest threshold whose xi lies inside the {100 * (1 - f['alpha']):.0f} % interval of every "
                f"higher threshold ({len(fits) - 1 - k} higher thresholds)"
            )
    raise AssertionError("unreachable: the last threshold always qualifies")


def gpd_threshold_stability(
    s,
    negatives=None,
    quantiles=THRESHOLD_QUANTILES,
    bound: float = 1.0,
    n_boot: int = 200,
    alpha: float = 0.05,
    min_exceedances: int = 100,
    seed: int = 0,
) -> dict:
    """GPD fits over a grid of threshold quantiles of the negative similarities in `s` (Q, N)."""
    s = np.asarray(s, np.float64)
    neg = np.ones(s.shape, bool) if negatives is None else np.asarray(negatives, bool)
    qid = np.broadcast_to(np.arange(s.shape[0])[:, None], s.shape)[neg]
    vals = s[neg]
    if vals.size == 0:
        raise ValueError("no negative pairs")
    fits = []
    for q in quantiles:
        u = float(np.quantile(vals, q))
        if np.sum(vals > u) < min_exceedances:
            continue
        f = gpd_threshold_fit(vals, qid, u, bound, n_boot, alpha, seed)
        f["quantile"] = float(q)
        fits.append(f)
    if not fits:
        raise ValueError(
            f"fewer than {min_exceedances} exceedances at every threshold quantile {list(quantiles)}"
        )
    k, why = choose_threshold(fits)
    return {
        "fits": fits,
        "chosen": k,
        "chosen_reason": why,
        **{
            f"chosen_{key}": fits[k][key]
            for key in (
                "quantile",
                "threshold",
                "xi",
                "xi_low",
                "xi_high",
                "endpoint",
                "endpoint_within_bound",
            )
        },
        "n_pairs": int(vals.size),
        "n_queries": int(s.shape[0]),
        "n_items": int(s.shape[1]),
        "bound": bound,
    }


def weibull_gumbel_mle(top_similarities, bound: float = 1.0, eps: float = 1e-6) -> dict:
    """Per-row Weibull (power law at the bound) vs Gumbel (exponential) MLE of the top-m excesses over the
    (m+1)-th value; `top_similarities` (Q, m+1), any order. See the module doc for both likelihoods.
    A row whose (m+1)-th value is at the bound (duplicates of the query among its negatives) has no tail
    to fit: its figures are NaN and `at_bound` marks it."""
    s = -np.sort(-np.asarray(top_similarities, np.float64), axis=1)  # descending
    if s.ndim != 2 or s.shape[1] < 4:
        raise ValueError(f"need (Q, m+1) top similarities with m >= 3, got shape {s.shape}")
    if np.any(s > bound):
        raise ValueError(f"similarities above the bound {bound}")
    m = s.shape[1] - 1
    top, ref = s[:, :m], s[:, m]
    y = top - ref[:, None]  # (Q, m) excesses >= 0
    at_bound = ~(bound - ref > eps)  # (Q,) nothing left between the reference and the bound
    t = np.where(at_bound, 1.0, bound - ref)  # (Q,) shortfall of the reference (1: placeholder)
    delta = np.clip(bound - top, eps, None)  # (Q, m) shortfalls
    logu = np.log(np.minimum(delta / t[:, None], 1.0))  # log(delta / t) <= 0
    beta = m / np.maximum(-logu.sum(1), 1e-300)
    # l_W = sum log(beta / t (delta/t)^(beta-1)),  l_G = sum log(lambda e^{-lambda y}) = m log lambda - m
    ll_w = m * np.log(beta / t) + (beta - 1) * logu.sum(1)
    lam = 1.0 / np.maximum(y.mean(1), 1e-300)
    ll_g = m * np.log(lam) - m
    daic = 2 * (ll_w - ll_g)
    for a in (daic, beta, lam, ll_w, ll_g):
        a[at_bound] = np.nan
    return {
        "daic": daic,
        "beta": beta,
        "rate": lam,
        "loglik_weibull": ll_w,
        "loglik_gumbel": ll_g,
        "m": m,
        "at_bound": at_bound,
    }


def weibull_gumbel(top_similarities, bound: float = 1.0) -> dict | None:
    """Summary over queries of `weibull_gumbel_mle`, with WEINCE's least-squares proxy beside it. Queries
    whose m+1 nearest negatives sit at the bound (duplicate images) are left out and counted
    (`n_at_bound`, said once in the log); None when no query is left."""
    r = weibull_gumbel_mle(top_similarities, bound)
    ok = ~r["at_bound"]
    if not ok.all():
        logger.info(
            "tail: %d of %d queries have their %d nearest negatives at similarity %g (duplicate images); "
            "left out of the Weibull-vs-Gumbel fit",
            int((~ok).sum()),
            ok.size,
            r["m"] + 1,
            bound,
        )
    if not ok.any():
        return None
    daic = r["daic"][ok]
    top = np.asarray(top_similarities, np.float64)[ok]
    proxy = tail_fit(torch.as_tensor(np.clip(bound - top[:, : r["m"]], 1e-6, None)), burn=1)
    pd = proxy.daic.numpy()
    return {
        "daic_mean": float(daic.mean()),
        "daic_median": float(np.median(daic)),
        "daic_se": float(daic.std(ddof=1) / math.sqrt(daic.size)) if daic.size > 1 else math.nan,
        "fraction_weibull": float(np.mean(daic > 0)),
        # |dAIC| > 2: the usual rule of thumb for one model being clearly better
        "fraction_weibull_decisive": float(np.mean(daic > 2)),
        "fraction_gumbel_decisive": float(np.mean(daic < -2)),
        "beta_median": float(np.median(r["beta"][ok])),
        "n_at_bound": int((~ok).sum()),
        "m": int(r["m"]),
        "n_queries": int(daic.size),
        "method": "maximum likelihood (conditional on the (m+1)-th)",
        "proxy_daic_median": float(np.median(pd)),
        "proxy_fraction_weibull": float(np.mean(pd > 0)),
        "proxy_source": "training.weince.tail_fit (least squares on the log empirical CDF; not an AIC)",
        "daic_values": daic.tolist(),
    }


def tail_diagnostics(
    query_emb,
    db_emb,
    negatives=None,
    top_m: int = 32,
    n_boot: int = 200,
    quantiles=THRESHOLD_QUANTILES,
    seed: int = 0,
) -> dict:
    """Threshold-stability GPD fits on the negative similarities of `query_emb` (Q, D) x `db_emb` (N, D)
    (`negatives` (Q, N) bool, default every pair) and the per-query Weibull-vs-Gumbel MLE on the top
    `top_m` + 1 negatives of each query."""
    zq, zd = np.asarray(query_emb, np.float64), np.asarray(db_emb, np.float64)
    s = np.clip(zq @ zd.T, -1.0, 1.0)  # (Q, N); rounding can put a unit-vector product a hair above 1
    neg = np.ones(s.shape, bool) if negatives is None else np.asarray(negatives, bool)
    out = {
        "gpd": gpd_threshold_stability(s, neg, quantiles, n_boot=n_boot, seed=seed),
        "negatives_per_query": float(neg.sum(1).mean()),
    }
    m = min(top_m, int(neg.sum(1).min()) - 1)
    masked = np.where(neg, s, -np.inf)
    top = -np.sort(-masked, axis=1)[:, : m + 1]
    out["weibull_gumbel"] = weibull_gumbel(top) if m >= 3 else None
    chosen = out["gpd"]["fits"][out["gpd"]["chosen"]]
    vals = s[neg]
    out["exceedances"] = np.sort(vals[vals > chosen["threshold"]]) - chosen["threshold"]
    return out


def plot_threshold_stability(gpd: dict) -> bytes:
    """PNG bytes: xi with its bootstrap interval (left) and the fitted endpoint (right) against the
    threshold."""
    plt = pyplot()
    fits = gpd["fits"]
    u = np.array([f["threshold"] for f in fits])
    xi = np.array([f["xi"] for f in fits])
    lo, hi = np.array([f["xi_low"] for f in fits]), np.array([f["xi_high"] for f in fits])
    k = gpd["chosen"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    a1.errorbar(u, xi, [xi - lo, hi - xi], fmt="o-", ms=4, capsize=3, label="MLE, 95 % query bootstrap")
    a1.plot(u[k], xi[k], "o", ms=11, mfc="none", mec="C3", mew=1.5, label="chosen threshold")
    a1.axhline(0, color="grey", lw=0.6)
    a1.set_xlabel("threshold u (similarity)")
    a1.set_ylabel("GPD shape ξ")
    a1.legend(fontsize=7)
    top = a1.secondary_xaxis("top")
    top.set_xticks(
        u[:: max(1, len(u) // 5)], [f"{f['quantile']:.3g}" for f in fits[:: max(1, len(u) // 5)]], fontsize=7
    )
    top.set_xlabel("quantile of the negative similarities", fontsize=8)
    ep = np.array([f["endpoint"] for f in fits])
    epc = np.array([f["endpoint_constrained"] for f in fits])
    a2.plot(u, np.where(np.isfinite(ep), ep, np.nan), "o-", ms=4, label="unconstrained fit")
    a2.plot(u, epc, "s--", ms=3, label="fit constrained to s ≤ 1")
    a2.axhline(gpd["bound"], color="C3", lw=0.8, ls=":", label="cosine bound s = 1")
    a2.set_xlabel("threshold u (similarity)")
    a2.set_ylabel("fitted endpoint u + σ / (−ξ)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig)


def plot_tail(tail: dict) -> bytes:
    """PNG bytes: empirical survival of the excesses over the chosen threshold vs the fitted GPD (log y)."""
    plt = pyplot()
    g = tail["gpd"]["fits"][tail["gpd"]["chosen"]]
    exc = np.asarray(tail["exceedances"])
    fig, ax = plt.subplots(figsize=(5.0, 3.5))
    surv = 1.0 - (np.arange(1, exc.size + 1) - 0.5) / exc.size
    ax.semilogy(exc + g["threshold"], surv, ".", ms=2, label=f"empirical ({exc.size} excesses)")
    grid = np.linspace(0, exc.max() if exc.size else 1, 200)
    ax.semilogy(
        grid + g["threshold"],
        stats.genpareto.sf(grid, g["xi"], 0, g["scale"]),
        "r-",
        label=f"GPD ξ = {g['xi']:.3f} [{g['xi_low']:.3f}, {g['xi_high']:.3f}]",
    )
    ax.set_xlabel("negative similarity s")
    ax.set_ylabel("P(S > s | S > u)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig)


def plot_daic(daic) -> bytes:
    """PNG bytes: histogram of the per-query dAIC (Gumbel - Weibull) with 0 marked."""
    plt = pyplot()
    d = np.asarray(daic, np.float64)
    fig, ax = plt.subplots(figsize=(5.0, 3.2))
    ax.hist(d, bins=min(40, max(10, d.size // 8)), color="C0", alpha=0.8)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("ΔAIC = AIC(Gumbel) − AIC(Weibull)   (> 0 favours Weibull)")
    ax.set_ylabel("queries")
    fig.tight_layout()
    return png_bytes(fig)
