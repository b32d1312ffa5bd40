"""Vectorised random augmentations on preprocessed batches (B, 3, S, S), for instance positives.

One ``affine_grid`` + ``grid_sample`` call applies a per-sample random resized crop, horizontal
flip, rotation and small translation; brightness, contrast and saturation jitter, greyscale and a
3x3 blur act on the [0, 1] pixel scale. Random parameters come from a numpy Generator, so a seeded
rng gives the same views; the options that are off (0) draw no random numbers.
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

__all__ = ["AugmentConfig", "sample_params", "apply_params", "random_augment", "overlay_mask"]


@dataclass(frozen=True)
class AugmentConfig:
    """Ranges of the random augmentation (SimCLR-style, mild enough for 28-32 px images)."""

    crop_scale: tuple[float, float] = (0.5, 1.0)  # crop area as a fraction of the image
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # crop aspect ratio w/h (log-uniform)
    flip_p: float = 0.5  # probability of a horizontal flip
    translate: float = 0.1  # extra shift, fraction of the side
    brightness: float = 0.2  # multiply [0,1] pixels by U(1-b, 1+b)
    contrast: float = 0.2  # scale about the image mean by U(1-c, 1+c)
    saturation: float = 0.0  # scale colour about each pixel's grey by U(1-s, 1+s)
    grey_p: float = 0.0  # probability of turning the view grey
    blur_p: float = 0.0  # probability of a 3x3 binomial blur
    rotate: float = 0.0  # rotation, uniform in +-degrees
    # probability of an overlay drawn over the view: a caption bar (30-70 % of the width, 6-12 % of the
    # height, at the top or bottom) or a round badge (radius 8-15 % of the side, in a corner), one random
    # colour -- the "text or logo" edit of a copy (the `copy` recipe's positives)
    overlay_p: float = 0.0

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
        for name in ("saturation", "grey_p", "blur_p", "overlay_p"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if not 0 <= self.rotate <= 180:
            raise ValueError(f"rotate must be in [0, 180] degrees, got {self.rotate}")


def sample_params(
    n: int, rng: np.random.Generator, config: AugmentConfig = AugmentConfig()
) -> dict[str, np.ndarray]:
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
    out = {
        "w": w,
        "h": h,
        "cx": cx,
        "cy": cy,
        "flip": flip.astype(np.float64),
        "brightness": bright,
        "contrast": contrast,
    }
    # the later options draw only when on, so views of configs without them stay as they were
    if config.saturation > 0:
        out["saturation"] = rng.uniform(1 - config.saturation, 1 + config.saturation, size=n)
    if config.grey_p > 0:
        out["grey"] = (rng.random(n) < config.grey_p).astype(np.float64)
    if config.blur_p > 0:
        out["blur"] = (rng.random(n) < config.blur_p).astype(np.float64)
    if config.rotate > 0:
        out["angle"] = np.radians(rng.uniform(-config.rotate, config.rotate, size=n))
    if config.overlay_p > 0:
        out["overlay"] = (rng.random(n) < config.overlay_p).astype(np.float64)
        out["overlay_bar"] = (rng.random(n) < 0.5).astype(np.float64)  # else a badge
        bar_w = rng.uniform(0.3, 0.7, size=n)
        out["overlay_w"], out["overlay_h"] = bar_w, rng.uniform(0.06, 0.12, size=n)
        out["overlay_x"] = rng.uniform(0.0, 1.0, size=n) * (1.0 - bar_w)
        out["overlay_top"] = (rng.random(n) < 0.3).astype(np.float64)
        out["overlay_r"] = rng.uniform(0.08, 0.15, size=n)
        out["overlay_right"] = (rng.random(n) < 0.5).astype(np.float64)
        out["overlay_low"] = (rng.random(n) < 0.5).astype(np.float64)
        for c in range(3):
            out[f"overlay_c{c}"] = rng.random(n)
    return out


def overlay_mask(params: dict[str, torch.Tensor], side: int) -> torch.Tensor:
    """(B, side, side) 0/1 mask of each view's overlay (zero where `overlay` is 0), from `sample_params`'
    overlay_* parameters in fractions of the side: a bar [x, x + w] x [y, y + h] with y at the top or the
    bottom edge, or a disc of radius r whose centre is r in from a corner."""
    dt, dev = params["overlay"].dtype, params["overlay"].device
    u = (torch.arange(side, dtype=dt, device=dev) + 0.5) / side  # pixel centres in [0, 1]
    col, row = u.view(1, 1, side), u.view(1, side, 1)
    p = {k: v.view(-1, 1, 1) for k, v in params.items() if k.startswith("overlay")}
    y0 = torch.where(p["overlay_top"] > 0, torch.zeros_like(p["overlay_h"]), 1.0 - p["overlay_h"])
    bar = (col >= p["overlay_x"]) & (col <= p["overlay_x"] + p["overlay_w"])
    bar = bar & (row >= y0) & (row <= y0 + p["overlay_h"])
    r = p["overlay_r"]
    cx = torch.where(p["overlay_right"] > 0, 1.0 - r, r)
    cy = torch.where(p["overlay_low"] > 0, 1.0 - r, r)
    disc = (col - cx) ** 2 + (row - cy) ** 2 <= r**2
    shape = torch.where(p["overlay_bar"] > 0, bar, disc)
    return (shape & (p["overlay"] > 0)).to(dt)


def apply_params(x: torch.Tensor, params: dict[str, np.ndarray], out_size: int | None = None) -> torch.Tensor:
    """Apply augmentation parameters to a preprocessed batch x (B, 3, R, R) -> (B, 3, S, S).

    S = out_size (default R). With R > S the crop is resampled on an R x R grid and then shrunk
    to S as ``preprocess`` shrinks (2 x 2 block means at R = 2 S), before the photometric jitter: a crop of
    side fraction w then has R w / S source pixels per output pixel, >= 1.2 for the default crops
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
    # A rotation by a turns the output grid first: u_in = diag(sx, sy) R(a) u_out + (cx, cy).
    sx = p["w"] * (1.0 - 2.0 * p["flip"])
    theta = torch.zeros(b, 2, 3, dtype=dt, device=dev)
    if "angle" in p:
        cos, sin = torch.cos(p["angle"]), torch.sin(p["angle"])
        theta[:, 0, 0], theta[:, 0, 1] = sx * cos, -sx * sin
        theta[:, 1, 0], theta[:, 1, 1] = p["h"] * sin, p["h"] * cos
    else:
        theta[:, 0, 0] = sx
        theta[:, 1, 1] = p["h"]
    theta[:, 0, 2] = p["cx"]
    theta[:, 1, 2] = p["cy"]
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)  # (B, R, R, 2)
    y = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    if out_size is not None and int(out_size) != y.shape[-1]:
        y = resize_center_crop(y, int(out_size))  # 2x: 2x2 block means, as the plain views get
    # photometric jitter on [0, 1] pixels: q = mean + c (b p - mean), then back to normalised
    pix = y * STD + MEAN
    pix = pix * p["brightness"].view(b, 1, 1, 1)
    mean = pix.mean(dim=(1, 2, 3), keepdim=True)
    pix = mean + p["contrast"].view(b, 1, 1, 1) * (pix - mean)
    if "saturation" in p or "grey" in p:
        grey = pix.mean(dim=1, keepdim=True)
        s = p["saturation"] if "saturation" in p else torch.ones_like(p["grey"])
        if "grey" in p:
            s = s * (1.0 - p["grey"])  # a grey view: saturation 0
        pix = grey + s.view(b, 1, 1, 1) * (pix - grey)
    if "blur" in p:
        k1 = torch.tensor([0.25, 0.5, 0.25], dtype=dt, device=dev)
        kernel = (k1[:, None] * k1[None, :]).expand(pix.shape[1], 1, 3, 3)
        blurred = F.conv2d(F.pad(pix, (1, 1, 1, 1), mode="replicate"), kernel, groups=pix.shape[1])
        w = p["blur"].view(b, 1, 1, 1)
        pix = w * blurred + (1.0 - w) * pix
    if "overlay" in p:
        m = overlay_mask(p, pix.shape[-1]).unsqueeze(1)  # (B, 1, S, S)
        colour = torch.stack([p[f"overlay_c{c}"] for c in range(3)], dim=1).view(b, 3, 1, 1)
        pix = m * colour[:, : pix.shape[1]] + (1.0 - m) * pix
    return ((pix.clamp(0.0, 1.0) - MEAN) / STD).contiguous()


def random_augment(
    x: torch.Tensor,
    rng: np.random.Generator,
    config: AugmentConfig = AugmentConfig(),
    out_size: int | None = None,
) -> torch.Tensor:
    """One random augmentation per sample of a preprocessed batch (B, 3, R, R) -> (B, 3, S, S)."""
    return apply_params(x, sample_params(x.shape[0], rng, config), out_size)
