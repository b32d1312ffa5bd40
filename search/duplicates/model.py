"""The duplicate classifier, fitted on each collection without labels.

POSITIVES are synthetic edited copies of the collection's own images against their originals (edits.py); the
collection's candidate pairs (each item and its nearest items) are UNLABELLED: mostly look-alikes, plus
whatever duplicates the collection holds, at an unknown share pi. One monotone logistic model, positives
against all candidate pairs at equal total weight, gives each pair a score s(x) (its log density ratio,
copies against candidates; some 50 monotone parameters against thousands of pairs, so a pair's score barely
depends on its own label), and from the scores:

- the share pi is a mixture-proportion estimate (Best Bin Estimation, Garg et al. 2021): for a cut t, the
  share of candidates above t over the share of copies above t is pi plus the look-alikes above t, so its
  minimum over t, less-noisy cuts favoured by a confidence term (Hoeffding, `share_delta`), estimates pi.
  It counts pairs instead of reading a fitted ratio at the copies, so it holds when duplicates are rare
  (where the logistic ratio runs off to infinity) as when they are common;
- a pair's probability is pi R(s) capped at 1, with R = g / (1 - g) and g the monotone (isotonic, PAV) fit
  of copy against candidate on the scores: where candidates are all duplicates R is 1 / pi, the
  plateau a logistic curve cannot draw. Uncapped, the candidates' probabilities average to pi (the PU
  identity); R is scaled up until they still do after the cap, so the surest pairs' excess is not lost.

Nothing iterates, so nothing can drain to "no duplicates". The model is monotone: each feature (align.FEATURES
and the descriptors' cosine, correlations read as Fisher z) enters the score as a piecewise-linear function
with non-negative slopes in the direction of "more alike" (higher correlation, coverage and cosine; less
stretch and unexplained colour), and the calibration is non-decreasing in the score, so a pair more alike
than another in every feature is never less likely a copy, and a pair more alike than any synthetic copy (a
mirrored copy with --flips) keeps the highest odds instead of falling outside what the fit saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import brentq, isotonic_regression
from scipy.special import expit

from search.duplicates.align import FEATURES
from search.duplicates.config import DedupConfig

NAMES = (*FEATURES, "descriptor")
# +1: larger is more alike (correlations, coverage, cosine); -1: smaller is (stretch, unexplained colour)
SIGN = np.array([1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
MIN_SHARE = 1e-6


def signs(columns: int) -> np.ndarray:
    """SIGN for a design of `columns` columns: columns past NAMES (the copy encoder's cosine with verifier
    "both") are "larger is more alike"."""
    return np.r_[SIGN, np.ones(max(0, columns - len(SIGN)))]


def design(features: np.ndarray, cosine: np.ndarray) -> np.ndarray:
    """(n, len(NAMES)) model inputs: correlations as Fisher z (a copy's 0.995 and 0.9995 differ as much
    as 0.9 and 0.99 do), the chroma residual as a log, coverage and stretch as they are."""
    f = np.asarray(features, dtype=np.float64)
    z = lambda v: np.arctanh(np.clip(v, -0.999, 0.99999))  # noqa: E731
    return np.column_stack(
        [z(f[:, 0]), z(f[:, 1]), f[:, 2], f[:, 3], np.log(f[:, 4] + 1e-3), z(np.asarray(cosine, np.float64))]
    )


def knots_of(x: np.ndarray, segments: int) -> list[np.ndarray]:
    """Per feature, the increasing knots of its piecewise-linear function (quantiles of the signed values;
    a feature with a single value gets no piece)."""
    sx = np.asarray(x, np.float64) * signs(np.shape(x)[1])
    return [np.unique(np.quantile(sx[:, j], np.linspace(0, 1, segments + 1))) for j in range(sx.shape[1])]


def basis(x: np.ndarray, knots: list[np.ndarray]) -> np.ndarray:
    """(n, pieces) how far each pair's signed feature runs through each piece, 0..1: with non-negative
    weights any sum of these is non-decreasing in every signed feature (and flat past the outer knots)."""
    sx = np.asarray(x, np.float64) * signs(np.shape(x)[1])
    cols = []
    for j, k in enumerate(knots):
        if k.size > 1:
            lo, hi = k[:-1], k[1:]
            cols.append((np.clip(sx[:, j, None], lo, hi) - lo) / (hi - lo))
    return np.concatenate(cols, axis=1) if cols else np.zeros((len(sx), 0))


def fit_monotone(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float, start=None, steps: int = 50
) -> np.ndarray:
    """Weighted ridge logistic regression on basis columns with non-negative slopes -> coefficients (intercept
    last, free and not penalised): projected Newton (the slopes at zero whose gradient pushes them below it
    held there, a Newton step on the rest, halved until the loss falls)."""
    xa = np.column_stack([x, np.ones(len(x))])
    pen = np.full(xa.shape[1], l2 * w.sum())
    pen[-1] = 0.0
    bounded = np.r_[np.ones(x.shape[1], bool), False]

    def loss(beta):
        f = xa @ beta
        return w @ (np.logaddexp(0.0, f) - y * f) + 0.5 * pen @ (beta * beta)

    beta = np.zeros(xa.shape[1]) if start is None else np.maximum(np.asarray(start, np.float64), 0.0)
    beta[-1] = 0.0 if start is None else start[-1]
    val = loss(beta)
    for _ in range(steps):
        p = expit(xa @ beta)
        g = xa.T @ (w * (p - y)) + pen * beta
        free = ~bounded | (beta > 1e-12) | (g < 0)
        h = (xa[:, free] * (w * p * (1 - p))[:, None]).T @ xa[:, free] + np.diag(pen[free] + 1e-9)
        d = np.zeros_like(beta)
        d[free] = -np.linalg.solve(h, g[free])
        t = 1.0
        while t > 1e-6:
            cand = beta + t * d
            cand[bounded] = np.maximum(cand[bounded], 0.0)
            new = loss(cand)
            if new <= val:
                break
            t /= 2
        else:
            break
        moved = np.abs(cand - beta).max()
        beta, val = cand, new
        if moved < 1e-7:
            break
    return beta


@dataclass
class DuplicateModel:
    """What a scan's probabilities are: a pair's score s(x) = coef . basis(x, knots) + intercept, its ratio
    log R(s) read off the calibration (scores `cal_s`, non-decreasing log ratios `cal_logr`, linear between),
    p = min(1, share R(s)); `bound` names a limit the fit reached ("" when none)."""

    knots: list
    coef: np.ndarray
    share: float
    cal_s: np.ndarray
    cal_logr: np.ndarray
    bound: str = ""
    positives: int = 0
    candidates: int = 0
    copy_recall: float = float("nan")  # held-out synthetic copies at p >= the default threshold
    history: list = field(default_factory=list)

    def score(self, x: np.ndarray) -> np.ndarray:
        return basis(x, self.knots) @ self.coef[:-1] + self.coef[-1]

    def log_ratio(self, x: np.ndarray) -> np.ndarray:
        return np.interp(self.score(x), self.cal_s, self.cal_logr)

    def probability(self, x: np.ndarray, share: float | None = None) -> np.ndarray:
        s = self.share if share is None else share
        return np.exp(np.minimum(self.log_ratio(x) + np.log(max(s, MIN_SHARE)), 0.0))

    def to_json(self) -> dict:
        return {
            "features": list(NAMES) + ["encoder"] * (len(self.knots) - len(NAMES)),
            "sign": signs(len(self.knots)).tolist(),
            "knots": [k.tolist() for k in self.knots],
            "coef": self.coef.tolist(),
            "share": self.share,
            "calibration_scores": self.cal_s.tolist(),
            "calibration_log_ratios": self.cal_logr.tolist(),
            "bound": self.bound,
            "positives": self.positives,
            "candidates": self.candidates,
            "copy_recall": self.copy_recall,
        }

    @classmethod
    def from_json(cls, d: dict) -> "DuplicateModel":
        return cls(
            [np.asarray(k, np.float64) for k in d["knots"]],
            np.asarray(d["coef"]),
            float(d["share"]),
            np.asarray(d["calibration_scores"], np.float64),
            np.asarray(d["calibration_log_ratios"], np.float64),
            d.get("bound", ""),
            int(d.get("positives", 0)),
            int(d.get("candidates", 0)),
            float(d.get("copy_recall", float("nan"))),
        )


def _fit_balanced(bp, bu, wu, l2, start=None):
    x = np.vstack([bp, bu])
    y = np.r_[np.ones(len(bp)), np.zeros(len(bu))]
    w = np.r_[np.full(len(bp), max(wu.sum(), 1e-9) / len(bp)), wu]  # equal total weight: logit = log LR
    return fit_monotone(x, y, w / w.mean(), l2, start)


def mixture_share(sp: np.ndarray, su: np.ndarray, delta: float) -> tuple[float, float, float]:
    """Best Bin Estimation of the share of candidates that are copies, from the scores of copies (sp)
    and candidates (su) -> (share, the cut's copy fraction, the cut's candidate fraction): over the cuts t at
    each copy's score, the t minimising q_u(t) / q_p(t) plus a Hoeffding bound at confidence 1 - delta on
    both fractions, divided by q_p(t) (Garg et al. 2021, with their slack gamma at 0)."""
    sp, su = np.sort(np.asarray(sp, np.float64)), np.sort(np.asarray(su, np.float64))
    qp = 1.0 - np.searchsorted(sp, sp, side="left") / sp.size
    qu = 1.0 - np.searchsorted(su, sp, side="left") / su.size
    slack = np.sqrt(np.log(4 / delta) / (2 * sp.size)) + np.sqrt(np.log(4 / delta) / (2 * su.size))
    i = int(np.argmin((qu + slack) / qp))
    return float(qu[i] / qp[i]), float(qp[i]), float(qu[i])


def ratio_calibration(sp: np.ndarray, su: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The non-decreasing log R(s) of copies against candidates on their scores: the weighted isotonic
    (PAV) fit g of copy (weight 1 / #copies) against candidate (1 / #candidates), R = g / (1 - g); each
    block of equal g becomes its first and last score (linear between blocks)."""
    s = np.r_[sp, su]
    y = np.r_[np.ones(len(sp)), np.zeros(len(su))]
    w = np.r_[np.full(len(sp), 1.0 / len(sp)), np.full(len(su), 1.0 / len(su))]
    o = np.argsort(s, kind="stable")
    g = np.clip(isotonic_regression(y[o], weights=w[o]).x, 1e-9, 1 - 1e-9)
    s = s[o]
    edge = np.r_[True, g[1:] != g[:-1]]  # first of each block
    last = np.r_[edge[1:], True]
    keep = edge | last
    return s[keep], np.log(g[keep]) - np.log1p(-g[keep])


