"""One pass over the stored embeddings answers a whole batch of queries exactly: log Z and the top-k.

The exact normaliser must read every row for every query, so the exact top-k costs nothing more: the
same score block s = E_b q^T (rows b of the embeddings, all Q queries at once: one matrix product, so
a batch of Q queries reads the file once, not Q times) feeds a streaming logsumexp (running max, sums
in float64, as `normaliser.log_normaliser`) and a running top-k per query. No index search is needed.
The product runs in torch on the caller's thread count (the server's `--torch-threads`, 1 by default:
two batch threads use two cores without BLAS threads fighting for them).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from index.paging import release_pages, releasable

__all__ = ["SCAN_BLOCK", "ScanResult", "ExactScanner"]

#: Embedding rows per score block: (SCAN_BLOCK, Q) float32 + float64 scores, ~4 MB at Q = 32.
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
        with warnings.catch_warnings():   # a read-only memory map: torch never writes through this view
            warnings.simplefilter("ignore", UserWarning)
            self._rows = torch.from_numpy(rows)

    @property
    def count(self) -> int:
        return int(self._rows.shape[0])

    def __call__(self, queries: np.ndarray, temperatures: np.ndarray, k: int) -> ScanResult:
        """Exact log sum_j exp(q . e_j / tau_q) and the k rows of largest q . e_j, for each query.

        queries (Q, D) float32 (unit rows), temperatures (Q,) -> ScanResult (k clipped to N)."""
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))        # (Q, D)
        inv_tau = torch.from_numpy(1.0 / np.asarray(temperatures, dtype=np.float64))  # (Q,)
        n, n_q = self.count, q.shape[0]
        k = min(int(k), n)
        m = torch.full((n_q,), -np.inf, dtype=torch.float64)   # running max of logits
        acc = torch.zeros(n_q, dtype=torch.float64)            # running sum of exp(logit - m)
        best_s = torch.full((k, n_q), -np.inf, dtype=torch.float32)
        best_r = torch.full((k, n_q), -1, dtype=torch.int64)
        qt = q.T.contiguous()                                  # (D, Q)
        for start in range(0, n, self.block):
            stop = min(n, start + self.block)
            s = self._rows[start:stop] @ qt                    # (B, Q) float32, one product for the batch
            if self.release:
                release_pages(self.embeddings, start, stop)
            logits = s.double() * inv_tau                       # (B, Q)
            new_m = torch.maximum(m, logits.max(dim=0).values)
            acc = acc * torch.exp(m - new_m) + torch.exp(logits - new_m).sum(dim=0)
            m = new_m
            kb = min(k, stop - start)
            top_s, top_i = torch.topk(s, kb, dim=0)             # (kb, Q)
            cand_s = torch.cat([best_s, top_s])
            cand_r = torch.cat([best_r, top_i + start])
            # ties: prefer the lower row (a stable order independent of the block size)
            order = _best_first(cand_s, cand_r, k)
            best_s = torch.gather(cand_s, 0, order)
            best_r = torch.gather(cand_r, 0, order)
        log_z = (m + torch.log(acc)).numpy()
        return ScanResult(log_z, best_r.T.contiguous().numpy())


def _best_first(scores: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (k, Q) along dim 0 of the k best (score desc, row asc) of each column."""
    # sort by row first, then a stable sort by score: equal scores keep the row order
    by_row = torch.argsort(rows, dim=0, stable=True)
    s = torch.gather(scores, 0, by_row)
    by_score = torch.argsort(-s, dim=0, stable=True)[:k]
    return torch.gather(by_row, 0, by_score)
