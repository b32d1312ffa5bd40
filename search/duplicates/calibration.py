"""The duplicate temperature: p(j | x) calibrated as "j is the original that x was copied from".

Model (a softmax over the index with a "no original here" option of score b):

    p(j | x) = exp(s_j / tau) / (exp(b / tau) + sum_l exp(s_l / tau)),   p(none | x) = exp(b / tau) / (same)

(tau, b) are fitted by maximum likelihood -- a proper scoring rule, so the fitted probabilities are
calibrated -- on two kinds of queries made from the collection itself: edited copies of sampled items
(their original is indexed: the true answer is that item) and indexed items searched against the
index without themselves (no copy of theirs is planted: the true answer is "none"; their nearest
neighbours are the same-class look-alikes that must not count as duplicates). Each query keeps its top
similarities exactly and the rest as a fine histogram, so log Z at any (tau, b) costs O(TOP + BINS).

The look-alikes that decide the fit are a few per hundred items, so the "none" queries are drawn with more
of them than a uniform sample holds (job.py `hard_negative_sample`: strata by the nearest other item's
cosine) and each carries its inverse inclusion weight, w_i = N_h / n_h of its stratum: every likelihood,
ECE and precision below is the weighted one, an unbiased estimate of the uniform-sample figure with far
less variance where it matters.

At the verified stage the score of a candidate is its evidence less what its match's penalties cost
(verify.Match.penalties: the stretch beyond pixel rounding, the squared log crop, the worst local window's
structure deficit),

    s_j = e_j - w . g_j,    w >= 0,

and (tau, b, w) are fitted together: in (1/tau, b/tau, w/tau) the negative log-likelihood of a softmax
whose logits are linear in those parameters is convex, so one L-BFGS-B run finds its minimum.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

from .verify import PENALTIES

logger = logging.getLogger(__name__)

TOP = 256                 # similarities per query kept exactly
BIN_WIDTH = 1e-3          # histogram of the rest over [-1, 1]
EDGES = np.linspace(-1.0, 1.0, int(round(2.0 / BIN_WIDTH)) + 1)
CENTRES = 0.5 * (EDGES[:-1] + EDGES[1:])
ECE_BINS = 15
MAX_THRESHOLD = 0.9999
SHARE_LIMIT = 1e-6        # a collection's duplicate share is kept in [SHARE_LIMIT, 1 - SHARE_LIMIT]


@dataclass
class QueryScores:
    """One calibration query: its top similarities (descending) with their rows, the histogram of the
    others, and the row of its true original (-1: none is indexed)."""

    top: np.ndarray
    top_rows: np.ndarray
    tail_counts: np.ndarray
    source: int
    geometry: np.ndarray | None = None     # (len(top), PENALTIES) verify.Match.penalties of each top candidate
    weight: float = 1.0                     # inverse inclusion weight of the query's sample (1: uniform)

    def weighed(self, weights) -> "QueryScores":
        """The same query with each score less what its geometry costs, s_j - w . g_j, re-sorted (itself when
        it has no geometry or the weights are zero)."""
        w = np.asarray(weights, dtype=np.float64)
        if self.geometry is None or not w.any():
            return self
        s = self.top - self.geometry @ w
        order = np.argsort(-s, kind="stable")
        return QueryScores(s[order], self.top_rows[order], self.tail_counts, self.source, self.geometry[order],
                           self.weight)

    def log_z(self, tau: float, bias: float) -> float:
        """log(exp(b/tau) + sum_l exp(s_l/tau)) from the exact top and the histogram of the rest."""
        nz = self.tail_counts > 0
        parts = [np.array([bias / tau]), self.top / tau, CENTRES[nz] / tau + np.log(self.tail_counts[nz])]
        return float(logsumexp(np.concatenate(parts)))


def query_scores(similarities: np.ndarray, source: int, exclude: int | None = None) -> QueryScores:
    """QueryScores from one query's similarities to every indexed row (`exclude`: a row left out, the
    query item itself when it is indexed)."""
    s = np.asarray(similarities, dtype=np.float64).copy()
    if exclude is not None:
        s[exclude] = -np.inf
    k = min(TOP, int(np.isfinite(s).sum()))
    top_rows = np.argpartition(-s, k - 1)[:k] if k < s.size else np.arange(s.size)
    top_rows = top_rows[np.argsort(-s[top_rows], kind="stable")]
    top_rows = top_rows[np.isfinite(s[top_rows])]
    rest = np.ones(s.size, bool)
    rest[top_rows] = False
    rest &= np.isfinite(s)
    counts, _ = np.histogram(np.clip(s[rest], -1.0, 1.0), bins=EDGES)
    return QueryScores(s[top_rows], top_rows.astype(np.int64), counts.astype(np.float64), int(source))


def scored_candidates(scores: np.ndarray, rows: np.ndarray, source: int, geometry=None,
                      weight: float = 1.0) -> QueryScores:
    """QueryScores of a query whose only candidates are `rows` with `scores` (the verified stage: every
    other item has probability 0, so there is no tail); `geometry`: (k, PENALTIES) per candidate, or None."""
    scores, rows = np.asarray(scores, dtype=np.float64), np.asarray(rows, dtype=np.int64)
    keep = np.isfinite(scores)
    scores, rows = scores[keep], rows[keep]
    order = np.argsort(-scores, kind="stable")
    geo = None if geometry is None else np.asarray(geometry, dtype=np.float64).reshape(-1, PENALTIES)[keep][order]
    return QueryScores(scores[order], rows[order], np.zeros(CENTRES.size), int(source), geo, float(weight))


def _padded(weights) -> list[float]:
    """Penalty weights of a saved calibration, zeros for penalties added since (they were not fitted)."""
    weights = [float(w) for w in weights][:PENALTIES]
    return weights + [0.0] * (PENALTIES - len(weights))


@dataclass
class DuplicateCalibration:
    """Fitted (temperature, bias), the threshold for a target precision, and how well it holds out."""

    temperature: float
    bias: float
    threshold: float
    target_precision: float
    ece: float                       # expected calibration error of the top-1 probability, held-out queries
    held_out: int
    reliability: list[dict] = field(default_factory=list)   # per bin: mean predicted, observed, count
    positives: list[float] = field(default_factory=list)    # held-out top-1 p of copies (their original)
    negatives: list[float] = field(default_factory=list)    # held-out top-1 p of items with no copy
    negative_weights: list[float] = field(default_factory=list)   # their inverse inclusion weights (mean 1)
    fitted_on: int = 0
    # the most sure the model can be: an identical copy (s = 1) alone against "none", 1 / (1 + e^{-(1-b)/tau})
    max_probability: float = 1.0
    precision_curve: list[dict] = field(default_factory=list)   # {"threshold", "pairs", "precision"} per p level
    # "encoder": s_j is the embedding cosine over the whole index; "verified": s_j is the verification
    # score (verify.py) of the `verify_k` nearest items whose cosine is >= `floor`, every other item at p = 0
    stage: str = "encoder"
    verify_k: int = 0
    floor: float = -1.0
    # w of s_j = e_j - w . g_j at the verified stage (verify.Match.penalties: the stretch, the squared log crop,
    # the local-structure deficit); zeros: none fitted. The name predates the third, non-geometric penalty
    geometry_weights: list[float] = field(default_factory=lambda: [0.0] * PENALTIES)

    def energy(self, evidence: np.ndarray, geometry: np.ndarray) -> np.ndarray:
        """s_j = e_j - w . g_j: the verified score the softmax reads at temperature tau."""
        g = np.asarray(geometry, dtype=np.float64).reshape(-1, PENALTIES)
        return np.asarray(evidence, dtype=np.float64) - g @ np.asarray(self.geometry_weights, dtype=np.float64)

    @property
    def design_share(self) -> float:
        """The share of the calibration queries (weighted) that have their original indexed: the prior the fitted
        b carries (about one half by design: as many copies as "none" queries)."""
        pos = len(self.positives)
        neg = float(sum(self.negative_weights)) if self.negative_weights else float(len(self.negatives))
        return pos / (pos + neg) if pos + neg > 0 else 0.5

    def with_share(self, share: float) -> "DuplicateCalibration":
        """The same model for a collection where a share `pi` of the items have a duplicate, instead of the
        calibration's pi0 (design_share): Bayes' rule re-weighs "a duplicate" by pi / pi0 and "none" by
        (1 - pi) / (1 - pi0), which is the bias

            b' = b + tau * log[((1 - pi) / (1 - pi0)) / (pi / pi0)]

        (the likelihoods the fit learned are unchanged; only the prior moves)."""
        pi0 = self.design_share
        pi = float(np.clip(share, SHARE_LIMIT, 1.0 - SHARE_LIMIT))
        shift = np.log((1.0 - pi) / (1.0 - pi0)) - np.log(pi / pi0)
        return replace(self, bias=float(self.bias + self.temperature * shift),
                       max_probability=float(1.0 / (1.0 + (1.0 / self.max_probability - 1.0) * np.exp(shift)))
                       if 0.0 < self.max_probability < 1.0 else self.max_probability)

    @property
    def reachable(self) -> bool:
        """Whether some threshold reaches the target precision on the calibration queries."""
        return any(row["precision"] >= self.target_precision for row in self.precision_curve if row["pairs"])

    def limit_note(self) -> str:
        """One line on what this encoder can promise on this collection when the target is out of reach."""
        best = max((r for r in self.precision_curve if r["pairs"]), key=lambda r: r["precision"], default=None)
        return (f"the target precision {self.target_precision:.3g} is out of reach here: this encoder is at most "
                f"{self.max_probability:.3g} sure (look-alikes in the collection are as close as edited copies)"
                + (f"; best on the calibration queries: precision {best['precision']:.3f} at p >= "
                   f"{best['threshold']:.3g} (--threshold)" if best else ""))

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("temperature", "bias", "threshold", "target_precision", "ece",
                                              "held_out", "fitted_on", "reliability", "positives", "negatives",
                                              "negative_weights", "max_probability", "precision_curve", "stage",
                                              "verify_k", "floor", "geometry_weights")}

    @classmethod
    def from_json(cls, data: dict) -> "DuplicateCalibration":
        return cls(**{k: data[k] for k in ("temperature", "bias", "threshold", "target_precision", "ece",
                                           "held_out")},
                   **{k: data.get(k, []) for k in ("reliability", "positives", "negatives", "negative_weights",
                                                     "precision_curve")},
                   fitted_on=int(data.get("fitted_on", 0)), max_probability=float(data.get("max_probability", 1.0)),
                   stage=str(data.get("stage", "encoder")), verify_k=int(data.get("verify_k", 0)),
                   floor=float(data.get("floor", -1.0)),
                   geometry_weights=_padded(data.get("geometry_weights", [])))


class _Stacked:
    """All queries as arrays, so the likelihood at one (tau, b) is a few vectorised operations."""

    def __init__(self, queries: list[QueryScores]):
        n = len(queries)
        self.top = np.full((n, TOP), -np.inf)
        for i, q in enumerate(queries):
            self.top[i, : q.top.size] = q.top
        counts = np.stack([q.tail_counts for q in queries])
        used = np.flatnonzero(counts.sum(axis=0) > 0)
        with np.errstate(divide="ignore"):
            self.log_counts = np.log(counts[:, used])
        self.centres = CENTRES[used]
        self.is_copy = np.array([q.source >= 0 for q in queries])
        self.geometry = np.zeros((n, TOP, PENALTIES))
        for i, q in enumerate(queries):
            if q.geometry is not None:
                self.geometry[i, : q.top.size] = q.geometry
        self.source_at = np.array([np.flatnonzero(q.top_rows == q.source)[0]
                                   if q.source >= 0 and (q.top_rows == q.source).any() else -1 for q in queries])
        # the original's similarity (an original outside the kept top has similarity <= the last kept one;
        # counting it at -1 gives it (almost) zero probability, the honest worst case)
        found = self.source_at >= 0
        self.source_sim = np.where(found, self.top[np.arange(n), np.maximum(self.source_at, 0)], -1.0)
        # every mean over queries is the weighted one (weights normalised to sum to 1)
        w = np.array([q.weight for q in queries], dtype=np.float64)
        self.weights = w / w.sum()

    def nll(self, params: np.ndarray) -> float:
        tau, bias = float(np.exp(params[0])), float(params[1])
        logits = np.concatenate([np.full((self.top.shape[0], 1), bias / tau), self.top / tau,
                                 self.centres / tau + self.log_counts], axis=1)
        log_z = logsumexp(logits, axis=1)
        chosen = np.where(self.is_copy, self.source_sim / tau, bias / tau)
        return float(self.weights @ (log_z - chosen))


def fit_with_geometry(queries: list[QueryScores]) -> tuple[float, float, list[float]]:
    """(tau, b, w) maximising the likelihood of the true answers with s_j = e_j - w . g_j (verified queries,
    no tail). Parametrised as a = 1/tau, c = b/tau, u = w/tau: logits a e_j - u . g_j against c are linear,
    the negative log-likelihood convex; L-BFGS-B with its exact gradient, a > 0 and u >= 0."""
    st = _Stacked(queries)
    e = np.where(np.isfinite(st.top), st.top, 0.0)
    valid = np.isfinite(st.top)
    n = e.shape[0]
    chosen = st.source_at
    wq = st.weights

    def nll_grad(x):
        a, c, u = x[0], x[1], x[2:]
        logits = np.where(valid, a * e - st.geometry @ u, -np.inf)
        full = np.concatenate([np.full((n, 1), c), logits], axis=1)
        log_z = logsumexp(full, axis=1)
        p = np.exp(full - log_z[:, None])                      # (n, 1 + TOP)
        pick = np.zeros_like(p)
        pick[np.arange(n), chosen + 1] = 1.0                   # chosen -1 -> column 0, "none"
        value = wq @ (log_z - np.where(chosen >= 0, logits[np.arange(n), np.maximum(chosen, 0)], c))
        diff = (p - pick)[:, 1:]                               # d/dlogit of the candidates
        grad = np.concatenate([[wq @ np.sum(diff * e, axis=1)], [wq @ (p[:, 0] - pick[:, 0])],
                               -(wq @ np.einsum("nk,nkd->nd", diff, st.geometry))])
        return float(value), grad

    best = None
    for a0, c0 in ((1.0, 5.0), (3.0, 20.0), (0.5, 2.0)):
        result = minimize(nll_grad, np.array([a0, c0] + [0.0] * PENALTIES), jac=True, method="L-BFGS-B",
                           bounds=[(1e-3, None), (None, None)] + [(0.0, None)] * PENALTIES)
        if best is None or result.fun < best.fun:
            best = result
    a, c, u = best.x[0], best.x[1], best.x[2:]
    return float(1.0 / a), float(c / a), [float(v / a) for v in u]


def collection_share(p_none, design_share: float, iterations: int = 1000, tol: float = 1e-10) -> float:
    """The share pi of scanned items that have a duplicate, estimated without labels from each item's
    p(none | item) under the calibration's prior pi0 by EM (Saerens, Latinne & Decaestecker 2002, "Adjusting
    the outputs of a classifier to new a priori probabilities"): re-weigh every posterior to the current pi,

        q_i = (1 - p_i) a / ((1 - p_i) a + p_i c),   a = pi / pi0,  c = (1 - pi) / (1 - pi0),

    and set pi to the mean of q_i, until it stops moving (each step raises the likelihood of the scan)."""
    p = np.clip(np.asarray(p_none, dtype=np.float64), 0.0, 1.0)
    if p.size == 0:
        raise ValueError("collection_share needs at least one scanned item")
    pi0 = float(design_share)
    pi = pi0
    for _ in range(iterations):
        a, c = pi / pi0, (1.0 - pi) / (1.0 - pi0)
        new = float(np.clip(np.mean((1.0 - p) * a / ((1.0 - p) * a + p * c)), SHARE_LIMIT, 1.0 - SHARE_LIMIT))
        if abs(new - pi) < tol:
            return new
        pi = new
    return pi


def fit(queries: list[QueryScores]) -> tuple[float, float]:
    """(tau, b) maximising the likelihood of the true answers (Nelder-Mead over log tau and b)."""
    stacked = _Stacked(queries)
    best = None
    for tau0, b0 in ((0.01, 0.9), (0.05, 0.8), (0.003, 0.97), (0.5, 5.0), (1.0, 4.0), (0.3, 7.0)):
        result = minimize(stacked.nll, np.array([np.log(tau0), b0]), method="Nelder-Mead",
                          options={"xatol": 1e-6, "fatol": 1e-9, "maxiter": 4000})
        if best is None or result.fun < best.fun:
            best = result
    return float(np.exp(best.x[0])), float(best.x[1])


def top1(q: QueryScores, tau: float, bias: float) -> tuple[float, bool]:
    """(p of the most probable indexed item, whether it is the true original)."""
    if q.top.size == 0:
        return 0.0, False
    p = float(np.exp(q.top[0] / tau - q.log_z(tau, bias)))
    return p, bool(q.source >= 0 and q.top_rows[0] == q.source)


def expected_calibration_error(conf: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS, weights=None
                               ) -> tuple[float, list[dict]]:
    """ECE = sum_b W(B)/W |mean conf - accuracy| over equal-width bins (means weighted by `weights`, the
    queries' inverse inclusion weights; None: all 1), and the reliability table ("count": queries in the bin)."""
    conf, correct = np.asarray(conf, float), np.asarray(correct, float)
    w = np.ones(conf.size) if weights is None else np.asarray(weights, float)
    which = np.minimum((conf * bins).astype(int), bins - 1)
    ece, table = 0.0, []
    for b in range(bins):
        sel = which == b
        if sel.any():
            predicted, observed = np.average(conf[sel], weights=w[sel]), np.average(correct[sel], weights=w[sel])
            ece += w[sel].sum() / w.sum() * abs(predicted - observed)
            table.append({"lower": b / bins, "upper": (b + 1) / bins, "predicted": float(predicted),
                          "observed": float(observed), "count": int(sel.sum())})
    return float(ece), table


def threshold_for_precision(conf: np.ndarray, correct: np.ndarray, target: float, weights=None) -> float:
    """The smallest p at which pairs with top-1 p >= it are correct at least `target` of the time on the
    calibration queries (weighted by `weights`) -- never below `target` itself (a calibrated p >= target is
    that sure)."""
    order = np.argsort(-np.asarray(conf), kind="stable")
    w = (np.ones(len(order)) if weights is None else np.asarray(weights, float))[order]
    conf, correct = np.asarray(conf)[order], np.asarray(correct, float)[order]
    precision = np.cumsum(correct * w) / np.cumsum(w)
    run_end = np.append(conf[1:] < conf[:-1], True)   # "p >= c_j" keeps every query tied with c_j
    ok = np.flatnonzero((precision >= target) & run_end)
    if not ok.size:
        logger.warning("no threshold reaches precision %.3g on the calibration queries; using p >= %.3g", target, target)
        return float(target)
    # the longest prefix (lowest threshold) whose precision still meets the target
    return min(max(float(target), float(conf[ok[-1]])), MAX_THRESHOLD)


LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)


