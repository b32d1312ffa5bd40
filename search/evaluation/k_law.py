"""The O(1/k) law: InfoNCE risk with k negatives vs the expected search cross-entropy (docs/theory.md §1).

For a query x, a positive y_0 ~ p(y|x) and negatives y_1..y_k ~ p(y), with l_j = s(x, y_j)/tau:

    (a) risk_k   = E[-log p(0|x)],  p(j|x) = softmax_j(l)                       (plain Monte Carlo)

The joint law of (y_0..y_k) is r(x, y_0) prod_j p(y_j), so with every y_j ~ p(y) and
R = sum_j r(x, y_j)/(k+1) the same risk is, by symmetry,

    (a') risk_k  = E_marg[ sum_j r_j/(k+1) (-log p(j|x)) ] = E_marg[ R * H(q, p) ]
    (b)  ce_k    = E_marg[ H(q, p) ]     (search cross-entropy over a random database of k+1 items)

and risk_k - ce_k = E_marg[(R - 1) H(q, p)] = E_marg[(R - 1)(H - c)] for any constant c,
because E_marg[R] = 1. Both R - 1 and H - E[H] are O(k^{-1/2}), so the difference is O(1/k),
and the estimator with c = mean H has per-sample spread O(1/k): the k x difference curve can be
resolved to high precision at large k. At small k the plain difference NLL - H of each draw (the
positive's -log p(0|x) on one database, H on its marginal twin with the same negatives) is the
more precise one, so the report uses one estimator throughout, their per-draw combination

    e = w (NLL - H) + (1 - w)(R - 1)(H - c),  w = argmin Var(e) = (V_b - C_ab) / (V_a + V_b - 2 C_ab)

(unbiased for risk - ce for any fixed w; w estimated from the draws, clipped to [0, 1]):
gap = mean e, E H = mean H, risk = mean (H + e), each with a 95 % interval (1.96 se); the plain
Monte-Carlo risk alone is kept as a check. (The expected H(q, p) over databases that *contain* the positive,
reported as `ce_with_positive`, equals risk_k exactly by the same symmetry: a check, not the law.)

Two samplers: `LatentSampler` draws synthetic latents directly (von Mises positives, uniform
marginal, any embedding of the latents, e.g. the oracle), `PoolSampler` resamples a held-out
pool of embeddings with the pool-normalised ratio r~(x, y_j) = r(x, y_j) / mean_l r(x, y_l)
(positives drawn from q_pool(j|x), negatives uniform over the pool).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import Callable

import numpy as np
from scipy import stats
from scipy.special import i0e, logsumexp
from tqdm import tqdm

from search.figures import png_bytes, pyplot

logger = logging.getLogger(__name__)

DEFAULT_KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class Draw:
    """One batch of n queries with k+1 candidates. Column 0 of the *_pos arrays is the positive,
    column 0 of the *_marg arrays a marginal draw; columns 1..k (negatives) are shared."""

    logits_pos: np.ndarray  # (n, k+1) s / tau
    logits_marg: np.ndarray  # (n, k+1)
    log_r_pos: np.ndarray  # (n, k+1) log r, -inf where r = 0
    log_r_marg: np.ndarray  # (n, k+1)


def _oracle(latents: np.ndarray) -> np.ndarray:
    m = latents.shape[-1]
    z = np.stack([np.cos(latents), np.sin(latents)], axis=-1).reshape(*latents.shape[:-1], 2 * m)
    return z / math.sqrt(m)


class LatentSampler:
    """Synthetic torus: x, y uniform on [0, 2pi)^m, positives theta + von Mises(0, kappa) per angle,
    log r = sum_i kappa cos(dtheta_i) - m log I0(kappa); `embed(latents (..., m)) -> (..., D)` unit rows."""

    def __init__(
        self,
        m: int,
        kappa: float,
        temperature: float,
        embed: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        if m < 1 or not kappa > 0 or not temperature > 0:
            raise ValueError(
                f"need m >= 1, kappa > 0, temperature > 0; got "
                f"m={m}, kappa={kappa}, temperature={temperature}"
            )
        self.m, self.kappa, self.temperature = int(m), float(kappa), float(temperature)
        self.embed = embed or _oracle
        self._log_i0 = float(np.log(i0e(self.kappa)) + self.kappa)

    def _log_r(self, x, y):
        return self.kappa * np.cos(y - x[:, None, :]).sum(-1) - self.m * self._log_i0

    def draw(self, n: int, k: int, rng: np.random.Generator) -> Draw:
        x = rng.uniform(0, 2 * np.pi, (n, self.m))  # (n, m)
        pos = np.mod(x + rng.vonmises(0.0, self.kappa, (n, self.m)), 2 * np.pi)  # (n, m)
        marg0 = rng.uniform(0, 2 * np.pi, (n, self.m))
        neg = rng.uniform(0, 2 * np.pi, (n, k, self.m))  # (n, k, m)
        y_pos = np.concatenate([pos[:, None], neg], axis=1)  # (n, k+1, m)
        y_marg = np.concatenate([marg0[:, None], neg], axis=1)
        zx = self.embed(x)  # (n, D)
        zy_pos = self.embed(y_pos.reshape(-1, self.m)).reshape(n, k + 1, -1)
        zy_marg0 = self.embed(marg0)
        l_pos = np.einsum("nd,nkd->nk", zx, zy_pos) / self.temperature
        l_marg = l_pos.copy()
        l_marg[:, 0] = np.einsum("nd,nd->n", zx, zy_marg0) / self.temperature
        return Draw(l_pos, l_marg, self._log_r(x, y_pos), self._log_r(x, y_marg))


class PoolSampler:
    """Empirical version on a held-out pool: queries resampled from (query_emb, query_meta), candidates
    from (db_emb, db_meta) with the pool-normalised ratio r~ = r / mean_pool r (so E_pool[r~] = 1)."""

    def __init__(self, query_emb, query_meta, db_emb, db_meta, generator, temperature: float):
        zq, zd = np.asarray(query_emb, np.float64), np.asarray(db_emb, np.float64)
        if zq.ndim != 2 or zd.ndim != 2 or zq.shape[1] != zd.shape[1]:
            raise ValueError(f"embedding shapes {zq.shape} and {zd.shape} are not (Q, D) and (N, D)")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}")
        self.temperature = float(temperature)
        self.logits = zq @ zd.T / self.temperature  # (Q, N)
        lr = np.asarray(generator.log_ratio(np.asarray(query_meta), np.asarray(db_meta)), np.float64)
        lme = logsumexp(lr, axis=1) - math.log(lr.shape[1])  # log mean_pool r
        if not np.all(np.isfinite(lme)):
            raise ValueError("some queries have r = 0 on the whole pool: the k-law needs r > 0 somewhere")
        self.log_r = lr - lme[:, None]  # log r~
        q = np.exp(self.log_r - logsumexp(self.log_r, axis=1, keepdims=True))
        self.cdf = np.cumsum(q, axis=1)
        self.cdf[:, -1] = 1.0
        self.frac_positive = float(np.mean(np.isfinite(self.log_r)))

    def draw(self, n: int, k: int, rng: np.random.Generator) -> Draw:
        nq, nd = self.logits.shape
        qi = rng.integers(0, nq, n)
        u = rng.random(n)
        pos = np.array([np.searchsorted(self.cdf[i], v, side="right") for i, v in zip(qi, u)]).clip(0, nd - 1)
        marg0 = rng.integers(0, nd, n)
        neg = rng.integers(0, nd, (n, k))
        idx_pos = np.concatenate([pos[:, None], neg], axis=1)
        idx_marg = np.concatenate([marg0[:, None], neg], axis=1)
        rows = qi[:, None]
        return Draw(
            self.logits[rows, idx_pos],
            self.logits[rows, idx_marg],
            self.log_r[rows, idx_pos],
            self.log_r[rows, idx_marg],
        )


@dataclass
class KLawResult:
    """Per-k means and standard errors of the curves. `diff` = risk - E H(q,p) by the combined estimator
    (module doc; weight `diff_weight` on the plain difference), `risk_est` = ce_marginal + diff on the same
    draws; `risk` is the plain Monte-Carlo risk alone."""

    ks: np.ndarray
    risk: np.ndarray
    risk_se: np.ndarray
    risk_symmetric: np.ndarray
    risk_symmetric_se: np.ndarray
    ce_marginal: np.ndarray
    ce_marginal_se: np.ndarray
    ce_with_positive: np.ndarray
    ce_with_positive_se: np.ndarray
    diff: np.ndarray
    diff_se: np.ndarray
    risk_est: np.ndarray = field(default_factory=lambda: np.empty(0))
    risk_est_se: np.ndarray = field(default_factory=lambda: np.empty(0))
    diff_weight: np.ndarray = field(default_factory=lambda: np.empty(0))
    diff_plain_se: np.ndarray = field(default_factory=lambda: np.empty(0))
    diff_cv_se: np.ndarray = field(default_factory=lambda: np.empty(0))
    undefined_fraction: np.ndarray = field(default_factory=lambda: np.empty(0))
    n_queries: int = 0

    @property
    def k_times_diff(self) -> np.ndarray:
        return self.ks * self.diff

    @property
    def k_times_diff_se(self) -> np.ndarray:
        return self.ks * self.diff_se

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name).tolist() for f in fields(self) if f.name != "n_queries"}
        out["k_times_diff"] = self.k_times_diff.tolist()
        out["k_times_diff_se"] = self.k_times_diff_se.tolist()
        out["n_queries"] = self.n_queries
        out["estimator"] = ESTIMATOR
        out["summary"] = k_law_summary(self)
        return out


ESTIMATOR = (
    "per draw, e = w (NLL - H) + (1 - w)(R - 1)(H - mean H) with the variance-minimising w "
    "(plain difference and control variate combined); gap = mean e, risk = E H(q,p) + gap; "
    "intervals 1.96 se"
)


def k_law_summary(result: KLawResult, p_flat: float = 0.01) -> dict:
    """What the k x gap curve shows: flat (consistent with a constant) over the upper half of k, or not.

    Flatness: chi^2 of k x gap about its inverse-variance weighted mean over k >= the median k
    (independent draws per k), p > `p_flat`."""
    ks, kd, se = result.ks, result.k_times_diff, result.k_times_diff_se
    upper = ks >= np.median(ks)
    w = 1.0 / np.maximum(se[upper], 1e-300) ** 2
    mean = float(np.sum(w * kd[upper]) / np.sum(w))
    chi2 = float(np.sum(w * (kd[upper] - mean) ** 2))
    dof = int(upper.sum()) - 1
    p = float(stats.chi2.sf(chi2, dof)) if dof > 0 else float("nan")
    k0 = int(ks[upper][0])
    lo, hi = float(kd.min()), float(kd.max())
    if dof > 0 and p > p_flat:
        text = (
            f"k × gap is flat at {mean:.3g} ± {1.96 / math.sqrt(np.sum(w)):.2g} for k ≥ {k0} "
            f"(chi2 p = {p:.2g}): the gap shrinks as 1/k there"
        )
    else:
        text = (
            f"k × gap is not flat for k ≥ {k0} (chi2 p = {p:.2g}; it spans {lo:.3g} to {hi:.3g} over "
            f"k = {int(ks[0])}..{int(ks[-1])}): no 1/k regime is reached on this range"
        )
    return {
        "flat": bool(dof > 0 and p > p_flat),
        "from_k": k0,
        "weighted_mean": mean,
        "chi2": chi2,
        "dof": dof,
        "p_value": p,
        "min": lo,
        "max": hi,
        "text": text,
    }


def _cross_entropy(logits: np.ndarray, log_r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H(q, p) per row (nan where r = 0 on the whole row), R = sum_j r_j / (k+1))."""
    log_p = logits - logsumexp(logits, axis=1, keepdims=True)
    lz = logsumexp(log_r, axis=1)  # log sum_j r_j
    with np.errstate(invalid="ignore"):
        q = np.exp(log_r - lz[:, None])  # nan rows where lz = -inf
        h = -np.sum(np.where(q > 0, q * log_p, 0.0), axis=1)
    h[~np.isfinite(lz)] = np.nan
    return h, np.exp(lz) / logits.shape[1]


