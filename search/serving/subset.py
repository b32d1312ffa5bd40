"""Softmax probabilities restricted to a filtered subset F of the index.

p(j | x, F) = exp(s_j / tau) / sum_{l in F} exp(s_l / tau): the exact normaliser is the log-sum-exp
over the subset's stored rows only (streamed in blocks of gathered rows, running max for range).
"""

from __future__ import annotations

import numpy as np

from index.faiss_index import search_subset

BLOCK = 65_536
#: Subsets up to this many rows are answered by one exact scan instead of FAISS with a selector.
EXACT_SUBSET_MAX = 32_768


def subset_search(
    index,
    embeddings: np.ndarray,
    queries: np.ndarray,
    k: int,
    mask: np.ndarray,
    temperatures: np.ndarray,
    block: int = BLOCK,
    exact_max: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(rows (Q, k') of the subset's top-k, exact log Z over the subset (Q,)).

    A subset of at most EXACT_SUBSET_MAX rows is scanned once: the same gathered block gives the top-k
    (exact, recall 1) and the log-sum-exp, which beats a graph or IVF walk that must skip 99 % of what it
    visits. A larger one is searched inside FAISS with an ID selector and its log Z streamed."""
    q = np.asarray(queries, dtype=np.float32)
    rows = np.flatnonzero(np.asarray(mask, dtype=bool))
    if rows.size == 0:
        return np.zeros((q.shape[0], 0), np.int64), np.full(q.shape[0], -np.inf)
    inv_tau = 1.0 / np.asarray(temperatures, dtype=np.float64)
    if rows.size > (EXACT_SUBSET_MAX if exact_max is None else exact_max):
        return subset_top_rows(index, embeddings, q, k, mask), _log_z_over(
            q, embeddings, inv_tau, rows, block
        )
    scores = q @ np.asarray(embeddings[rows]).T  # (Q, |F|) float32
    logits = scores.astype(np.float64) * inv_tau[:, None]
    m = logits.max(axis=1)
    log_z = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))  # log Z_F = logsumexp_{l in F}
    return _best_rows(scores, rows, k), log_z


def _best_rows(scores: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """(Q, k') `rows` of the k best columns of `scores` (Q, |rows|), best first (ties in row order)."""
    k = min(int(k), rows.size)
    top = (
        np.argpartition(-scores, k - 1, axis=1)[:, :k]
        if k < rows.size
        else np.broadcast_to(np.arange(rows.size), scores.shape)
    )
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
    return rows[np.take_along_axis(top, order, axis=1)]


def subset_log_normaliser(
    queries: np.ndarray,
    embeddings: np.ndarray,
    temperatures: np.ndarray,
    mask: np.ndarray,
    block: int = BLOCK,
) -> np.ndarray:
    """Exact log sum_{l: mask_l} exp(q . e_l / tau_q) per query; (Q,) float64, -inf for an empty subset."""
    return _log_z_over(
        np.asarray(queries, dtype=np.float32),
        embeddings,
        1.0 / np.asarray(temperatures, dtype=np.float64),
        np.flatnonzero(np.asarray(mask, dtype=bool)),
        block,
    )


def _log_z_over(
    q: np.ndarray, embeddings: np.ndarray, inv_tau: np.ndarray, rows: np.ndarray, block: int
) -> np.ndarray:
    """log sum_{l in rows} exp(q . e_l * inv_tau), streamed over blocks of gathered rows (running max)."""
    m = np.full(q.shape[0], -np.inf)  # running max of logits
    acc = np.zeros(q.shape[0])  # running sum of exp(logit - m)
    for start in range(0, rows.size, block):
        logits = (q @ np.asarray(embeddings[rows[start : start + block]]).T).astype(np.float64) * inv_tau[
            :, None
        ]
        new_m = np.maximum(m, logits.max(axis=1))
        acc = acc * np.exp(m - new_m) + np.exp(logits - new_m[:, None]).sum(axis=1)
        m = new_m
    with np.errstate(divide="ignore"):
        return m + np.log(acc)


def subset_top_rows(
    index, embeddings: np.ndarray, queries: np.ndarray, k: int, mask: np.ndarray
) -> np.ndarray:
    """(Q, k') rows of the top-k within the subset: FAISS with an ID selector, or an exact scan of the
    subset's rows where the index cannot take a selector (GPU indexes)."""
    try:
        return search_subset(index, queries, k, mask)[1]
    except RuntimeError:  # faiss: selector not supported by this index type
        rows = np.flatnonzero(np.asarray(mask, dtype=bool))
        return _best_rows(np.asarray(queries, dtype=np.float32) @ np.asarray(embeddings[rows]).T, rows, k)


def filtered_search(
    index,
    embeddings: np.ndarray,
    queries: np.ndarray,
    k: int,
    mask: np.ndarray,
    temperature: float,
    exact_max: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Array-level form of `SearchSnapshot.search(..., mask=)` (benchmarks, tests): the subset's top-k with
    exact similarities and p(j | x, F) = exp(s_j / tau - log Z_F). Returns (probabilities (Q, k'), rows)."""
    q = np.asarray(queries, dtype=np.float32)
    tau = np.full(q.shape[0], float(temperature))
    rows, log_z = subset_search(index, embeddings, q, k, mask, tau, exact_max=exact_max)
    sims = np.einsum(
        "qd,qkd->qk", q.astype(np.float64), np.asarray(embeddings)[np.maximum(rows, 0)].astype(np.float64)
    )
    p = np.exp(sims / tau[:, None] - log_z[:, None])
    p[rows < 0] = 0.0
    return p, rows
