"""Retrieval metrics from blocked exact top-k neighbour lists, and a bootstrap CI.

Definitions (per query, then averaged; `rel_i` = 1 when the i-th neighbour is relevant,
`n_rel` = number of relevant database items):
- recall@k     = 1[sum_{i<=k} rel_i > 0]  (the metric-learning "Recall@K": a relevant item is in the top k)
- precision@k  = (1/k) sum_{i<=k} rel_i
- mAP@k        = mean over queries of AP@k = (1/min(k, n_rel)) sum_{i<=k} precision@i * rel_i
- kNN accuracy = weighted vote (InstDisc: weight exp(s/0.07) over the k=200 neighbours) or a
                 plain majority vote (k=5); ties go to the smallest class id.
Relevance is label equality by default, or any `predicate(query_meta, db_meta) -> (q, n) bool`.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import numpy as np
import torch

from search.evaluation.gap import DeviceRows
from training.distributed import default_device

logger = logging.getLogger(__name__)

Predicate = Callable[[np.ndarray, np.ndarray], np.ndarray]


def knn_search(
    query_emb,
    db_emb,
    k: int,
    block_q: int = 1024,
    block_n: int = 65536,
    exclude: np.ndarray | None = None,
    device=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product, in (block_q, block_n) tiles: (scores (Q,k) float32, rows (Q,k) int64).

    `exclude[q]` is a database row to leave out for query q (its own row when the queries are
    database items), or -1 for none.
    """
    zq = np.asarray(query_emb, dtype=np.float32)
    zn = np.asarray(db_emb, dtype=np.float32)
    if zq.ndim != 2 or zn.ndim != 2 or zq.shape[1] != zn.shape[1]:
        raise ValueError(f"embedding shapes {zq.shape} and {zn.shape} are not (Q, D) and (N, D)")
    n_avail = zn.shape[0] - (1 if exclude is not None else 0)
    if not 1 <= k <= n_avail:
        raise ValueError(f"k={k} must be in [1, {n_avail}] for a database of {zn.shape[0]} items")
    if exclude is not None:
        exclude = np.asarray(exclude, dtype=np.int64)
        if exclude.shape != (zq.shape[0],):
            raise ValueError(f"exclude has shape {exclude.shape}, expected ({zq.shape[0]},)")
    dev = default_device(device)
    rq, rn = DeviceRows(zq, dev), DeviceRows(zn, dev)
    scores = np.empty((zq.shape[0], k), dtype=np.float32)
    rows = np.empty((zq.shape[0], k), dtype=np.int64)
    for q0 in range(0, zq.shape[0], block_q):
        xq = rq[q0 : q0 + block_q]
        bq = xq.shape[0]
        best_s = torch.full((bq, 0), -math.inf, device=dev)
        best_i = torch.zeros((bq, 0), dtype=torch.int64, device=dev)
        ex = None if exclude is None else torch.as_tensor(exclude[q0 : q0 + bq], device=dev)
        for n0 in range(0, zn.shape[0], block_n):
            xn = rn[n0 : n0 + block_n]
            s = xq @ xn.T  # (bq, bn)
            if ex is not None:
                local = ex - n0
                hit = (local >= 0) & (local < xn.shape[0])
                s[hit.nonzero().squeeze(1), local[hit]] = -math.inf
            ks = min(k, s.shape[1])
            ts, ti = torch.topk(s, ks, dim=1)
            cat_s = torch.cat([best_s, ts], dim=1)
            cat_i = torch.cat([best_i, ti + n0], dim=1)
            kk = min(k, cat_s.shape[1])
            best_s, order = torch.topk(cat_s, kk, dim=1)
            best_i = torch.gather(cat_i, 1, order)
        scores[q0 : q0 + bq] = best_s.cpu().numpy()
        rows[q0 : q0 + bq] = best_i.cpu().numpy()
    return scores, rows


def relevance(rows: np.ndarray, query_meta, db_meta, predicate: Predicate | None = None) -> np.ndarray:
    """(Q, k) bool: is neighbour rows[q, i] relevant to query q (label equality or `predicate`)."""
    rows = np.asarray(rows)
    db_meta = np.asarray(db_meta)
    query_meta = np.asarray(query_meta)
    if predicate is None:
        return db_meta[rows] == query_meta[:, None]
    out = np.empty(rows.shape, dtype=bool)
    for q in range(rows.shape[0]):
        out[q] = np.asarray(predicate(query_meta[q : q + 1], db_meta[rows[q]]), dtype=bool).reshape(-1)
    return out


