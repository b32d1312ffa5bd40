"""Nearest neighbours of every dataset item, in grey-level pixel space or in an encoder's embeddings.

The `neighbour` positive generator (training/generators.py) draws a positive for an anchor from
its k nearest neighbours: in pixels a fixed support set (pairs that raw pixels already relate
become positives, augmentation adds the invariances pixels lack); in the encoder's own space,
recomputed as it trains, NNCLR-style.
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

__all__ = ["grey_pixels", "pixel_neighbours", "encoder_neighbours", "top_k_cosine"]


def grey_pixels(dataset: "ImageDataset", batch_size: int = 4096) -> torch.Tensor:
    """(N, S*S) float32 unit rows: each item's [0, 1] grey levels (channel mean), L2-normalised."""
    rows = []
    for start in range(0, len(dataset), batch_size):
        x = dataset.tensors(np.arange(start, min(start + batch_size, len(dataset))))  # (B, 3, S, S)
        grey = (x * STD + MEAN).mean(dim=1).flatten(1)  # undo preprocess, then (B, S*S)
        rows.append(F.normalize(grey.float(), dim=1))
    return torch.cat(rows) if rows else torch.zeros((0, 0))


def top_k_cosine(
    x: torch.Tensor, k: int, block: int = 2048, progress: bool = False, desc: str = "neighbours"
) -> np.ndarray:
    """(N, k) int64: row i lists the k rows of unit-norm `x` (N, D) with the largest inner product
    with row i, best first, never i itself. Exact (blocked matmul + top-k), O(block N) memory."""
    n = x.shape[0]
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, {n - 1}] for a dataset of {n} items, got {k}")
    out = np.empty((n, k), dtype=np.int64)
    starts = range(0, n, block)
    for start in tqdm(starts, desc=desc, unit="block", disable=not progress, leave=False):
        stop = min(start + block, n)
        sim = x[start:stop] @ x.T  # (b, N) cosine similarities
        sim[torch.arange(stop - start), torch.arange(start, stop)] = -float("inf")  # not its own neighbour
        out[start:stop] = sim.topk(k, dim=1).indices.numpy()
    return out


def pixel_neighbours(dataset: "ImageDataset", k: int, block: int = 2048, progress: bool = True) -> np.ndarray:
    """(N, k) int64: row i lists the k items most cosine-similar to item i in grey pixels, best
    first, never i itself. Exact (blocked matmul + top-k), O(N^2 S^2) work and O(block N) memory."""
    n = len(dataset)
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, {n - 1}] for a dataset of {n} items, got {k}")
    t0 = time.perf_counter()
    out = top_k_cosine(grey_pixels(dataset), k, block, progress, "pixel neighbours")
    logger.info("pixel neighbours: %d items, k=%d in %.1f s", n, k, time.perf_counter() - t0)
    return out


def encoder_neighbours(
    encoder: torch.nn.Module,
    dataset: "ImageDataset",
    k: int,
    batch_size: int = 512,
    with_pixels: bool = False,
    served: bool = False,
) -> np.ndarray:
    """(N, k) int64: each item's k nearest items by cosine of the encoder's embeddings (eval mode, as
    an index embeds them), best first, never itself; the encoder's train/eval mode is restored.
    ``with_pixels``: ranked by the mean of that cosine and the grey-pixel one instead. ``served``: the
    encoder's served embedding (with its pixel anchor, if any) instead of the tower alone."""
    n = len(dataset)
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, {n - 1}] for a dataset of {n} items, got {k}")
    t0 = time.perf_counter()
    was_training = encoder.training
    device = next(encoder.parameters()).device
    # the tower alone (what training's loss sees by default), or what an index embeds
    tower = encoder if served else getattr(encoder, "tower_embed", encoder)
    encoder.eval()
    try:
        with torch.no_grad():
            z = torch.cat(
                [
                    tower(dataset.tensors(np.arange(s, min(s + batch_size, n))).to(device)).float().cpu()
                    for s in range(0, n, batch_size)
                ]
            )
    finally:
        encoder.train(was_training)
    x = F.normalize(z, dim=1)
    if with_pixels:  # [a, b] / sqrt(2) of unit rows: inner products are the mean of the two cosines
        x = torch.cat([x, grey_pixels(dataset)], dim=1) / np.sqrt(2.0)
    out = top_k_cosine(x, k)
    logger.info("encoder neighbours: %d items, k=%d in %.1f s", n, k, time.perf_counter() - t0)
    return out
