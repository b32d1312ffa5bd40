"""Nearest neighbours of every dataset item in grey-level pixel space (no labels, no encoder).

The `neighbour` positive generator (training/generators.py) draws a positive for an anchor from
its k nearest pixel-space neighbours, NNCLR-style but with a fixed support set: pairs that raw
pixels already relate become positives, augmentation adds the invariances pixels lack.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from training.transforms import MEAN, STD

if TYPE_CHECKING:  # pragma: no cover
    from training.datasets import ImageDataset

logger = logging.getLogger(__name__)

__all__ = ["grey_pixels", "pixel_neighbours"]


def grey_pixels(dataset: "ImageDataset", batch_size: int = 4096) -> torch.Tensor:
    """(N, S*S) float32 unit rows: each item's [0, 1] grey levels (channel mean), L2-normalised."""
    rows = []
    for start in range(0, len(dataset), batch_size):
        x = dataset.tensors(np.arange(start, min(start + batch_size, len(dataset))))  # (B, 3, S, S)
        grey = (x * STD + MEAN).mean(dim=1).flatten(1)  # undo preprocess, then (B, S*S)
        rows.append(F.normalize(grey.float(), dim=1))
    return torch.cat(rows) if rows else torch.zeros((0, 0))


def pixel_neighbours(dataset: "ImageDataset", k: int, block: int = 2048, progress: bool = True) -> np.ndarray:
    """(N, k) int64: row i lists the k items most cosine-similar to item i in grey pixels, best
    first, never i itself. Exact (blocked matmul + top-k), O(N^2 S^2) work and O(block N) memory."""
    n = len(dataset)
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, {n - 1}] for a dataset of {n} items, got {k}")
    t0 = time.perf_counter()
    x = grey_pixels(dataset)  # (N, P)
    out = np.empty((n, k), dtype=np.int64)
    starts = range(0, n, block)
    for start in tqdm(starts, desc="pixel neighbours", unit="block", disable=not progress, leave=False):
        stop = min(start + block, n)
        sim = x[start:stop] @ x.T  # (b, N) cosine similarities
        sim[torch.arange(stop - start), torch.arange(start, stop)] = -float("inf")  # not its own neighbour
        out[start:stop] = sim.topk(k, dim=1).indices.numpy()
    logger.info("pixel neighbours: %d items, k=%d in %.1f s", n, k, time.perf_counter() - t0)
    return out
