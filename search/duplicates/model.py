"""The duplicate classifier, fitted on each collection without labels.

A logistic regression on a few pair features (align.FEATURES and the descriptors' cosine, correlations
read as Fisher z) separates POSITIVES -- synthetic edited copies of the collection's own images against
their originals (edits.py) -- from the collection's candidate pairs (each item and its nearest items), which
are UNLABELLED: mostly look-alikes, plus whatever duplicates the collection holds. EM reads the mixture:
with positives and (1 - r)-weighted candidate pairs balanced, the regression's logit is the log likelihood
ratio of "copy" to "not a copy"; a candidate pair's probability is r = sigmoid(logit + logit(pi)) and pi,
the share of candidate pairs that are duplicates, is the mean r. So the probabilities carry this
collection's own base rate, and the duplicates it holds stop counting as negatives as they are found.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.special import expit, logit

from search.duplicates.align import FEATURES

NAMES = (*FEATURES, "descriptor")
QUADRATIC = 2     # the leading design columns (ncc, robust) whose squares and product also enter
MIN_SHARE = 1e-6


def design(features: np.ndarray, cosine: np.ndarray) -> np.ndarray:
    """(n, len(NAMES)) model inputs: correlations as Fisher z (a copy's 0.995 and 0.9995 differ as much
    as 0.9 and 0.99 do), the chroma residual as a log, coverage and stretch as they are."""
    f = np.asarray(features, dtype=np.float64)
    z = lambda v: np.arctanh(np.clip(v, -0.999, 0.99999))   # noqa: E731
    return np.column_stack([z(f[:, 0]), z(f[:, 1]), f[:, 2], f[:, 3], np.log(f[:, 4] + 1e-3),
                            z(np.asarray(cosine, np.float64))])


def expand(x: np.ndarray) -> np.ndarray:
    """The regression's inputs: the design columns, and the squares and product of the two correlations (a
    high trimmed correlation with a low full one is a local difference: an overlay, or a look-alike)."""
    x = np.asarray(x, np.float64)
    i, j = np.triu_indices(QUADRATIC)
    return np.column_stack([x, x[:, i] * x[:, j]])


def fit_logistic(x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float, steps: int = 50) -> np.ndarray:
    """Weighted ridge logistic regression by Newton's method -> coefficients (intercept last); the
    intercept is not penalised. x is expected standardised."""
    xa = np.column_stack([x, np.ones(len(x))])
    beta = np.zeros(xa.shape[1])
    pen = np.full(xa.shape[1], l2 * w.sum())
    pen[-1] = 0.0
    for _ in range(steps):
        p = expit(xa @ beta)
        g = xa.T @ (w * (p - y)) + pen * beta
        h = (xa * (w * p * (1 - p))[:, None]).T @ xa + np.diag(pen + 1e-9)
        step = np.linalg.solve(h, g)
        beta -= step
        if np.abs(step).max() < 1e-8:
            break
    return beta


@dataclass
class DuplicateModel:
    """What a scan's probabilities are: log LR(x) = coef . (x - mean) / scale + intercept, p = sigmoid(log LR
    + logit(share)); `bound` names a limit the fit reached ("" when none)."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    share: float
    steps: int
    bound: str = ""
    positives: int = 0
    candidates: int = 0
    copy_recall: float = float("nan")        # held-out synthetic copies at p >= the default threshold
    history: list = field(default_factory=list)

    def log_ratio(self, x: np.ndarray) -> np.ndarray:
        xs = (expand(x) - self.mean) / self.scale
        return xs @ self.coef[:-1] + self.coef[-1]

    def probability(self, x: np.ndarray, share: float | None = None) -> np.ndarray:
        s = self.share if share is None else share
        return expit(self.log_ratio(x) + logit(np.clip(s, MIN_SHARE, 1 - MIN_SHARE)))

    def to_json(self) -> dict:
        return {"features": list(NAMES), "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "coef": self.coef.tolist(), "share": self.share, "steps": self.steps, "bound": self.bound,
                "positives": self.positives, "candidates": self.candidates, "copy_recall": self.copy_recall}

    @classmethod
    def from_json(cls, d: dict) -> "DuplicateModel":
        return cls(np.asarray(d["mean"]), np.asarray(d["scale"]), np.asarray(d["coef"]), float(d["share"]),
                   int(d["steps"]), d.get("bound", ""), int(d.get("positives", 0)), int(d.get("candidates", 0)),
                   float(d.get("copy_recall", float("nan"))))


def _fit_balanced(xp, xu, wu, mean, scale, l2):
    x = (np.vstack([xp, xu]) - mean) / scale
    y = np.r_[np.ones(len(xp)), np.zeros(len(xu))]
    w = np.r_[np.full(len(xp), max(wu.sum(), 1e-9) / len(xp)), wu]   # equal total weight: logit = log LR
    return fit_logistic(x, y, w / w.mean(), l2)


def fit_model(positives: np.ndarray, unlabelled: np.ndarray, *, l2: float, max_share: float, steps: int,
              threshold: float = 0.5) -> DuplicateModel:
    """EM over the unlabelled candidate pairs (module docstring); positives and unlabelled are `design` rows."""
    xp, xu = expand(positives), expand(unlabelled)
    if len(xp) < 4 or len(xu) < 4:
        raise ValueError(f"duplicate fit needs at least 4 copies and 4 candidate pairs, got {len(xp)} and {len(xu)}")
    allx = np.vstack([xp, xu])
    mean, scale = allx.mean(0), allx.std(0) + 1e-6
    # start from every candidate pair as likely a copy as not at half the bound: the duplicates a collection
    # holds leave the negatives at once (started from "no duplicates", they teach the first fit that copies are
    # negatives, and a share of 0 is a fixed point of EM)
    share, history, step = max_share / 2, [], 0
    r = np.full(len(xu), share)
    for step in range(1, steps + 1):
        coef = _fit_balanced(xp, xu, 1.0 - r, mean, scale, l2)
        lr = ((xu - mean) / scale) @ coef[:-1] + coef[-1]
        r = expit(lr + logit(share))
        new = float(np.clip(np.mean(r), MIN_SHARE, max_share))
        history.append(new)
        done = abs(new - share) < 1e-5
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
    model = DuplicateModel(mean, scale, coef, share, step, bound, len(xp), len(xu), history=history)
    # held-out copy recall: each half of the positives scored by a fit on the other half (same weights)
    half = np.arange(len(xp)) % 2 == 0
    hits = []
    for held in (half, ~half):
        c = _fit_balanced(xp[~held], xu, 1.0 - r, mean, scale, l2)
        p = expit(((xp[held] - mean) / scale) @ c[:-1] + c[-1] + logit(max(share, MIN_SHARE)))
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
