"""One pass over the stored embeddings answers a whole batch of queries exactly: log Z and the top-k.

The exact normaliser must read every row for every query, so the exact top-k costs nothing more: the
same score block s = E_b q^T (rows b of the embeddings, all Q queries at once: one matrix product, so
a batch of Q queries reads the file once, not Q times) feeds a streaming logsumexp (running max of s,
terms exp((s - max) / tau) in float32, sums in float64) and a running top-k per query. No index search is
needed. The product runs in torch on the caller's thread count (the server's `--torch-threads`, 1 by default:
two batch threads use two cores without BLAS threads fighting for them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from index.paging import releasable, release_pages

__all__ = ["SCAN_BLOCK", "ScanResult", "ExactScanner"]

#: Query rows of the product at least (2-3 are padded with zero rows): a pass for 4 rows costs less
#: CPU than one for 2 (docs/results.md §23).
MIN_PRODUCT_ROWS = 4
#: Embedding rows per score block: (Q, SCAN_BLOCK) float32 + float64 scores, ~3 MB at Q = 32.
SCAN_BLOCK = 8192


@dataclass(frozen=True)
class ScanResult:
    """log Z (Q,) float64 and the best rows (Q, k) int64, best first (ties: lower row first)."""

    log_z: np.ndarray
    rows: np.ndarray


class ExactScanner:
    """The exact scan over one embeddings matrix (N, D) float32 (a memory map or an array).

    The torch view of the rows is made once (no copy); `release` unmaps a memory map's pages after
    each block, as the exact normaliser does (see index/paging.py)."""

    def __init__(self, embeddings: np.ndarray, release: bool = False, block: int = SCAN_BLOCK):
        self.embeddings = embeddings
        self.release = bool(release) and releasable(embeddings)
        self.block = int(block)
        rows = embeddings.view(np.ndarray) if isinstance(embeddings, np.memmap) else np.asarray(embeddings)
        if rows.dtype != np.float32 or not rows.flags.c_contiguous:
            rows = np.ascontiguousarray(rows, dtype=np.float32)
        with warnings.catch_warnings():  # a read-only memory map: torch never writes through this view
            warnings.simplefilter("ignore", UserWarning)
            self._rows = torch.from_numpy(rows)

    @property
    def count(self) -> int:
        return int(self._rows.shape[0])

    def __call__(self, queries: np.ndarray, temperatures: np.ndarray, k: int) -> ScanResult:
        """Exact log sum_j exp(q . e_j / tau_q) and the k rows of largest q . e_j, for each query.

        queries (Q, D) float32 (unit rows), temperatures (Q,) -> ScanResult (k clipped to N)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)  # (Q, D)
        n, n_q = self.count, queries.shape[0]
        if 1 < n_q < MIN_PRODUCT_ROWS:  # torch's product for 2-3 query rows costs more than for 4
            pad = np.zeros((MIN_PRODUCT_ROWS, queries.shape[1]), dtype=np.float32)
            pad[:n_q] = queries
            taus = np.ones(MIN_PRODUCT_ROWS)
            taus[:n_q] = temperatures
            full = self(pad, taus, k)
            return ScanResult(full.log_z[:n_q], full.rows[:n_q])
        q = torch.from_numpy(queries)
        inv_tau = (1.0 / np.asarray(temperatures, dtype=np.float64))[:, None]  # (Q, 1)
        k = min(int(k), n)
        inv32 = inv_tau.astype(np.float32)
        m = np.full(n_q, -np.inf, dtype=np.float32)  # running max of the similarities s
        acc = np.zeros(n_q)  # running sum of exp((s - m) / tau), float64
        best_s = np.full((n_q, k), -np.inf, dtype=np.float32)  # running top-k, best first
        best_r = np.full((n_q, k), -1, dtype=np.int64)
        for start in range(0, n, self.block):
            stop = min(n, start + self.block)
            s = (q @ self._rows[start:stop].T).numpy()  # (Q, B) float32: one product for the batch
            if self.release:
                release_pages(self.embeddings, start, stop)
            block_max = s.max(axis=1)
            new_m = np.maximum(m, block_max)
            # exp((s - m) / tau) in float32, summed in float64: s - m is exact near the maximum and off by
            # <= 2^-24 |s - m| elsewhere, where its term weighs exp(-|s - m| / tau): each term's relative
            # error stays ~1e-7 at any tau (float32 logits s / tau would be off by 2^-24 s / tau)
            d = s - new_m[:, None]
            d *= inv32
            np.exp(d, out=d)
            acc = acc * np.exp((m.astype(np.float64) - new_m) * inv_tau[:, 0]) + d.sum(
                axis=1, dtype=np.float64
            )
            m = new_m
            # top-k: only the queries whose block holds a score above their current k-th best
            better = np.flatnonzero(block_max > best_s[:, -1])
            if len(better):
                kb = min(k, stop - start)
                top_s, top_i = torch.topk(torch.from_numpy(s[better]), kb, dim=1)  # (b, kb)
                cand_s = np.concatenate([best_s[better], top_s.numpy()], axis=1)
                cand_r = np.concatenate([best_r[better], top_i.numpy() + start], axis=1)
                order = _best_first(cand_s, cand_r, k)
                best_s[better] = np.take_along_axis(cand_s, order, axis=1)
                best_r[better] = np.take_along_axis(cand_r, order, axis=1)
        return ScanResult(m.astype(np.float64) * inv_tau[:, 0] + np.log(acc), best_r)


def _best_first(scores: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Indices (b, k) along axis 1 of the k best (score desc, row asc) of each row."""
    order = np.lexsort((rows, -scores), axis=1)  # last key primary: score desc, then row asc
    return order[:, :k]
