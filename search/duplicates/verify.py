"""The verification stage: does x look like a copy of j pixel for pixel, once a small crop is undone?

The encoder decides which items are candidates; this stage re-scores the few candidates of each item
with a representation that keeps what the product's edits (edits.py) keep and look-alikes do not: the
WHOLE picture (the encoder sees a centre square, so a tall "i" and "l" or two wide music clefs share
it) at SIDE x SIDE in colour. A crop keeping >= 90 % of each side is undone by searching the window
(x0, y0, width fraction sx, height fraction sy) of one picture that, resampled to SIDE x SIDE, best
matches the other by normalised cross-correlation

    ncc(u, v) = <u - mean u, v - mean v> / (|u - mean u| |v - mean v|),

which ignores a global gain and offset (brightness / contrast edits); JPEG noise, resampling and EXIF
rotation (undone at decode) leave it near 1. The search is a grid over sx, sy in COARSE_SCALES and
integer offsets (one matrix product over all windows), then a Nelder-Mead refinement of the best
window in continuous coordinates. The score is the larger of the two directions, so it is symmetric.
A blank (constant) picture matches only another blank one of the same colour.

The calibrated model (calibration.py) reads the score as evidence e = -log(1 - ncc + EPS): copies sit at
distances 1 - ncc of ~1e-4..1e-2 and look-alikes mostly above, a range a softmax over ncc itself (one
temperature, linear in ncc) cannot be sharp on; EPS is the distance below which ncc differences are
resampling noise, and caps the evidence of an identical copy at -log(EPS).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from PIL import Image
from scipy.optimize import minimize

SIDE = 32
WORK = 128                      # side of the stretched working copy windows are resampled from
COARSE_SCALES = (1.0, 0.95, 0.9)   # fraction of each side a crop keeps (edits.py crops keep >= 0.9)
MIN_SCALE = 0.85
EPS = 1e-4
_FLAT = 1e-3                    # pixel std (0-255 scale) below which a picture counts as blank


@dataclass
class Thumb:
    """One picture prepared for verification."""

    work: Image.Image              # the whole picture stretched to WORK x WORK (RGB)
    base: np.ndarray               # (SIDE * SIDE * 3,) zero-mean unit vector of the whole picture, zeros if blank
    mean: float                    # mean pixel value (what blank pictures are compared on)
    renders: list                  # (sx, sy, uint8 render at SIDE/sx x SIDE/sy) for the coarse window grid

    @property
    def blank(self) -> bool:
        return not self.base.any()


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    rows = rows - rows.mean(axis=-1, keepdims=True)
    norm = np.linalg.norm(rows, axis=-1, keepdims=True)
    flat = norm[..., 0] < _FLAT * np.sqrt(rows.shape[-1])
    rows = rows / np.where(norm > 0, norm, 1.0)
    rows[flat] = 0.0
    return rows


def thumb(rgb: np.ndarray) -> Thumb:
    """(H, W, 3) uint8, decoded as indexing decodes it (training/images.py) -> its Thumb."""
    work = Image.fromarray(np.asarray(rgb, dtype=np.uint8)).convert("RGB").resize((WORK, WORK), Image.BOX)
    base = np.asarray(work.resize((SIDE, SIDE), Image.BILINEAR), dtype=np.float32)
    renders = [(sx, sy, np.asarray(work.resize((int(round(SIDE / sx)), int(round(SIDE / sy))), Image.BILINEAR)))
               for sy in COARSE_SCALES for sx in COARSE_SCALES]
    return Thumb(work, _unit(base.reshape(-1)), float(base.mean()), renders)


def _window(work: Image.Image, params) -> np.ndarray:
    """The unit vector of the window (x0, y0, sx, sy) (fractions of the side) resampled to SIDE x SIDE."""
    x0, y0, sx, sy = (float(v) for v in params)
    box = (x0 * WORK, y0 * WORK, (x0 + sx) * WORK, (y0 + sy) * WORK)
    return _unit(np.asarray(work.resize((SIDE, SIDE), Image.BILINEAR, box=box), dtype=np.float32).reshape(-1))


def _inside(params) -> bool:
    x0, y0, sx, sy = params
    return MIN_SCALE <= sx <= 1.0 and MIN_SCALE <= sy <= 1.0 and 0.0 <= x0 <= 1.0 - sx and 0.0 <= y0 <= 1.0 - sy


def _one_way(a: Thumb, b: Thumb) -> float:
    """Best ncc of a window of `a` with the whole of `b`: coarse grid, then refined."""
    best, best_params = -2.0, (0.0, 0.0, 1.0, 1.0)
    for sx, sy, render in a.renders:
        view = sliding_window_view(render, (SIDE, SIDE, 3))[:, :, 0]       # (ny, nx, SIDE, SIDE, 3)
        ny, nx = view.shape[:2]
        values = _unit(view.reshape(ny * nx, -1)) @ b.base
        i = int(np.argmax(values))
        if values[i] > best:
            best = float(values[i])
            h, w = render.shape[:2]
            best_params = ((i % nx) / w, (i // nx) / h, SIDE / w, SIDE / h)

    def loss(params):
        return 2.0 if not _inside(params) else -float(_window(a.work, params) @ b.base)

    result = minimize(loss, np.array(best_params), method="Nelder-Mead",
                      options={"initial_simplex": np.array(best_params) + np.vstack(
                          [np.zeros(4), np.diag([0.01, 0.01, 0.015, 0.015])]), "xatol": 1e-3, "fatol": 1e-5,
                               "maxfev": 80})
    return max(best, -float(result.fun))


def score(a: Thumb, b: Thumb) -> float:
    """Verification score in [-1, 1]: the best ncc of a window of one picture with the other picture."""
    if a.blank or b.blank:
        return 1.0 - abs(a.mean - b.mean) / 255.0 if a.blank and b.blank else 0.0
    return max(_one_way(a, b), _one_way(b, a))


def evidence(v):
    """-log(1 - v + EPS): the verification score on the scale the calibrated softmax uses."""
    return -np.log(np.maximum(1.0 - np.asarray(v, dtype=np.float64), 0.0) + EPS)


BEST_EVIDENCE = float(-np.log(EPS))     # an identical copy


def scores(query: Thumb, others: list[Thumb]) -> np.ndarray:
    """score(query, o) for each o."""
    return np.array([score(query, o) for o in others], dtype=np.float64)
