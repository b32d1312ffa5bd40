"""The duplicate classifier, fitted on each collection without labels.

A monotone logistic model on a few pair features (align.FEATURES and the descriptors' cosine, correlations
read as Fisher z): each feature enters as a piecewise-linear function with non-negative slopes in the
direction of "more alike" (higher correlation, coverage and cosine; less stretch and unexplained colour), so
a pair more alike than another in every feature is never less likely a copy -- in particular a pair more
alike than any synthetic copy (an identical file, a mirrored copy with --flips) keeps the highest odds the
fit gives, instead of falling outside what it saw. It separates POSITIVES -- synthetic edited copies of the
collection's own images against their originals (edits.py) -- from the collection's candidate pairs (each
item and its nearest items), which are UNLABELLED: mostly look-alikes, plus whatever duplicates the collection
holds. EM reads the mixture: with positives and (1 - r)-weighted candidate pairs balanced, the model's logit
is the log likelihood ratio of "copy" to "not a copy"; a candidate pair's probability is
r = sigmoid(logit + logit(pi)) and pi, the share of candidate pairs that are duplicates, is the mean r.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit, logit

from search.duplicates.align import FEATURES

NAMES = (*FEATURES, "descriptor")
# +1: larger is more alike (correlations, coverage, cosine); -1: smaller is (stretch, unexplained colour)
SIGN = np.array([1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
SEGMENTS = 8       # pieces of each feature's monotone function, at quantiles of the pooled pairs
MIN_SHARE = 1e-6


def design(features: np.ndarray, cosine: np.ndarray) -> np.ndarray:
    """(n, len(NAMES)) model inputs: correlations as Fisher z (a copy's 0.995 and 0.9995 differ as much
    as 0.9 and 0.99 do), the chroma residual as a log, coverage and stretch as they are."""
    f = np.asarray(features, dtype=np.float64)
    z = lambda v: np.arctanh(np.clip(v, -0.999, 0.99999))   # noqa: E731
    return np.column_stack([z(f[:, 0]), z(f[:, 1]), f[:, 2], f[:, 3], np.log(f[:, 4] + 1e-3),
                            z(np.asarray(cosine, np.float64))])


def knots_of(x: np.ndarray, segments: int = SEGMENTS) -> list[np.ndarray]:
    """Per feature, the increasing knots of its piecewise-linear function (quantiles of the signed values;
    a feature with a single value gets no piece)."""
    sx = np.asarray(x, np.float64) * SIGN
    return [np.unique(np.quantile(sx[:, j], np.linspace(0, 1, segments + 1))) for j in range(sx.shape[1])]


def basis(x: np.ndarray, knots: list[np.ndarray]) -> np.ndarray:
    """(n, pieces) how far each pair's signed feature runs through each piece, 0..1: with non-negative
    weights any sum of these is non-decreasing in every signed feature (and flat past the outer knots)."""
    sx = np.asarray(x, np.float64) * SIGN
    cols = []
    for j, k in enumerate(knots):
        if k.size > 1:
            lo, hi = k[:-1], k[1:]
            cols.append((np.clip(sx[:, j, None], lo, hi) - lo) / (hi - lo))
    return np.concatenate(cols, axis=1) if cols else np.zeros((len(sx), 0))


def fit_monotone(x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float, start=None) -> np.ndarray:
    """Weighted ridge logistic regression on basis columns with non-negative slopes (L-BFGS-B) ->
    coefficients (intercept last, free and not penalised)."""
    xa = np.column_stack([x, np.ones(len(x))])
    pen = np.full(xa.shape[1], l2 * w.sum())
    pen[-1] = 0.0

    def loss(beta):
        f = xa @ beta
        val = w @ (np.logaddexp(0.0, f) - y * f) + 0.5 * pen @ (beta * beta)
        return val, xa.T @ (w * (expit(f) - y)) + pen * beta

    bounds = [(0.0, None)] * x.shape[1] + [(None, None)]
    res = minimize(loss, np.zeros(xa.shape[1]) if start is None else start, jac=True, method="L-BFGS-B", bounds=bounds,
                   options={"maxiter": 500, "ftol": 1e-10, "gtol": 1e-7})
    return res.x


@dataclass
class DuplicateModel:
    """What a scan's probabilities are: log LR(x) = coef . basis(x, knots) + intercept, p = sigmoid(log LR
    + logit(share)); `bound` names a limit the fit reached ("" when none)."""

    knots: list
    coef: np.ndarray
    share: float
    steps: int
    bound: str = ""
    positives: int = 0
    candidates: int = 0
    copy_recall: float = float("nan")        # held-out synthetic copies at p >= the default threshold
    history: list = field(default_factory=list)

    def log_ratio(self, x: np.ndarray) -> np.ndarray:
        return basis(x, self.knots) @ self.coef[:-1] + self.coef[-1]

    def probability(self, x: np.ndarray, share: float | None = None) -> np.ndarray:
        s = self.share if share is None else share
        return expit(self.log_ratio(x) + logit(np.clip(s, MIN_SHARE, 1 - MIN_SHARE)))

    def to_json(self) -> dict:
        return {"features": list(NAMES), "sign": SIGN.tolist(), "knots": [k.tolist() for k in self.knots],
                "coef": self.coef.tolist(), "share": self.share, "steps": self.steps, "bound": self.bound,
                "positives": self.positives, "candidates": self.candidates, "copy_recall": self.copy_recall}

    @classmethod
    def from_json(cls, d: dict) -> "DuplicateModel":
        return cls([np.asarray(k, np.float64) for k in d["knots"]], np.asarray(d["coef"]), float(d["share"]),
                   int(d["steps"]), d.get("bound", ""), int(d.get("positives", 0)), int(d.get("candidates", 0)),
                   float(d.get("copy_recall", float("nan"))))


def _fit_balanced(bp, bu, wu, l2, start=None):
    x = np.vstack([bp, bu])
    y = np.r_[np.ones(len(bp)), np.zeros(len(bu))]
    w = np.r_[np.full(len(bp), max(wu.sum(), 1e-9) / len(bp)), wu]   # equal total weight: logit = log LR
    return fit_monotone(x, y, w / w.mean(), l2, start)


def largest_share(log_ratio: np.ndarray, max_share: float) -> float:
    """The largest share pi in [MIN_SHARE, max_share] that the log likelihood ratios reproduce,
    pi = mean sigmoid(log LR + logit pi) (0 always does: taking the largest is what keeps EM from draining
    to it while the ratios still say some pairs are copies); max_share when even it is exceeded."""
    g = lambda pi: float(np.mean(expit(log_ratio + logit(pi)))) - pi   # noqa: E731
    if g(max_share) >= 0:
        return max_share
    grid = np.geomspace(MIN_SHARE, max_share, 121)
    above = [k for k, pi in enumerate(grid) if g(pi) > 0]
    if not above:
        return MIN_SHARE
    lo, hi = grid[above[-1]], grid[above[-1] + 1]
    for _ in range(50):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if g(mid) > 0 else (lo, mid)
    return float(lo)


def fit_model(positives: np.ndarray, unlabelled: np.ndarray, *, l2: float, max_share: float, steps: int,
              threshold: float = 0.5) -> DuplicateModel:
    """EM over the unlabelled candidate pairs (module docstring); positives and unlabelled are `design` rows."""
    if len(positives) < 4 or len(unlabelled) < 4:
        raise ValueError(f"duplicate fit needs at least 4 copies and 4 candidate pairs, got {len(positives)} and "
                         f"{len(unlabelled)}")
    knots = knots_of(np.vstack([positives, unlabelled]))
    xp, xu = basis(positives, knots), basis(unlabelled, knots)
    # start from every candidate pair as likely a copy as not at half the bound (started from "no duplicates",
    # the duplicates a collection holds teach the first fit that copies are negatives); each step then takes the
    # largest share the fitted ratios reproduce, not one EM update of it (a share of 0 is always a fixed point)
    share, history, step, coef = max_share / 2, [], 0, None
    r = np.full(len(xu), share)
    for step in range(1, steps + 1):
        coef = _fit_balanced(xp, xu, 1.0 - r, l2, coef)
        lr = xu @ coef[:-1] + coef[-1]
        new = largest_share(lr, max_share)
        r = expit(lr + logit(new))
        history.append(new)
        done = abs(new - share) < 1e-4
        share = new
        if done:
            break
    bound = ""
    if share >= max_share - 1e-9:
        bound = (f"EM put the share of candidate pairs that are duplicates at its bound {max_share:g}: most "
                 "neighbours here look like edited copies of each other (the edits the fit knows do not tell "
                 "them apart); inspect the page and raise --threshold, or check the collection is not mostly copies")
    elif step == steps:
        bound = f"EM did not settle in {steps} steps (share {share:.3g}); rerun with more --calibration-items"
    model = DuplicateModel(knots, coef, share, step, bound, len(xp), len(xu), history=history)
    # held-out copy recall: each half of the positives scored by a fit on the other half (same weights)
    half = np.arange(len(xp)) % 2 == 0
    hits = []
    for held in (half, ~half):
        c = _fit_balanced(xp[~held], xu, 1.0 - r, l2, coef)
        p = expit(xp[held] @ c[:-1] + c[-1] + logit(max(share, MIN_SHARE)))
        hits.append(p >= threshold)
    model.copy_recall = float(np.concatenate(hits).mean())
    return model


def items_share(n: int, a: np.ndarray, b: np.ndarray, p: np.ndarray) -> float:
    """Expected share of the n items that have at least one duplicate: 1 - prod_j (1 - p_ij) per item."""
    log_none = np.zeros(n)
    lp = np.log1p(-np.clip(p, 0, 1 - 1e-12))
    np.add.at(log_none, a, lp)
    np.add.at(log_none, b, lp)
    return float(np.mean(1.0 - np.exp(log_none)))


def threshold_for_precision(p: np.ndarray, target: float) -> float | None:
    """The lowest found probability t whose pairs (p >= t) have a mean probability (the expected
    precision) of at least `target`; None when even the surest pair falls short. Always a found p, so
    always reachable."""
    q = np.sort(np.asarray(p, np.float64))[::-1]
    if not q.size:
        return None
    ok = np.flatnonzero(np.cumsum(q) / np.arange(1, q.size + 1) >= target)
    return float(q[ok[-1]]) if ok.size else None


def expected_calibration_error(p: np.ndarray, correct: np.ndarray, bins: int = 10) -> float:
    """Weighted mean |observed - predicted| over equal-width probability bins."""
    p, correct = np.asarray(p, np.float64), np.asarray(correct, np.float64)
    if not p.size:
        return float("nan")
    idx = np.minimum((p * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            err += m.sum() * abs(correct[m].mean() - p[m].mean())
    return float(err / p.size)
