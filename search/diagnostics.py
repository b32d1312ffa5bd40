"""Representation diagnostics: Gaussianity (papers.md section 4) and the extreme-value tail (section 2).

Gaussianity: norm concentration of the pre-normalisation features (coefficient of variation),
per-coordinate and random-projection normality (D'Agostino K^2 and Anderson-Darling at 5 %),
Mardia's multivariate skewness and kurtosis with p-values.
Tail: a peaks-over-threshold generalised Pareto fit to the high negative similarities (shape
xi < 0 means a finite endpoint, the Weibull domain) with a bootstrap CI, and the per-query
Weibull-vs-Gumbel dAIC of the top-m negative shortfalls delta = 1 - s, reusing
`training.weince.tail_fit` so the diagnostic is the same statistic WEINCE uses.
"""
from __future__ import annotations

import io
import logging
import math

import numpy as np
import torch
from scipy import stats

from training.weince import tail_fit

logger = logging.getLogger(__name__)


def _as_2d(x, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 8:
        raise ValueError(f"{name} must be (n >= 8, d), got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains non-finite values")
    return x


def norm_concentration(features) -> dict:
    """Pre-normalisation norms |h|: mean, std and coefficient of variation std/mean (-> 0 when norms concentrate)."""
    h = _as_2d(features, "features")
    norms = np.linalg.norm(h, axis=1)
    mean, std = float(norms.mean()), float(norms.std(ddof=1))
    return {"norm_mean": mean, "norm_std": std, "norm_cv": std / mean if mean > 0 else float("nan")}


def _anderson_pvalue(x: np.ndarray) -> float:
    try:
        return float(stats.anderson(x, "norm", method="interpolate").pvalue)
    except TypeError:  # scipy < 1.17: only critical values; report 1 if accepted at 5 %, else 0
        r = stats.anderson(x, "norm")
        return 1.0 if r.statistic <= r.critical_values[list(r.significance_level).index(5.0)] else 0.0


def univariate_normality(columns: np.ndarray, alpha: float = 0.05) -> dict:
    """Fraction of the columns of `columns` (n, d) NOT rejected at level alpha by K^2 and by Anderson-Darling."""
    k2_p = np.array([stats.normaltest(columns[:, j]).pvalue for j in range(columns.shape[1])])
    ad_p = np.array([_anderson_pvalue(columns[:, j]) for j in range(columns.shape[1])])
    return {
        "n_tests": int(columns.shape[1]),
        "k2_fraction_not_rejected": float(np.mean(k2_p > alpha)),
        "ad_fraction_not_rejected": float(np.mean(ad_p > alpha)),
        "k2_pvalues": k2_p.tolist(),
        "ad_pvalues": ad_p.tolist(),
    }


def coordinate_normality(x, alpha: float = 0.05, max_dims: int = 256) -> dict:
    """Per-coordinate normality of (n, d) data (the first `max_dims` coordinates)."""
    x = _as_2d(x, "x")
    return univariate_normality(x[:, :max_dims], alpha)


def projection_normality(x, n_projections: int = 64, alpha: float = 0.05, seed: int = 0) -> dict:
    """Normality of random 1-D projections u . x, u uniform on the sphere."""
    x = _as_2d(x, "x")
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(x.shape[1], n_projections))
    u /= np.linalg.norm(u, axis=0, keepdims=True)
    return univariate_normality(x @ u, alpha)


