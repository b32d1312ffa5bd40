"""Vectorised random augmentations on preprocessed batches (B, 3, S, S), for instance positives.

One ``affine_grid`` + ``grid_sample`` call applies a per-sample random resized crop, horizontal
flip and small translation; brightness and contrast jitter act on the [0, 1] pixel scale.
Random parameters come from a numpy Generator, so a seeded rng gives the same views.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from training.transforms import MEAN, STD, resize_center_crop

logger = logging.getLogger(__name__)

__all__ = ["AugmentConfig", "sample_params", "apply_params", "random_augment"]


@dataclass(frozen=True)
class AugmentConfig:
    """Ranges of the random augmentation (SimCLR-style, mild enough for 28-32 px images)."""
    crop_scale: tuple[float, float] = (0.5, 1.0)       # crop area as a fraction of the image
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)   # crop aspect ratio w/h (log-uniform)
    flip_p: float = 0.5                                 # probability of a horizontal flip
    translate: float = 0.1                              # extra shift, fraction of the side
    brightness: float = 0.2                             # multiply [0,1] pixels by U(1-b, 1+b)
    contrast: float = 0.2                               # scale about the image mean by U(1-c, 1+c)

    def __post_init__(self) -> None:
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < lo <= hi <= 1, got {self.crop_scale}")
        rlo, rhi = self.crop_ratio
        if not 0 < rlo <= rhi:
            raise ValueError(f"crop_ratio must satisfy 0 < lo <= hi, got {self.crop_ratio}")
        if not 0 <= self.flip_p <= 1:
            raise ValueError(f"flip_p must be in [0, 1], got {self.flip_p}")
        for name in ("translate", "brightness", "contrast"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"{name} must be in [0, 1), got {v}")


def sample_params(n: int, rng: np.random.Generator, config: AugmentConfig = AugmentConfig()) -> dict[str, np.ndarray]:
    """Draw per-sample augmentation parameters (all float64 arrays of shape (n,))."""
    area = rng.uniform(config.crop_scale[0], config.crop_scale[1], size=n)
    log_ratio = rng.uniform(math.log(config.crop_ratio[0]), math.log(config.crop_ratio[1]), size=n)
    ratio = np.exp(log_ratio)
    # crop side lengths as fractions of the image: w*h = area, w/h = ratio
    w = np.minimum(np.sqrt(area * ratio), 1.0)
    h = np.minimum(np.sqrt(area / ratio), 1.0)
    # crop centre in grid coordinates [-1, 1], staying inside the image, plus a small shift
    cx = rng.uniform(-1.0, 1.0, size=n) * (1.0 - w) + rng.uniform(-2, 2, size=n) * config.translate
    cy = rng.uniform(-1.0, 1.0, size=n) * (1.0 - h) + rng.uniform(-2, 2, size=n) * config.translate
    flip = rng.random(n) < config.flip_p
    bright = rng.uniform(1 - config.brightness, 1 + config.brightness, size=n)
    contrast = rng.uniform(1 - config.contrast, 1 + config.contrast, size=n)
    return {"w": w, "h": h, "cx": cx, "cy": cy, "flip": flip.astype(np.float64),
            "brightness": bright, "contrast": contrast}


def apply_params(x: torch.Tensor, params: dict[str, np.ndarray], out_size: int | None = None) -> torch.Tensor:
    """Apply augmentation parameters to a preprocessed batch x (B, 3, R, R) -> (B, 3, S, S).

    S = out_size (default R). With R > S the crop is resampled on an R x R grid and then shrunk
    to S as ``preprocess`` shrinks (2 x 2 block means at R = 2 S), before the photometric jitter: a crop of side
    fraction w then has R w / S source pixels per output pixel, >= 1.2 for the default crops
    (w >= 0.61) at R = 2 S, so crops are not upsampled. With R = S: the plain one-pass transform.
    """
    if x.ndim != 4:
        raise ValueError(f"expected a (B, C, H, W) batch, got shape {tuple(x.shape)}")
    b = x.shape[0]
    dev, dt = x.device, x.dtype
    p = {k: torch.as_tensor(np.asarray(v), dtype=dt, device=dev) for k, v in params.items()}
    for k, v in p.items():
        assert v.shape == (b,), f"param {k} has shape {tuple(v.shape)}, expected ({b},)"
    # output grid u_out in [-1,1] maps to input u_in = diag(sx, sy) u_out + (cx, cy),
    # sx = w * (-1 if flip else 1): a crop of relative size (w, h) centred at (cx, cy).
    sx = p["w"] * (1.0 - 2.0 * p["flip"])
    theta = torch.zeros(b, 2, 3, dtype=dt, device=dev)
    theta[:, 0, 0] = sx
    theta[:, 0, 2] = p["cx"]
    theta[:, 1, 1] = p["h"]
    theta[:, 1, 2] = p["cy"]
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)                # (B, R, R, 2)
    y = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    if out_size is not None and int(out_size) != y.shape[-1]:
        y = resize_center_crop(y, int(out_size))   # 2x: 2x2 block means, as the plain views get
    # photometric jitter on [0, 1] pixels: q = mean + c (b p - mean), then back to normalised
    pix = y * STD + MEAN
    pix = pix * p["brightness"].view(b, 1, 1, 1)
    mean = pix.mean(dim=(1, 2, 3), keepdim=True)
    pix = mean + p["contrast"].view(b, 1, 1, 1) * (pix - mean)
    return ((pix.clamp(0.0, 1.0) - MEAN) / STD).contiguous()


def random_augment(x: torch.Tensor, rng: np.random.Generator, config: AugmentConfig = AugmentConfig(),
                   out_size: int | None = None) -> torch.Tensor:
    """One random augmentation per sample of a preprocessed batch (B, 3, R, R) -> (B, 3, S, S)."""
    return apply_params(x, sample_params(x.shape[0], rng, config), out_size)