def threshold_for_expected_precision(confidences, target: float, levels=None) -> float | None:
    """The lowest threshold t whose groups (confidence >= t) are expected to be right at least `target` of the
    time -- mean confidence >= target, since a calibrated p is the chance a group is a duplicate -- with no
    labels and no count of rare look-alikes (the calibration queries' own precision at the top rests on a
    handful of negatives). With groups sorted by confidence c_1 >= c_2 >= ..., the prefix means
    m_j = (c_1 + ... + c_j) / j never rise, so the longest prefix with m_j >= target keeps the most groups
    (the most expected true pairs) at that expected precision: t = c_j. `levels`: pick t from these fixed
    levels instead (the rule before 2026-12-06). None: no group reaches it."""
    c = np.sort(np.asarray(confidences, dtype=np.float64))[::-1]
    if levels is not None:
        for t in sorted(levels):
            kept = c[c >= t]
            if kept.size and kept.mean() >= target:
                return float(t)
        return None
    prefix_mean = np.cumsum(c) / np.arange(1, c.size + 1)
    run_end = np.append(c[1:] < c[:-1], True)   # t = c_j keeps every group tied with c_j: only ends of ties
    ok = np.flatnonzero((prefix_mean >= target) & run_end)
    # P must stay below 1 (find_duplicates); groups at >= MAX_THRESHOLD are above any target anyway
    return min(float(c[ok[-1]]), MAX_THRESHOLD) if ok.size else None