def n_relevant(
    query_meta,
    db_meta,
    predicate: Predicate | None = None,
    block: int = 4096,
    exclude: np.ndarray | None = None,
) -> np.ndarray:
    """(Q,) number of relevant database items per query (minus the excluded own row if relevant)."""
    query_meta, db_meta = np.asarray(query_meta), np.asarray(db_meta)
    if predicate is None:
        classes, counts = np.unique(db_meta, return_counts=True)
        pos = np.clip(np.searchsorted(classes, query_meta), 0, max(classes.size - 1, 0))
        out = np.where(classes[pos] == query_meta, counts[pos], 0).astype(np.int64)
    else:
        out = np.zeros(len(query_meta), dtype=np.int64)
        for q0 in range(0, len(query_meta), block):
            for n0 in range(0, len(db_meta), block):
                r = np.asarray(predicate(query_meta[q0 : q0 + block], db_meta[n0 : n0 + block]), dtype=bool)
                out[q0 : q0 + block] += r.sum(1)
    if exclude is not None:
        exclude = np.asarray(exclude)
        has = exclude >= 0
        own = np.zeros(len(query_meta), dtype=bool)
        own[has] = relevance(exclude[has][:, None], query_meta[has], db_meta, predicate)[:, 0]
        out -= own
    return out


def hit_rate_at_k(rel: np.ndarray, k: int) -> np.ndarray:
    """(Q,) 1.0 where a relevant item is among the first k neighbours: the label "recall@k" of the
    retrieval literature (reports keep that name). Not index.faiss_index.recall_at_k, which is the overlap
    of an approximate top-k with the exact one."""
    _check_k(rel, k)
    return rel[:, :k].any(axis=1).astype(np.float64)


def precision_at_k(rel: np.ndarray, k: int) -> np.ndarray:
    """(Q,) fraction of the first k neighbours that are relevant."""
    _check_k(rel, k)
    return rel[:, :k].mean(axis=1)


def average_precision_at_k(rel: np.ndarray, k: int, n_rel: np.ndarray) -> np.ndarray:
    """(Q,) AP@k = (1/min(k, n_rel)) sum_{i<=k} P@i rel_i; 0 for queries with no relevant item."""
    _check_k(rel, k)
    r = rel[:, :k].astype(np.float64)
    prec_i = np.cumsum(r, axis=1) / np.arange(1, k + 1)  # P@i
    denom = np.minimum(k, np.asarray(n_rel))
    with np.errstate(invalid="ignore", divide="ignore"):
        ap = np.where(denom > 0, (prec_i * r).sum(1) / denom, 0.0)
    return ap


def map_at_k(rel: np.ndarray, k: int, n_rel: np.ndarray) -> float:
    return float(average_precision_at_k(rel, k, n_rel).mean())


def knn_predict(
    scores: np.ndarray,
    rows: np.ndarray,
    db_labels,
    k: int,
    n_classes: int | None = None,
    weighted: bool = True,
    knn_temperature: float = 0.07,
) -> np.ndarray:
    """(Q,) predicted labels by (weighted) vote of the first k neighbours.

    weighted: class score = sum over neighbours of that class of exp(s / 0.07) (InstDisc);
    otherwise a plain count. Ties go to the smallest class id (np.argmax)."""
    db_labels = np.asarray(db_labels, dtype=np.int64)
    if scores.shape[1] < k:
        raise ValueError(f"need at least k={k} neighbours, got {scores.shape[1]}")
    n_classes = int(n_classes if n_classes is not None else db_labels.max() + 1)
    lab = db_labels[rows[:, :k]]  # (Q, k)
    if weighted:
        s = scores[:, :k].astype(np.float64)
        w = np.exp((s - s[:, :1]) / knn_temperature)  # shift by the row max: same argmax
    else:
        w = np.ones(lab.shape)
    # votes[q, c] = sum of the weights of q's neighbours in class c (bincount over flat (q, c) ids)
    flat = (np.arange(lab.shape[0])[:, None] * n_classes + lab).ravel()
    votes = np.bincount(flat, weights=w.ravel(), minlength=lab.shape[0] * n_classes).reshape(
        lab.shape[0], n_classes
    )
    return votes.argmax(axis=1)


def knn_accuracy(
    scores, rows, db_labels, query_labels, k: int, weighted: bool = True, knn_temperature: float = 0.07
) -> np.ndarray:
    """(Q,) 1.0 where the kNN vote equals the query label."""
    query_labels = np.asarray(query_labels, dtype=np.int64)
    n_classes = int(max(np.max(db_labels), np.max(query_labels)) + 1)
    pred = knn_predict(scores, rows, db_labels, k, n_classes, weighted, knn_temperature)
    return (pred == query_labels).astype(np.float64)