def mardia(x, block: int = 2048) -> dict:
    """Mardia's multivariate skewness b1 and kurtosis b2 with their asymptotic tests ("rank" = the d used).

    y_i = S^{-1/2}(x_i - mean) (S the MLE covariance); b1 = (1/n^2) sum_ij (y_i . y_j)^3,
    b2 = (1/n) sum_i |y_i|^4; n b1 / 6 ~ chi2(d(d+1)(d+2)/6), (b2 - d(d+2)) / sqrt(8 d(d+2)/n) ~ N(0,1).
    The n x n Gram matrix is summed in blocks.
    """
    x = _as_2d(x, "x")
    n, d = x.shape
    xc = x - x.mean(axis=0)
    cov = xc.T @ xc / n
    evals, evecs = np.linalg.eigh(cov)
    # whiten on the covariance's range: features after a LayerNorm (centred) lose a direction, and the
    # statistics are affine invariant, so the rank-r subspace gives the same test with d = r
    keep = evals > 1e-9 * max(evals.max(), 1e-300)
    d = int(keep.sum())
    if d == 0 or d >= n:
        raise ValueError(f"Mardia's test needs n > rank of the covariance > 0, got n={n}, rank={d}")
    y = xc @ evecs[:, keep] / np.sqrt(evals[keep])  # whitened (n, r)
    b1 = 0.0
    for i0 in range(0, n, block):
        g = y[i0 : i0 + block] @ y.T  # (b, n)
        b1 += float(np.sum(g ** 3))
    b1 /= n * n
    b2 = float(np.mean(np.sum(y * y, axis=1) ** 2))
    dof = d * (d + 1) * (d + 2) / 6
    skew_stat = n * b1 / 6
    kurt_z = (b2 - d * (d + 2)) / math.sqrt(8 * d * (d + 2) / n)
    return {
        "skewness": b1, "skewness_stat": skew_stat, "skewness_dof": dof,
        "skewness_pvalue": float(stats.chi2.sf(skew_stat, dof)),
        "kurtosis": b2, "kurtosis_expected": float(d * (d + 2)), "kurtosis_z": kurt_z,
        "kurtosis_pvalue": float(2 * stats.norm.sf(abs(kurt_z))),
        "rank": d,
    }


def gaussianity(features, embeddings=None, alpha: float = 0.05, n_projections: int = 64,
                max_dims: int = 128, max_points: int = 4000, seed: int = 0) -> dict:
    """All section-4 checks on pre-normalisation features (and norm CV); at most `max_points` rows."""
    h = _as_2d(features, "features")
    rng = np.random.default_rng(seed)
    if h.shape[0] > max_points:
        h = h[rng.choice(h.shape[0], max_points, replace=False)]
    out = {"n": int(h.shape[0]), "d": int(h.shape[1]), **norm_concentration(h)}
    out["coordinates"] = coordinate_normality(h, alpha, max_dims)
    out["projections"] = projection_normality(h, n_projections, alpha, seed)
    try:
        out["mardia"] = mardia(h)
    except ValueError as e:
        logger.warning("Mardia test skipped: %s", e)
        out["mardia"] = None
    return out