def default_level(confidences, target: float, floor: float = 0.0, levels=None) -> float | None:
    """The default P of `softsearch dedup`: threshold_for_expected_precision, never below `floor` (job.py
    MIN_PROBABILITY: every group kept at least that sure, so that the target's budget of expected wrong pairs,
    1 - target of those kept, is not spent on one look-alike the model is 70 % sure of). None: no group reaches the
    target."""
    found = threshold_for_expected_precision(confidences, target, levels)
    return None if found is None else max(float(found), min(float(floor), MAX_THRESHOLD))


def precision_curve(conf: np.ndarray, correct: np.ndarray, levels=LEVELS, weights=None) -> list[dict]:
    """Precision of "top-1 p >= t" on the calibration queries at each level t (weighted; how many reach it)."""
    conf, correct = np.asarray(conf), np.asarray(correct, float)
    w = np.ones(conf.size) if weights is None else np.asarray(weights, float)
    return [{"threshold": t, "pairs": int((conf >= t).sum()),
             "precision": float(np.average(correct[conf >= t], weights=w[conf >= t])) if (conf >= t).any() else 1.0}
            for t in levels]


def _fitted(queries: list[QueryScores]) -> tuple[float, float, list[float]]:
    """(tau, b, w): with geometry when the queries carry it (the verified stage), else w = 0."""
    if any(q.geometry is not None for q in queries):
        return fit_with_geometry(queries)
    return (*fit(queries), [0.0] * PENALTIES)


