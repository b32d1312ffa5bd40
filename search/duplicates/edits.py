"""Edited copies of an image, the edits people make to photos and drawings: the positives the duplicate
classifier learns from on each collection, and the copies planted in tests and benchmarks.

One to three of EDITS per copy -- JPEG re-encode (quality 40-95), resize (0.5-2x), crop (up to 20 % of the
area, any offset), rotation (up to 5 degrees, cropped to the picture inside), brightness / contrast / colour
(0.8-1.2 each), a text or logo overlay -- then saved as JPEG or PNG (a format change). A horizontal flip is
added only when asked (a mirror is a duplicate only if the user says so).
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFont

EDITS = ("jpeg", "resize", "crop", "rotate", "colour", "overlay")
MAX_CROP = 0.2  # share of the area a crop may remove
MAX_DEGREES = 5.0
# how far from the picture's edge an overlay of add_overlay reaches (share of the side): a caption bar <= 12 %
# of the height within 5 % of the top or bottom (at least 3 pixels high: up to 19 % on a 24 px picture), a
# badge of radius <= 15 % of the short side 2 pixels from a corner (test_overlay_reach checks both)
CAPTION_REACH = 0.19
BADGE_REACH = 0.33


def _crop(im: Image.Image, rng: np.random.Generator) -> Image.Image:
    area = rng.uniform(1.0 - MAX_CROP, 1.0)
    aspect = np.exp(rng.uniform(-0.1, 0.1))
    fw = min(1.0, math.sqrt(area) * aspect)
    fh = min(1.0, area / fw)
    w, h = im.size
    cw, ch = max(4, round(w * fw)), max(4, round(h * fh))
    x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return im.crop((x0, y0, x0 + cw, y0 + ch))


def _rotate(im: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Rotate by up to MAX_DEGREES and keep the largest centred rectangle of the same aspect inside it."""
    deg = float(rng.uniform(-MAX_DEGREES, MAX_DEGREES))
    w, h = im.size
    a = math.radians(abs(deg))
    # the largest w' x h' (same aspect) inside the rotated w x h: w' = w / (cos a + (w/h) sin a) for w >= h
    scale = 1.0 / (math.cos(a) + max(w / h, h / w) * math.sin(a))
    out = im.rotate(deg, resample=Image.BICUBIC, expand=False)
    cw, ch = max(4, int(w * scale)), max(4, int(h * scale))
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return out.crop((x0, y0, x0 + cw, y0 + ch))


def add_overlay(im: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A caption or a logo-like badge over up to ~8 % of the picture, somewhere near an edge."""
    im = im.copy()
    d = ImageDraw.Draw(im)
    w, h = im.size
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    if rng.random() < 0.5:  # a text caption along the bottom or top
        bw, bh = int(w * rng.uniform(0.3, 0.7)), max(3, int(h * rng.uniform(0.06, 0.12)))
        x0 = int(rng.integers(0, w - bw + 1))
        y0 = (
            int(h - bh - rng.integers(0, max(1, h // 20)))
            if rng.random() < 0.7
            else int(rng.integers(0, max(1, h // 20)))
        )
        d.rectangle((x0, y0, x0 + bw, y0 + bh), fill=tuple(255 - c for c in colour))
        step = max(1, bh // 2)
        for x in range(x0 + 2, x0 + bw - step, step + 1):
            if rng.random() < 0.8:
                d.rectangle((x, y0 + bh // 4, x + step // 2 + 1, y0 + 3 * bh // 4), fill=colour)
        # the caption's text at the bar's height (the default font's fixed 10 px would cover a third of a
        # 32 px picture), clipped to the bar
        font = ImageFont.load_default(size=max(1, bh))
        if font.getlength("copy") <= bw - 2:
            d.text((x0 + 2, y0), "copy", fill=colour, font=font)
    else:  # a round badge in a corner
        r = max(2, int(min(w, h) * rng.uniform(0.08, 0.15)))
        cx = r + 2 if rng.random() < 0.5 else w - r - 2
        cy = r + 2 if rng.random() < 0.5 else h - r - 2
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour, outline=tuple(255 - c for c in colour))
        d.line((cx - r // 2, cy, cx + r // 2, cy), fill=tuple(255 - c for c in colour), width=max(1, r // 4))
    return im


def edited_copy(
    image: Image.Image, rng: np.random.Generator, *, flip: bool = False, edits: tuple[str, ...] | None = None
) -> tuple[bytes, list[str]]:
    """(encoded bytes, names of the edits applied) of one random edited copy of `image`; `edits` fixes
    which edits are applied (default: one to three at random), `flip` adds a horizontal mirror."""
    im = image.convert("RGB")
    names = (
        list(edits)
        if edits is not None
        else [str(n) for n in rng.choice(EDITS, size=int(rng.integers(1, 4)), replace=False)]
    )
    unknown = set(names) - set(EDITS)
    if unknown:
        raise ValueError(f"unknown edits {sorted(unknown)}; known: {EDITS}")
    if "rotate" in names:
        im = _rotate(im, rng)
    if "crop" in names:
        im = _crop(im, rng)
    if "resize" in names:
        scale = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
        im = im.resize((max(8, round(im.width * scale)), max(8, round(im.height * scale))), Image.BICUBIC)
    if "colour" in names:
        for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
            im = enhance(im).enhance(float(rng.uniform(0.8, 1.2)))
    if "overlay" in names:
        im = add_overlay(im, rng)
    if flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        names.append("flip")
    as_jpeg = "jpeg" in names or bool(rng.random() < 0.5)
    buf = io.BytesIO()
    if as_jpeg:
        im.save(buf, format="JPEG", quality=int(rng.integers(40, 96)) if "jpeg" in names else 90)
    else:
        im.save(buf, format="PNG")
    return buf.getvalue(), names + ["as_jpeg" if as_jpeg else "as_png"]
