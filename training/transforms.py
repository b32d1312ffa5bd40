"""The one image preprocessing path shared by training, index building and the API.

Images become ``(B, 3, S, S)`` float32 tensors: RGB (grayscale repeated to 3 channels; PIL
images of other modes converted by ``training.images.to_rgb_array``,
because the open_clip towers' first convolution takes 3 channels), the shorter side resized
to ``S`` and the longer side centre-cropped (a no-op for square images), scaled to [0, 1]
and normalised with mean 0.5 / std 0.5, i.e. ``x = (p - 0.5) / 0.5`` in [-1, 1].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from training.images import to_rgb_array

logger = logging.getLogger(__name__)

MEAN = 0.5
STD = 0.5

__all__ = ["MEAN", "STD", "preprocess", "resize_center_crop", "denormalize"]


def _as_uint8_batch(images: np.ndarray) -> np.ndarray:
    """Validate a numpy batch and bring it to (B, H, W, C) uint8 with C in {1, 3}."""
    if images.dtype != np.uint8:
        raise ValueError(f"numpy images must be uint8, got dtype {images.dtype}")
    if images.ndim == 3:  # (B, H, W) grayscale
        return images[..., None]
    if images.ndim == 4:
        c = images.shape[-1]
        if c in (1, 3):
            return images
        if c == 4:  # RGBA: drop alpha
            return images[..., :3]
        raise ValueError(f"numpy images must have 1, 3 or 4 channels last, got shape {images.shape}")
    raise ValueError(f"numpy images must be (B,H,W) or (B,H,W,C), got shape {images.shape}")


def resize_center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) float -> (B, C, size, size): shorter side to `size`, centre crop the longer.

    An exact k-fold reduction (both sides multiples of k, shorter side k * size) averages k x k
    blocks (PIL's ``reduce``; the exact inverse of k-fold pixel replication, which is how the
    image cache stores images of exactly ``size``); other sizes use antialiased bilinear.
    """
    h, w = x.shape[-2:]
    if h == size and w == size:
        return x
    k = min(h, w) // size
    if k >= 2 and min(h, w) == k * size and h % k == 0 and w % k == 0:
        x = F.avg_pool2d(x, k)
        nh, nw = h // k, w // k
    else:
        scale = size / min(h, w)
        nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
        # antialias only matters (and is only supported for bilinear) when shrinking
        x = F.interpolate(
            x, size=(nh, nw), mode="bilinear", align_corners=False, antialias=(nh < h or nw < w)
        )
    top, left = (nh - size) // 2, (nw - size) // 2
    return x[..., top : top + size, left : left + size]


def _normalise_uint8(batch: np.ndarray, image_size: int) -> torch.Tensor:
    """(B, H, W, C) uint8 -> (B, 3, S, S) float32 normalised."""
    batch = np.ascontiguousarray(batch)
    if not batch.flags.writeable:  # torch.from_numpy warns on read-only memory (e.g. np.asarray(PIL))
        batch = batch.copy()
    x = torch.from_numpy(batch).permute(0, 3, 1, 2).float().div_(255.0)  # (B, C, H, W)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = resize_center_crop(x, image_size)
    x = x.clamp(0.0, 1.0)  # bilinear antialias can overshoot slightly
    return ((x - MEAN) / STD).contiguous()


def preprocess(images: Image.Image | Sequence[Image.Image] | np.ndarray, image_size: int) -> torch.Tensor:
    """Images -> (B, 3, S, S) float32 encoder input.

    Accepts one PIL image, a list of PIL images (any modes and sizes), or a uint8 numpy batch
    (B, H, W) / (B, H, W, C). The numpy path is vectorised (one ``F.interpolate`` call).
    """
    if not isinstance(image_size, (int, np.integer)) or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    image_size = int(image_size)
    if isinstance(images, np.ndarray):
        batch = _as_uint8_batch(images)
        if batch.shape[0] == 0:
            return torch.empty(0, 3, image_size, image_size)
        return _normalise_uint8(batch, image_size)
    if isinstance(images, Image.Image):
        images = [images]
    if not isinstance(images, Sequence):
        raise ValueError(f"expected PIL image(s) or a uint8 numpy array, got {type(images).__name__}")
    if len(images) == 0:
        return torch.empty(0, 3, image_size, image_size)
    arrays = [to_rgb_array(im) for im in images]  # transparency onto white, 16-bit scaled
    if all(a.shape == arrays[0].shape for a in arrays):
        return _normalise_uint8(np.stack(arrays), image_size)
    return torch.cat([_normalise_uint8(a[None], image_size) for a in arrays])


def denormalize(x: torch.Tensor) -> np.ndarray:
    """Inverse of preprocess' scaling: (B, 3, S, S) -> (B, S, S, 3) uint8 (for figures)."""
    p = (x.detach().cpu().float() * STD + MEAN).clamp(0, 1)
    return (p.permute(0, 2, 3, 1).numpy() * 255.0).round().astype(np.uint8)