def _top1_all(queries: list[QueryScores], tau: float, bias: float, weights) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 p, whether it is the true original) of each query under (tau, b, w)."""
    scored = [top1(q.weighed(weights), tau, bias) for q in queries]
    return np.array([c for c, _ in scored], dtype=np.float64), np.array([ok for _, ok in scored], dtype=bool)


def calibrate(queries: list[QueryScores], target_precision: float = 0.99, seed: int = 0,
              best_score: float = 1.0) -> DuplicateCalibration:
    """Fit (tau, b, w) on all the queries; measure ECE and the score distributions by two-fold cross-fitting
    (each half scored by the fit on the other half: every query held out once, none judged by a fit that saw
    it); the threshold comes from the final fit on all of them. The look-alikes that decide the geometry
    weights are a few per hundred queries, so a fit on half of them varies more than it needs to.
    `best_score`: the score of an identical copy (for max_probability)."""
    if len(queries) < 20:
        raise ValueError(f"duplicate calibration needs at least 20 queries, got {len(queries)}")
    order = np.random.default_rng(seed).permutation(len(queries))
    halves = [[queries[i] for i in order[: len(order) // 2]], [queries[i] for i in order[len(order) // 2:]]]
    held = halves[1] + halves[0]
    out_of_fold = [_top1_all(halves[1 - h], *_fitted(halves[h])) for h in (0, 1)]
    conf = np.concatenate([c for c, _ in out_of_fold])
    correct = np.concatenate([ok for _, ok in out_of_fold])
    ece, table = expected_calibration_error(conf, correct, weights=[q.weight for q in held])
    tau, bias, weights = _fitted(queries)
    all_conf, all_correct = _top1_all(queries, tau, bias, weights)
    sample_weights = [q.weight for q in queries]
    threshold = threshold_for_precision(all_conf, all_correct, target_precision, sample_weights)
    return DuplicateCalibration(
        temperature=tau, bias=bias, threshold=threshold, target_precision=float(target_precision), ece=ece,
        held_out=len(held), reliability=table, fitted_on=len(queries),
        max_probability=float(1.0 / (1.0 + np.exp(-(best_score - bias) / tau))),
        precision_curve=precision_curve(all_conf, all_correct, weights=sample_weights),
        positives=[float(c) for c, q in zip(conf, held) if q.source >= 0],
        negatives=[float(c) for c, q in zip(conf, held) if q.source < 0],
        negative_weights=[float(q.weight) for q in held if q.source < 0], geometry_weights=list(weights))
