"""Reference helpers for the index tests (random unit vectors, brute-force top-k)."""

from __future__ import annotations

import numpy as np


def unit_vectors(n: int, d: int, seed: int) -> np.ndarray:
    """n random unit rows in R^d (float32)."""
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force(db: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference top-k by full (Q, N) score matrix in float64 (obviously correct, tiny data only)."""
    s = queries.astype(np.float64) @ db.astype(np.float64).T
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, order, axis=1), order


def copy_checkpoint(checkpoint, directory):
    """A private copy of a checkpoint in `directory` (a training run directory a test may move or delete)."""
    import shutil
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copyfile(checkpoint, directory / "checkpoint.safetensors"))
