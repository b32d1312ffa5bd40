"""Edited copies of an image, the kind a photo library fills up with: what duplicate calibration learns from.

Each copy applies one to three edits drawn from EDITS -- JPEG re-encode at quality 40-95, resize
0.5-2x, crop of up to 10 % of each side in total, EXIF rotation (pixels rotated, the orientation tag
saying how to show them upright), small brightness / contrast / colour changes -- and is saved as
JPEG or PNG (a PNG source may become a JPEG and back). Copies are bytes, decoded later through
training/images.py exactly as an indexed file is.
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageEnhance

EDITS = ("jpeg", "resize", "crop", "exif_rotate", "colour")
# EXIF orientation tag -> the rotation applied to the stored pixels (viewers rotate them back)
_ORIENTATION = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def edited_copy(image: Image.Image, rng: np.random.Generator) -> tuple[bytes, list[str]]:
    """(encoded bytes, names of the edits applied) of one random edited copy of `image`."""
    im = image.convert("RGB")
    names = list(rng.choice(EDITS, size=int(rng.integers(1, 4)), replace=False))
    if "crop" in names:   # keep >= 90 % of each side, offset at random
        w, h = im.size
        cw, ch = int(round(w * rng.uniform(0.9, 1.0))), int(round(h * rng.uniform(0.9, 1.0)))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        im = im.crop((x0, y0, x0 + cw, y0 + ch))
    if "resize" in names:
        scale = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
        im = im.resize((max(8, round(im.width * scale)), max(8, round(im.height * scale))), Image.BICUBIC)
    if "colour" in names:
        for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
            im = enhance(im).enhance(float(rng.uniform(0.9, 1.1)))
    exif = None
    if "exif_rotate" in names:
        orientation = int(rng.choice(list(_ORIENTATION)))
        im = im.transpose(_ORIENTATION[orientation])
        exif = Image.Exif()
        exif[0x0112] = orientation
    as_jpeg = "jpeg" in names or bool(rng.random() < 0.5)
    buf = io.BytesIO()
    if as_jpeg:
        quality = int(rng.integers(40, 96)) if "jpeg" in names else 90
        im.save(buf, format="JPEG", quality=quality, **({"exif": exif} if exif is not None else {}))
    else:
        im.save(buf, format="PNG", **({"exif": exif} if exif is not None else {}))
    return buf.getvalue(), [str(n) for n in names] + ["as_jpeg" if as_jpeg else "as_png"]