def _mean_se(v: np.ndarray) -> tuple[float, float]:
    return float(np.mean(v)), float(np.std(v, ddof=1) / math.sqrt(v.size)) if v.size > 1 else float("nan")


def k_law(sampler, ks=DEFAULT_KS, n_queries: int = 2000, seed: int = 0, batch: int = 256) -> KLawResult:
    """Monte-Carlo estimates of the risk and the search cross-entropy for every k in `ks`."""
    ks = np.asarray(sorted(set(int(k) for k in ks)), dtype=np.int64)
    if ks.size == 0 or ks[0] < 1:
        raise ValueError(f"ks must be positive integers, got {ks.tolist()}")
    if n_queries < 2:
        raise ValueError(f"n_queries must be >= 2, got {n_queries}")
    rng = np.random.default_rng(seed)
    cols = {
        name: []
        for name in (
            "risk",
            "risk_se",
            "risk_symmetric",
            "risk_symmetric_se",
            "ce_marginal",
            "ce_marginal_se",
            "ce_with_positive",
            "ce_with_positive_se",
            "diff",
            "diff_se",
            "risk_est",
            "risk_est_se",
            "undefined_fraction",
        )
    }
    weights, plain_se, cv_se = [], [], []
    for k in tqdm(ks, desc="k-law", disable=not logger.isEnabledFor(logging.INFO)):
        nll, h_m, r_m, h_p = [], [], [], []
        # smaller query batches for large k keep each (batch, k+1, D) block near 256 x 1025
        step = max(8, min(batch, (batch * 1025) // (int(k) + 1)))
        for n0 in range(0, n_queries, step):
            d = sampler.draw(min(step, n_queries - n0), int(k), rng)
            nll.append(logsumexp(d.logits_pos, axis=1) - d.logits_pos[:, 0])  # -log p(0|x)
            h, r = _cross_entropy(d.logits_marg, d.log_r_marg)
            h_m.append(h)
            r_m.append(r)
            h_p.append(_cross_entropy(d.logits_pos, d.log_r_pos)[0])
        nll, h_m, r_m, h_p = (np.concatenate(a) for a in (nll, h_m, r_m, h_p))
        undefined = ~np.isfinite(h_m)
        c = float(np.mean(h_m[~undefined])) if (~undefined).any() else 0.0
        h_filled = np.where(undefined, c, h_m)  # databases with r = 0 everywhere: impute the mean
        sym = np.where(undefined, 0.0, r_m * h_filled)  # R H, with R = 0 where undefined
        plain = nll - h_filled  # E = risk - ce (same negatives in both databases)
        cv = (r_m - 1.0) * (h_filled - c)  # E[(R - 1)(H - c)] = risk - ce
        cov = np.cov(plain, cv)  # (2, 2)
        den = cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]
        w = float(np.clip((cov[1, 1] - cov[0, 1]) / den, 0.0, 1.0)) if den > 0 else 0.0
        dvals = w * plain + (1.0 - w) * cv
        weights.append(w)
        plain_se.append(_mean_se(plain)[1])
        cv_se.append(_mean_se(cv)[1])
        for name, v in (
            ("risk", nll),
            ("risk_symmetric", sym),
            ("ce_marginal", h_filled),
            ("diff", dvals),
            ("ce_with_positive", h_p[np.isfinite(h_p)]),
            ("risk_est", h_filled + dvals),
        ):
            mean, se = _mean_se(v)
            cols[name].append(mean)
            cols[f"{name}_se"].append(se)
        cols["undefined_fraction"].append(float(undefined.mean()))
        logger.info(
            "k=%d risk %.4f ce %.4f k*diff %.4f",
            k,
            cols["risk"][-1],
            cols["ce_marginal"][-1],
            k * cols["diff"][-1],
        )
    return KLawResult(
        ks=ks,
        n_queries=n_queries,
        diff_weight=np.asarray(weights),
        diff_plain_se=np.asarray(plain_se),
        diff_cv_se=np.asarray(cv_se),
        **{k_: np.asarray(v) for k_, v in cols.items()},
    )


def plot_k_law(result: KLawResult) -> bytes:
    """PNG bytes: risk and E H(q,p) vs k (left) and k x gap (right), the table's estimator with 95 %
    intervals; the right title is `k_law_summary`'s sentence."""
    import textwrap

    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.0))
    ks = result.ks
    z = 1.96
    a1.errorbar(
        ks,
        result.risk_est,
        z * result.risk_est_se,
        fmt="o-",
        ms=3,
        capsize=2,
        label="InfoNCE risk (k negatives)",
    )
    a1.errorbar(
        ks,
        result.ce_marginal,
        z * result.ce_marginal_se,
        fmt="s--",
        ms=3,
        capsize=2,
        label="E H(q,p) over k+1 random items",
    )
    a1.plot(ks, result.risk, "x", ms=5, color="k", alpha=0.6, label="risk, plain Monte Carlo alone (check)")
    from matplotlib.ticker import NullLocator

    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(int(k)) for k in ks], fontsize=7)
        ax.xaxis.set_minor_locator(NullLocator())
    a1.set_xlabel("k (negatives)")
    a1.set_ylabel("nats")
    a1.legend(fontsize=7)
    a1.set_title("InfoNCE risk and search cross-entropy", fontsize=9)
    a2.errorbar(ks, result.k_times_diff, z * result.k_times_diff_se, fmt="o-", ms=3, capsize=2, color="C3")
    a2.axhline(0, color="grey", lw=0.5)
    a2.set_xlabel("k (negatives)")
    a2.set_ylabel("k × (risk − E H(q,p))  [nats]")
    a2.set_title("\n".join(textwrap.wrap(k_law_summary(result)["text"], 62)), fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)