def mass_correction(log_ratio: np.ndarray, share: float) -> float:
    """log c >= 0 such that the candidates' probabilities min(1, c share R) average to the share: uncapped
    they do (the PU identity E_u[share R] = share), and the cap at 1 would otherwise drop the mass of the
    surest pairs from the rest."""
    lr = np.asarray(log_ratio, np.float64) + np.log(max(share, MIN_SHARE))
    need = share * lr.size

    def mass(c):
        return np.exp(np.minimum(lr + c, 0.0)).sum()

    if mass(0.0) >= need or mass(50.0) < need:
        return 0.0
    return float(brentq(lambda c: mass(c) - need, 0.0, 50.0, xtol=1e-12))  # mass rises with c


def fit_model(
    positives: np.ndarray,
    unlabelled: np.ndarray,
    *,
    l2: float,
    max_share: float,
    share_delta: float = DedupConfig.share_delta,
    threshold: float = 0.5,
    segments: int = DedupConfig.segments,
) -> DuplicateModel:
    """The positive-unlabelled fit of the module docstring; positives and unlabelled are `design` rows."""
    if len(positives) < 4 or len(unlabelled) < 4:
        raise ValueError(
            f"duplicate fit needs at least 4 copies and 4 candidate pairs, got {len(positives)} and "
            f"{len(unlabelled)}"
        )
    knots = knots_of(np.vstack([positives, unlabelled]), segments)
    xp, xu = basis(positives, knots), basis(unlabelled, knots)
    ones = np.ones(len(xu))
    coef = _fit_balanced(xp, xu, ones, l2)
    sp, su = xp @ coef[:-1] + coef[-1], xu @ coef[:-1] + coef[-1]
    share, qp, qu = mixture_share(sp, su, share_delta)
    cal_s, cal_logr = ratio_calibration(sp, su)
    cal_logr = cal_logr + mass_correction(np.interp(su, cal_s, cal_logr), min(share, max_share))
    bound = ""
    if share >= max_share:
        share = max_share
        bound = (
            f"the share of candidate pairs that are duplicates is at its bound {max_share:g}: "
            "the synthetic copies look no more alike than this collection's neighbours (the edits the fit "
            "knows do not tell them apart); inspect the page and raise --threshold, or check the "
            "collection is not mostly copies"
        )
    share = max(share, MIN_SHARE)
    model = DuplicateModel(knots, coef, share, cal_s, cal_logr, bound, len(xp), len(xu), history=[qp, qu])
    # held-out copy recall: each half of the copies scored by a fit on the other half, at this share
    half = np.arange(len(xp)) % 2 == 0
    hits = []
    for held in (half, ~half):
        c = _fit_balanced(xp[~held], xu, ones, l2, coef)
        lr = np.interp(xp[held] @ c[:-1] + c[-1], cal_s, cal_logr)
        hits.append(np.minimum(lr + np.log(share), 0.0) >= np.log(threshold))
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
