"""Procedural synthetic images with a known latent torus (the project's known-answer data).

Each image is a smooth function of m = 3 angles theta in [0, 2pi)^3:

* theta_1: direction of a linear brightness gradient of the grey background,
  ``b(u) = 0.5 + 0.3 * (u . (cos th1, sin th1))`` for pixel position u in [-1, 1]^2;
* theta_2: hue of a soft disc, on a smooth hue wheel ``rgb_k = 0.5 + 0.4 cos(th2 - 2 pi k / 3)``
  (k = 0, 1, 2: a circle of constant brightness and saturation around the grey axis whose hue
  angle is th2, the C-infinity version of the HSV hue wheel);
* theta_3: position of the disc on a circle of radius 0.45 around the centre,
  ``c = 0.45 (cos th3, sin th3)``.

The disc edge is a logistic ramp about one pixel wide, so the image is a smooth, exactly
2pi-periodic function of every angle, and each angle is identifiable from the pixels.
Angles are measured counter-clockwise with the y axis pointing up the image.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

M = 3  # number of latent angles
RESOLUTION = 32  # rendered side in pixels
RENDER_VERSION = 1  # bump when the renderer's pixels change (enters dataset fingerprints)
GRADIENT = 0.3  # background brightness slope
DISC_ORBIT = 0.45  # radius of the circle the disc centre moves on
DISC_RADIUS = 0.3
CHROMA = 0.4  # amplitude of the hue wheel
EDGE = 0.5  # logistic edge width, in pixels
DEFAULT_SIZES = {"train": 4096, "test": 512}
SPLIT_STREAMS = {"train": 0, "test": 1}  # independent seed streams per split

__all__ = [
    "M",
    "RESOLUTION",
    "DEFAULT_SIZES",
    "render",
    "oracle_embedding",
    "sample_latents",
    "wrap_angles",
]


def wrap_angles(latents: np.ndarray) -> np.ndarray:
    """Map angles to [0, 2pi)."""
    out = np.mod(np.asarray(latents, dtype=np.float64), 2 * np.pi)
    out[out >= 2 * np.pi] = 0.0  # np.mod can return 2pi for tiny negative inputs
    return out


def _check_latents(latents: np.ndarray) -> np.ndarray:
    lat = np.asarray(latents, dtype=np.float64)
    if lat.ndim != 2 or lat.shape[1] != M:
        raise ValueError(f"latents must have shape (B, {M}), got {lat.shape}")
    if not np.all(np.isfinite(lat)):
        raise ValueError("latents contain non-finite values")
    return lat


def sample_latents(n: int, seed: int, split: str = "train") -> np.ndarray:
    """(n, M) float64 angles, i.i.d. uniform on the torus; a distinct stream per (seed, split)."""
    if split not in SPLIT_STREAMS:
        raise ValueError(f"unknown synthetic split {split!r}; expected one of {sorted(SPLIT_STREAMS)}")
    if n < 0:
        raise ValueError(f"size must be >= 0, got {n}")
    rng = np.random.default_rng([int(seed), SPLIT_STREAMS[split], 0x5EA5C4])
    return rng.uniform(0.0, 2 * np.pi, size=(n, M))


def render(latents: np.ndarray, resolution: int = RESOLUTION, block: int = 2048) -> np.ndarray:
    """(B, 3) angles -> (B, R, R, 3) uint8 RGB images (vectorised, rendered in blocks)."""
    lat = _check_latents(latents)
    if resolution < 4:
        raise ValueError(f"resolution must be >= 4, got {resolution}")
    # pixel centres in [-1, 1]; row 0 is the top of the image so y points up
    coords = (np.arange(resolution, dtype=np.float32) + 0.5) / resolution * 2.0 - 1.0
    ux = coords[None, :]  # (1, R): x per column
    uy = -coords[:, None]  # (R, 1): y per row
    px = 2.0 / resolution  # pixel size in these units
    out = np.empty((lat.shape[0], resolution, resolution, 3), dtype=np.uint8)
    phases = np.float32(2 * np.pi / 3) * np.arange(3, dtype=np.float32)
    for start in range(0, lat.shape[0], block):
        t = lat[start : start + block].astype(np.float32)  # (b, 3)
        c1, s1 = np.cos(t[:, 0])[:, None, None], np.sin(t[:, 0])[:, None, None]
        bg = 0.5 + GRADIENT * (ux * c1 + uy * s1)  # (b, R, R)
        colour = 0.5 + CHROMA * np.cos(t[:, 1:2] - phases[None, :])  # (b, 3)
        cx = (DISC_ORBIT * np.cos(t[:, 2]))[:, None, None]
        cy = (DISC_ORBIT * np.sin(t[:, 2]))[:, None, None]
        dist = np.sqrt((ux - cx) ** 2 + (uy - cy) ** 2)  # (b, R, R)
        # soft coverage: alpha = sigmoid((r - d) / (EDGE * px))
        alpha = 0.5 * (1.0 + np.tanh((DISC_RADIUS - dist) / (2.0 * EDGE * px)))
        img = (1.0 - alpha)[..., None] * bg[..., None] + alpha[..., None] * colour[:, None, None, :]
        out[start : start + block] = np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)
    return out


def oracle_embedding(latents: np.ndarray) -> np.ndarray:
    """(N, M) angles -> (N, 2M) float64 unit rows m^{-1/2} (cos th1, sin th1, ..., cos thm, sin thm).

    Then s = z_x . z_y = (1/m) sum_i cos(th_i - th'_i), so s / tau with tau = 1/(m kappa) is
    the latent generator's log r up to a per-query constant: the ideal softmax search exactly.
    """
    lat = np.asarray(latents, dtype=np.float64)
    if lat.ndim != 2:
        raise ValueError(f"latents must be 2-D (N, m), got shape {lat.shape}")
    m = lat.shape[1]
    z = np.empty((lat.shape[0], 2 * m), dtype=np.float64)
    z[:, 0::2] = np.cos(lat)
    z[:, 1::2] = np.sin(lat)
    return z / np.sqrt(m)
