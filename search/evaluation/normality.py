"""Normality tests of a representation (docs/theory.md §4), each calibrated at the sample's own (n, d).

- Norm concentration of the pre-normalisation features (coefficient of variation of |h|).
- Per-column D'Agostino K^2 and Anderson-Darling (scipy's p-values) on coordinates and on random
  projections, at level alpha; under normality a fraction 1 - alpha of the columns is not rejected.
- Mardia's multivariate skewness b1 and kurtosis b2 on the covariance's range (rank r). Finite-sample
  forms (Mardia 1974): E b2 = r(r+2)(n-1)/(n+1), Var b2 = 8r(r+2)(n-3)(n-r-1)(n-r+1)/((n+1)^2(n+3)(n+5)),
  and the small-sample corrected skewness n c b1 / 6 ~ chi2(r(r+1)(r+2)/6) with
  c = (r+1)(n+1)(n+3) / (n((n+1)(r+1) - 6)), which matches the null mean but not its variance (about 25 %
  too small at n = 512, r = 62). Both statistics are affine invariant, so their null law depends on
  (n, r) only: the p-values come from a simulated Gaussian null of the same (n, r) (a Monte-Carlo test,
  exact level when alpha (B + 1) is an integer); the closed forms are reported beside them.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import torch
from scipy import stats

from search.figures import png_bytes, pyplot

logger = logging.getLogger(__name__)


def _as_2d(x, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 8:
        raise ValueError(f"{name} must be (n >= 8, d), got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains non-finite values")
    return x


def norm_concentration(features) -> dict:
    """Pre-normalisation norms |h|: mean, std and coefficient of variation std/mean (-> 0 when norms
    concentrate)."""
    h = _as_2d(features, "features")
    norms = np.linalg.norm(h, axis=1)
    mean, std = float(norms.mean()), float(norms.std(ddof=1))
    return {"norm_mean": mean, "norm_std": std, "norm_cv": std / mean if mean > 0 else float("nan")}


def anderson_pvalue(x: np.ndarray) -> float:
    """Anderson-Darling normality p-value (mean and variance estimated; scipy's interpolated table)."""
    try:
        return float(stats.anderson(x, "norm", method="interpolate").pvalue)
    except TypeError:  # scipy < 1.17: critical values only; 1 if accepted at 5 %, else 0 (a 5 % decision)
        r = stats.anderson(x, "norm")
        return 1.0 if r.statistic <= r.critical_values[list(r.significance_level).index(5.0)] else 0.0


def univariate_normality(columns: np.ndarray, alpha: float = 0.05) -> dict:
    """K^2 and Anderson-Darling on each column of `columns` (n, c): p-values and the fraction not rejected."""
    k2_p = np.array([stats.normaltest(columns[:, j]).pvalue for j in range(columns.shape[1])])
    ad_p = np.array([anderson_pvalue(columns[:, j]) for j in range(columns.shape[1])])
    return {
        "n": int(columns.shape[0]),
        "n_tests": int(columns.shape[1]),
        "alpha": alpha,
        "expected_fraction_not_rejected": 1.0 - alpha,
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
    return {**univariate_normality(x @ u, alpha), "n_projections": int(n_projections)}


def _b1_b2(y: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Mardia's (b1, b2) of whitened samples y (B, n, r) float64: b1 = sum_ij (y_i.y_j)^3 / n^2,
    b2 = mean_i |y_i|^4; the (n, n) Gram is summed in row blocks."""
    n = y.shape[1]
    b1 = torch.zeros(y.shape[0], dtype=y.dtype)
    for i0 in range(0, n, block):
        b1 += (y[:, i0 : i0 + block] @ y.transpose(1, 2)).pow_(3).sum((1, 2))  # (B, b, n) -> (B,)
    return b1 / (n * n), (y * y).sum(-1).pow(2).mean(-1)


@functools.lru_cache(maxsize=8)
def mardia_null(n: int, r: int, n_sim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(b1, b2) of `n_sim` standard Gaussian samples of shape (n, r), whitened with their MLE covariance."""
    gen = torch.Generator().manual_seed(seed)
    b1s, b2s = [], []
    chunk = max(1, min(n_sim, 2**23 // (n * max(n, r))))  # keep each (chunk, n, n) Gram block near 64 MB
    for s0 in range(0, n_sim, chunk):
        x = torch.randn((min(chunk, n_sim - s0), n, r), generator=gen, dtype=torch.float64)
        xc = x - x.mean(1, keepdim=True)
        chol = torch.linalg.cholesky(xc.transpose(1, 2) @ xc / n)  # (B, r, r)
        y = torch.linalg.solve_triangular(chol, xc.transpose(1, 2), upper=False).transpose(1, 2)  # (B, n, r)
        b1, b2 = _b1_b2(y)
        b1s.append(b1.numpy())
        b2s.append(b2.numpy())
    return np.concatenate(b1s), np.concatenate(b2s)


def _whiten(x: np.ndarray) -> tuple[np.ndarray, int]:
    """x (n, d) -> (S^{-1/2}(x - mean) on the range of the MLE covariance S, its rank r)."""
    n = x.shape[0]
    xc = x - x.mean(axis=0)
    evals, evecs = np.linalg.eigh(xc.T @ xc / n)
    # features after a LayerNorm (centred rows) lose a direction; the statistics are affine invariant,
    # so the rank-r subspace gives the same test with d = r
    keep = evals > 1e-9 * max(evals.max(), 1e-300)
    r = int(keep.sum())
    if r == 0 or r >= n - 1:
        raise ValueError(f"Mardia's test needs n > rank of the covariance + 1 > 1, got n={n}, rank={r}")
    return xc @ evecs[:, keep] / np.sqrt(evals[keep]), r


def mardia(x, alpha: float = 0.05, n_null: int = 99, seed: int = 0) -> dict:
    """Mardia's skewness and kurtosis tests of (n, d) data at level `alpha` (see the module doc).

    `n_null` > 0: p-values from that many simulated Gaussian samples of the same (n, rank) (the
    skewness p one-sided, the kurtosis p two-sided); 0: the finite-sample closed forms only.
    """
    x = _as_2d(x, "x")
    n = x.shape[0]
    y, r = _whiten(x)
    b1_t, b2_t = _b1_b2(torch.from_numpy(np.ascontiguousarray(y))[None])
    b1, b2 = float(b1_t[0]), float(b2_t[0])
    dof = r * (r + 1) * (r + 2) / 6
    c = (r + 1) * (n + 1) * (n + 3) / (n * ((n + 1) * (r + 1) - 6))
    skew_stat = n * c * b1 / 6
    kurt_mean = r * (r + 2) * (n - 1) / (n + 1)
    kurt_var = 8 * r * (r + 2) * (n - 3) * (n - r - 1) * (n - r + 1) / ((n + 1) ** 2 * (n + 3) * (n + 5))
    kurt_z = (b2 - kurt_mean) / math.sqrt(kurt_var)
    out = {
        "n": n,
        "rank": r,
        "d": int(x.shape[1]),
        "alpha": alpha,
        "skewness": b1,
        "skewness_stat": skew_stat,
        "skewness_dof": dof,
        "skewness_z": (skew_stat - dof) / math.sqrt(2 * dof),
        "skewness_pvalue_chi2": float(stats.chi2.sf(skew_stat, dof)),
        "kurtosis": b2,
        "kurtosis_expected": kurt_mean,
        "kurtosis_sd": math.sqrt(kurt_var),
        "kurtosis_z": kurt_z,
        "kurtosis_pvalue_normal": float(2 * stats.norm.sf(abs(kurt_z))),
        "n_null": int(n_null),
    }
    if n_null > 0:
        null_b1, null_b2 = mardia_null(n, r, int(n_null), seed)
        # Monte-Carlo p-values (1 + #{null as extreme}) / (B + 1); two-sided = twice the smaller tail
        out["skewness_pvalue"] = float((1 + np.sum(null_b1 >= b1)) / (n_null + 1))
        tails = (1 + np.sum(null_b2 >= b2)) / (n_null + 1), (1 + np.sum(null_b2 <= b2)) / (n_null + 1)
        out["kurtosis_pvalue"] = float(min(1.0, 2 * min(tails)))
        out["calibration"] = f"simulated Gaussian null, {n_null} samples of ({n}, {r})"
    else:
        out["skewness_pvalue"] = out["skewness_pvalue_chi2"]
        out["kurtosis_pvalue"] = out["kurtosis_pvalue_normal"]
        out["calibration"] = "finite-sample closed forms"
    out["rejected"] = bool(min(out["skewness_pvalue"], out["kurtosis_pvalue"]) <= alpha)
    return out


def gaussianity(
    features,
    alpha: float = 0.05,
    n_projections: int = 64,
    max_dims: int = 128,
    max_points: int = 4000,
    mardia_points: int = 1024,
    n_null: int = 99,
    seed: int = 0,
) -> dict:
    """All section-4 checks on pre-normalisation features (n, d): at most `max_points` rows for the
    univariate tests and `mardia_points` for Mardia's (its null is simulated at that size)."""
    h = _as_2d(features, "features")
    rng = np.random.default_rng(seed)
    if h.shape[0] > max_points:
        h = h[rng.choice(h.shape[0], max_points, replace=False)]
    out = {"n": int(h.shape[0]), "d": int(h.shape[1]), "alpha": alpha, **norm_concentration(h)}
    out["coordinates"] = coordinate_normality(h, alpha, max_dims)
    out["projections"] = projection_normality(h, n_projections, alpha, seed)
    hm = h if h.shape[0] <= mardia_points else h[rng.choice(h.shape[0], mardia_points, replace=False)]
    try:
        out["mardia"] = mardia(hm, alpha, n_null=n_null, seed=seed)
    except ValueError as e:
        logger.warning("Mardia test skipped: %s", e)
        out["mardia"] = None
    return out


def plot_qq(samples: dict[str, np.ndarray]) -> bytes:
    """PNG bytes: normal QQ plots of standardised 1-D samples, one panel per name."""
    plt = pyplot()
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
    axes[0][0].set_ylabel("standardised sample quantile")
    fig.tight_layout()
    return png_bytes(fig)