def bootstrap_ci(
    per_query_values, n_boot: int = 1000, alpha: float = 0.05, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap CI of the mean over queries at level 1 - alpha."""
    v = np.asarray(per_query_values, dtype=np.float64).ravel()
    if v.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for b0 in range(0, n_boot, 256):  # resample in chunks to bound memory at 256 x n
        nb = min(256, n_boot - b0)
        idx = rng.integers(0, v.size, size=(nb, v.size))
        means[b0 : b0 + nb] = v[idx].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(v.mean()), float(lo), float(hi)


def retrieval_metrics(
    query_emb,
    db_emb,
    query_labels,
    db_labels,
    ks=(1, 5, 10),
    map_k: int = 100,
    exclude: np.ndarray | None = None,
    predicate: Predicate | None = None,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
    device=None,
    knn: bool = True,
) -> dict:
    """All metrics with bootstrap CIs: {"recall@k": {"mean", "low", "high"}, ..., "n_queries"}.

    kNN accuracy (k=200 weighted, k=5 majority) needs integer labels and no custom predicate."""
    n_db = np.asarray(db_emb).shape[0] - (1 if exclude is not None else 0)
    kmax = min(max(max(ks), map_k, 200 if knn else 0), n_db)
    scores, rows = knn_search(query_emb, db_emb, kmax, exclude=exclude, device=device)
    rel = relevance(rows, query_labels, db_labels, predicate)
    nrel = n_relevant(query_labels, db_labels, predicate, exclude=exclude)
    per_query: dict[str, np.ndarray] = {}
    for k in ks:
        kk = min(k, kmax)
        per_query[f"recall@{k}"] = hit_rate_at_k(rel, kk)
        per_query[f"precision@{k}"] = precision_at_k(rel, kk)
    per_query[f"mAP@{map_k}"] = average_precision_at_k(rel, min(map_k, kmax), nrel)
    if knn and predicate is None:
        per_query["knn200_weighted"] = knn_accuracy(
            scores, rows, db_labels, query_labels, min(200, kmax), True
        )
        per_query["knn5_majority"] = knn_accuracy(scores, rows, db_labels, query_labels, min(5, kmax), False)
    out: dict = {"n_queries": int(rel.shape[0]), "alpha": alpha, "n_boot": n_boot}
    for name, v in per_query.items():
        mean, lo, hi = bootstrap_ci(v, n_boot, alpha, seed)
        out[name] = {"mean": mean, "low": lo, "high": hi}
    return out


def _check_k(rel: np.ndarray, k: int) -> None:
    if not 1 <= k <= rel.shape[1]:
        raise ValueError(
            f"k={k} must be in [1, {rel.shape[1]}] (neighbour lists have {rel.shape[1]} entries)"
        )


def ideal_topk(
    query_meta, db_meta, generator, k: int, exclude: np.ndarray | None = None, max_elements: int = 1 << 24
) -> np.ndarray:
    """(Q, k) database rows of the ideal search's top k (largest log r; ties by row order).

    Blocks over queries only, so every `log_ratio` call sees the whole database (generators such
    as label normalise by database statistics)."""
    query_meta, db_meta = np.asarray(query_meta), np.asarray(db_meta)
    n = len(db_meta)
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, {n}]")
    bq = max(1, max_elements // max(n, 1))
    out = np.empty((len(query_meta), k), dtype=np.int64)
    for q0 in range(0, len(query_meta), bq):
        lr = np.asarray(generator.log_ratio(query_meta[q0 : q0 + bq], db_meta), dtype=np.float64)  # (bq, N)
        if exclude is not None:
            ex = np.asarray(exclude[q0 : q0 + bq])
            has = ex >= 0
            lr[np.flatnonzero(has), ex[has]] = -np.inf
        out[q0 : q0 + lr.shape[0]] = top_k_stable(lr, k)
    return out


def top_k_stable(values: np.ndarray, k: int) -> np.ndarray:
    """(B, k) columns of the k largest values per row, ties by column order: the first k columns of a
    stable descending argsort, from a partition (O(N)) and a stable sort of the candidates only
    (every column tied with the k-th largest value, so ties at the cut keep their order)."""
    n = values.shape[1]
    if k >= n:
        return np.argsort(-values, axis=1, kind="stable")[:, :k]
    kth = -np.partition(-values, k - 1, axis=1)[:, k - 1]  # (B,) the k-th largest value of each row
    out = np.empty((values.shape[0], k), dtype=np.int64)
    for i in range(values.shape[0]):
        cand = np.flatnonzero(values[i] >= kth[i])  # ascending columns: >= k of them
        out[i] = cand[np.argsort(-values[i, cand], kind="stable")[:k]]
    return out