def gpd_tail(values, threshold_quantile: float = 0.95, threshold: float | None = None, n_boot: int = 200,
             alpha: float = 0.05, seed: int = 0) -> dict:
    """Peaks over threshold: fit a generalised Pareto (shape xi, scale sigma, location 0) to the
    excesses v - u above u (the `threshold_quantile` of `values`, or `threshold`), with a
    percentile-bootstrap CI for xi. xi < 0: a finite endpoint at u + sigma / (-xi)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v)]
    if threshold is None:
        if not 0 <= threshold_quantile < 1:
            raise ValueError(f"threshold_quantile must be in [0, 1), got {threshold_quantile}")
        threshold = float(np.quantile(v, threshold_quantile)) if v.size else float("nan")
    exc = v[v > threshold] - threshold
    if exc.size < 20:
        raise ValueError(f"only {exc.size} values exceed the threshold {threshold:.4g}; need at least 20")
    xi, _, sigma = stats.genpareto.fit(exc, floc=0.0)
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    for b in range(n_boot):
        boot[b] = stats.genpareto.fit(exc[rng.integers(0, exc.size, exc.size)], floc=0.0)[0]
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2]) if n_boot > 1 else (float("nan"), float("nan"))
    return {
        "xi": float(xi), "scale": float(sigma), "threshold": float(threshold), "n_exceedances": int(exc.size),
        "xi_low": float(lo), "xi_high": float(hi), "alpha": alpha, "n_boot": n_boot,
        "finite_endpoint": bool(hi < 0),
        "endpoint": float(threshold + sigma / -xi) if xi < 0 else float("inf"),
    }


def weibull_gumbel(shortfalls, burn: int = 1) -> dict:
    """Per-row Weibull (log F on log delta) vs Gumbel (log F on delta) least-squares fits of the top-m
    negative shortfalls (rows of `shortfalls` (Q, m)); dAIC = AIC_gumbel - AIC_weibull > 0 favours Weibull."""
    d = np.asarray(shortfalls, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"shortfalls must be (Q, m), got shape {d.shape}")
    fit = tail_fit(torch.as_tensor(d), burn=burn)
    daic = fit.daic.numpy()
    return {
        "daic_mean": float(daic.mean()), "daic_median": float(np.median(daic)),
        "daic_se": float(daic.std(ddof=1) / math.sqrt(daic.size)) if daic.size > 1 else float("nan"),
        "fraction_weibull": float(np.mean(daic > 0)),
        "beta_median": float(np.median(fit.beta.numpy())), "m": int(d.shape[1]), "n_queries": int(d.shape[0]),
        "source": "training.weince.tail_fit",
    }


def tail_diagnostics(query_emb, db_emb, negative_mask_fn=None, top_m: int = 32, threshold_quantile: float = 0.95,
                     max_pairs: int = 200_000, n_boot: int = 200, seed: int = 0) -> dict:
    """EVT diagnostics of negative similarities. `negative_mask_fn(q_rows, db_rows) -> (q, n) bool` marks
    negatives (default: every pair). GPD on a random sample of <= `max_pairs` negative similarities;
    Weibull-vs-Gumbel on each query's top-`top_m` negative shortfalls."""
    zq, zd = np.asarray(query_emb, np.float64), np.asarray(db_emb, np.float64)
    s = zq @ zd.T  # (Q, N): callers pass a subsample
    if negative_mask_fn is not None:
        neg = np.asarray(negative_mask_fn(np.arange(zq.shape[0]), np.arange(zd.shape[0])), dtype=bool)
        s = np.where(neg, s, -np.inf)
    rng = np.random.default_rng(seed)
    flat = s[np.isfinite(s)]
    if flat.size > max_pairs:
        flat = flat[rng.choice(flat.size, max_pairs, replace=False)]
    top_m = min(top_m, int(np.isfinite(s).sum(1).min()))
    top = -np.sort(-s, axis=1)[:, :top_m]
    out = {"gpd": gpd_tail(flat, threshold_quantile, n_boot=n_boot, seed=seed),
           "weibull_gumbel": weibull_gumbel(np.clip(1.0 - top, 1e-6, None)) if top_m >= 4 else None}
    out["exceedances"] = (np.sort(flat[flat > out["gpd"]["threshold"]]) - out["gpd"]["threshold"]).tolist()
    return out


def plot_qq(samples: dict[str, np.ndarray]) -> bytes:
    """PNG bytes: normal QQ plots of standardised 1-D samples, one panel per name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(samples), 1)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.2), squeeze=False)
    for ax, (name, x) in zip(axes[0], samples.items()):
        x = np.sort((np.asarray(x) - np.mean(x)) / (np.std(x) + 1e-30))
        theo = stats.norm.ppf((np.arange(1, x.size + 1) - 0.5) / x.size)
        ax.plot(theo, x, ".", ms=2)
        lim = [min(theo[0], x[0]), max(theo[-1], x[-1])]
        ax.plot(lim, lim, "k-", lw=0.6)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("normal quantile")
    axes[0][0].set_ylabel("sample quantile")
    fig.tight_layout()
    return _png(fig)


def plot_tail(tail: dict) -> bytes:
    """PNG bytes: empirical survival of the exceedances vs the fitted GPD (log y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = tail["gpd"]
    exc = np.asarray(tail["exceedances"])
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    surv = 1.0 - (np.arange(1, exc.size + 1) - 0.5) / exc.size
    ax.semilogy(exc + g["threshold"], surv, ".", ms=2, label="empirical")
    grid = np.linspace(0, exc.max() if exc.size else 1, 200)
    ax.semilogy(grid + g["threshold"], stats.genpareto.sf(grid, g["xi"], 0, g["scale"]), "r-",
                label=f"GPD xi={g['xi']:.3f} [{g['xi_low']:.3f}, {g['xi_high']:.3f}]")
    ax.set_xlabel("negative similarity s")
    ax.set_ylabel("P(S > s | S > u)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
