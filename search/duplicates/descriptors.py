"""Per-image descriptors: a small greyscale thumbnail (aligned and correlated pair by pair, align.py) and
the k-NN search key: its low-frequency DCT block without the DC term, unit-normalised (brightness and
contrast changes leave it unchanged, JPEG and resizing barely move it), beside the picture's colour layout
(an 8 x 8 grid of opponent chroma, also unit-normalised, zero on grey pictures). The colour half keeps a
cropped or rotated copy near its original where the grey layout alone has moved: on drawings many pictures
share one grey shape (round icons on white) and differ in colour."""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image
from scipy.fft import dctn

from training.images import load_rgb


def thumbnail(source, side: int, colour_side: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """((side, side) uint8 greyscale, (colour_side, colour_side, 3) uint8 RGB) of an image file or bytes,
    decoded as indexing decodes it (EXIF orientation, transparency on white), the whole picture squeezed to
    a square (no crop)."""
    return thumbnail_and_digest(source, side, colour_side)[:2]


def thumbnail_and_digest(source, side: int, colour_side: int = 16) -> tuple[np.ndarray, np.ndarray, bytes]:
    """`thumbnail`'s two arrays and a digest of the decoded pixels (shape and values): equal digests are
    identical pictures, whatever their names or containers."""
    return thumbnails_digest_rgb(source, side, colour_side, 0)[:3]


def thumbnails_digest_rgb(source, side: int, colour_side: int = 16, rgb_side: int = 0):
    """`thumbnail_and_digest`'s three and, when rgb_side > 0, the (rgb_side, rgb_side, 3) uint8 colour
    thumbnail the copy encoder reads (else None), from one decode."""
    pixels = load_rgb(source, min_side=2 * side)
    digest = hashlib.blake2b(str(pixels.shape).encode() + pixels.tobytes(), digest_size=16).digest()
    rgb = Image.fromarray(pixels)
    grey = rgb.convert("L").resize((side, side), Image.BILINEAR, reducing_gap=2.0)
    colour = rgb.resize((colour_side, colour_side), Image.BILINEAR, reducing_gap=2.0)
    big = (
        np.asarray(rgb.resize((rgb_side, rgb_side), Image.BILINEAR, reducing_gap=2.0), dtype=np.uint8)
        if rgb_side
        else None
    )
    return np.asarray(grey, dtype=np.uint8), np.asarray(colour, dtype=np.uint8), digest, big


def identical_groups(keys: list) -> np.ndarray:
    """(n,) row of each item's representative: the first row with an equal key (None: its own), the keys
    given as lists per item (two items are one picture when any of their keys agree, closed transitively)."""
    n = len(keys)
    parent = np.arange(n)

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first: dict = {}
    for i, ks in enumerate(keys):
        for k in ks or ():
            j = first.setdefault(k, i)
            if j != i:
                ri, rj = root(i), root(j)
                parent[max(ri, rj)] = min(ri, rj)
    return np.array([root(i) for i in range(n)], np.int64)


def chroma(rgb: np.ndarray) -> np.ndarray:
    """(..., 2) opponent chroma of RGB values: red-green and yellow-blue (zero on greys)."""
    x = np.asarray(rgb, np.float32)
    return np.stack([x[..., 0] - x[..., 1], (x[..., 0] + x[..., 1]) / 2 - x[..., 2]], axis=-1)


def search_descriptor(
    thumbs: np.ndarray, colours: np.ndarray, block: int, colour_weight: float, flip: bool = False
) -> np.ndarray:
    """(n, block^2 - 1 + 128) float32 unit vectors: `dct_descriptor` and `colour_weight` times the colour
    layout (the (n, 16, 16, 2) chroma thumbnails pooled to 8 x 8, mean removed, divided by their norm but
    never by less than a grey picture's: CHROMA_FLOOR per cell), renormalised; `flip`: of the mirror."""
    from search.duplicates.align import CHROMA_FLOOR

    c = np.asarray(colours, np.float32)
    n, side = len(c), c.shape[1]
    c = c.reshape(n, 8, side // 8, 8, side // 8, c.shape[3]).mean((2, 4))
    if flip:
        c = c[:, :, ::-1]
    c = c.reshape(n, -1)
    c = c - c.mean(1, keepdims=True)
    c = c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), CHROMA_FLOOR * np.sqrt(c.shape[1]))
    d = np.hstack([dct_descriptor(thumbs, block, flip), colour_weight * c])
    return (d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-6)).astype(np.float32)


def dct_descriptor(thumbs: np.ndarray, block: int, flip: bool = False) -> np.ndarray:
    """(n, block^2 - 1) float32 unit vectors: the block x block lowest DCT frequencies of each thumbnail,
    DC dropped (`flip`: of its mirror image, the odd horizontal frequencies negated)."""
    t = np.asarray(thumbs, dtype=np.float32)
    c = dctn(t, type=2, axes=(1, 2), norm="ortho")[:, :block, :block]
    if flip:
        c = c * np.where(np.arange(block) % 2, -1.0, 1.0)[None, None, :]
    c = c.reshape(len(t), -1)[:, 1:]
    norm = np.linalg.norm(c, axis=1, keepdims=True)
    return (c / np.maximum(norm, 1e-6)).astype(np.float32)
