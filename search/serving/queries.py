"""Query vectors checked and normalised in one place (the routes, the micro-batcher and the searcher)."""

from __future__ import annotations

import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)


def unit_queries(vectors, dim: int, where: str = "vector") -> np.ndarray:
    """(Q, dim) unit float32 rows from `vectors` ((dim,) or (Q, dim)), else ValueError naming the problem:
    wrong length, NaN or inf, a value beyond float32, zero norm. Normalised in float64 first so tiny
    values do not underflow to a zero vector."""
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] != dim:
        got = x.shape[-1] if x.ndim >= 1 else 0
        raise ValueError(
            f"{where} has {got} values; the index dimension is {dim}"
            if x.ndim == 2
            else f"{where} must have shape (Q, {dim}), got {tuple(np.shape(vectors))}"
        )
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{where} contains NaN or inf")
    if x.size and np.abs(x).max() > _F32_MAX:
        raise ValueError(f"{where} values overflow float32")
    scale = np.abs(x).max(axis=1) if x.size else np.zeros(len(x))
    if np.any(scale == 0):
        raise ValueError(f"{where} has zero norm")
    x = x / scale[:, None]  # x / max|x| first: the squares of 1e-300s would underflow to a zero norm
    return np.ascontiguousarray(x / np.linalg.norm(x, axis=1)[:, None], dtype=np.float32)
