"""The one place softsearch reads image files and uploads: limits first, then a careful decode.

Every path that turns bytes into pixels (folder datasets and their cache, the API upload,
thumbnails) calls this module, so one policy holds everywhere:

1. **Limits before pixels.** The file size (``max_bytes``) is checked from ``stat``/``len``
   and ``width x height`` (``max_pixels``, default 20 M = the API's default) from the header
   that ``PIL.Image.open`` parses, before any pixel data is decoded. An image over a limit,
   an empty file, a file that is no image and a truncated or corrupt one each raise
   :class:`ImageError` whose ``code`` names the reason; callers skip and report, never crash.
2. **Decode small.** JPEGs are decoded at a reduced DCT scale (``draft``) when only a small
   square is wanted; every other format is shrunk with an integer box ``reduce`` before the
   final bilinear resize (``reducing_gap``), so a 20 MP file costs one decode, not a 20 MP
   float tensor.
3. **The pixels a person sees.** EXIF orientation is applied; transparency (RGBA, LA,
   palette or colour-key transparency, premultiplied modes) is composited onto white, as
   clip art and icons are drawn; 16-bit channels are scaled by 1/257 (not clipped); CMYK,
   YCbCr, LAB and HSV are converted to RGB; animated files give their first frame.

PIL's own decompression-bomb *warning* (89 MP and up) is silenced because the header check
above already refuses anything over the (lower) configured limit; PIL's hard error stays as a
backstop and is reported as ``image_too_large``.
"""

from __future__ import annotations

import io
import logging
import os
import re
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "DEFAULT_MAX_BYTES",
    "DECODE_VERSION",
    "ImageLimits",
    "DEFAULT_LIMITS",
    "ImageError",
    "ImageSource",
    "open_checked",
    "to_rgb_array",
    "load_rgb",
    "fit_square",
    "load_square",
    "load_query",
    "cache_resolution",
]

DEFAULT_MAX_PIXELS = 20_000_000  # width * height; the API's max_image_pixels default
DEFAULT_MAX_BYTES = 64 << 20  # 64 MiB per file: a 20 MP RGBA PNG compresses to well under this
DECODE_VERSION = 1  # bump when the pixels this module produces change (cache keys use it)

# Refused from the header by the pixel limit; PIL's warning would only repeat that, once per file.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

ImageSource = Union[str, os.PathLike, bytes, bytearray, memoryview]

_WHITE = (255, 255, 255, 255)
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
_PIL_DECODE_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    IndexError,
    TypeError,
    KeyError,
    struct.error,
    zlib.error,
)


@dataclass(frozen=True)
class ImageLimits:
    """Largest image accepted: bytes on disk / in the upload, and width * height from the header."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = ImageLimits()


class ImageError(ValueError):
    """An image that is skipped (files) or refused (uploads). ``code`` is one of
    ``empty_file``, ``file_too_large``, ``image_too_large``, ``not_an_image``, ``corrupt_image``,
    ``unreadable`` (the file itself could not be read)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def to_dict(self) -> dict:
        return {"reason": self.code, "error": self.message}


def _describe(source: ImageSource) -> str:
    return "upload" if isinstance(source, (bytes, bytearray, memoryview)) else str(source)


def _byte_size(source: ImageSource) -> int:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return len(source)
    try:
        return os.stat(source).st_size
    except OSError as err:
        raise ImageError("unreadable", f"{source}: cannot read file ({err.strerror or err})") from err


def open_checked(source: ImageSource, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Open `source` (path or bytes) lazily after the file-size and header pixel checks.

    Only the header is parsed; the returned image holds its file open until ``close()`` (use
    it as a context manager). Raises ImageError for anything over a limit or not an image.
    """
    name = _describe(source)
    nbytes = _byte_size(source)
    if nbytes == 0:
        raise ImageError("empty_file", f"{name}: the file is empty")
    if nbytes > limits.max_bytes:
        raise ImageError("file_too_large", f"{name}: {nbytes} bytes, limit is {limits.max_bytes} bytes")
    fp = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else source
    try:
        image = Image.open(fp)
    except Image.DecompressionBombError as err:  # over PIL's hard limit (2 x 89 MP) already at open
        found = re.search(r"\((\d+) pixels\)", str(err))
        pixels = f"{found.group(1)} pixels" if found else "too many pixels"
        raise ImageError(
            "image_too_large", f"{name}: {pixels}, limit is {limits.max_pixels} (decompression-bomb guard)"
        ) from err
    except UnidentifiedImageError as err:
        raise ImageError("not_an_image", f"{name}: not a readable image file") from err
    except OSError as err:
        if not isinstance(source, (bytes, bytearray, memoryview)) and not os.access(source, os.R_OK):
            raise ImageError("unreadable", f"{name}: cannot read file ({err})") from err
        raise ImageError("corrupt_image", f"{name}: broken image header ({err})") from err
    except _PIL_DECODE_ERRORS as err:
        raise ImageError(
            "corrupt_image", f"{name}: broken image header ({type(err).__name__}: {err})"
        ) from err
    width, height = image.size
    if width < 1 or height < 1:
        image.close()
        raise ImageError("corrupt_image", f"{name}: image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        image.close()
        raise ImageError(
            "image_too_large",
            f"{name}: {width}x{height} = {width * height} pixels, "
            f"limit is {limits.max_pixels} (decompression-bomb guard)",
        )
    return image


def _sixteen_bit_to_uint8(arr: np.ndarray) -> np.ndarray:
    """0..65535 -> 0..255 by round(v / 257) (so 65535 -> 255 and 257 k -> k exactly)."""
    return ((np.clip(arr, 0, 65535).astype(np.uint32) + 128) // 257).astype(np.uint8)


def to_rgb_array(image: Image.Image) -> np.ndarray:
    """Decoded PIL image of any mode -> (H, W, 3) uint8: transparency onto white, 16-bit scaled.

    ``I;16*`` and ``I`` (16-bit grey) map v -> round(v / 257); ``F`` is taken as [0, 1] when its
    maximum is <= 1, else as [0, 255]; palette / colour-key / alpha transparency is composited
    onto a white background; everything else goes through PIL's ``convert("RGB")``.
    """
    if not isinstance(image, Image.Image):
        raise ValueError(f"expected a PIL image, got {type(image).__name__}")
    mode = image.mode
    if mode in _SIXTEEN_BIT or mode == "I":
        grey = _sixteen_bit_to_uint8(np.asarray(image, dtype=np.int64))
        return np.repeat(grey[:, :, None], 3, axis=2)
    if mode == "F":
        arr = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        scale = 255.0 if arr.size and arr.max() <= 1.0 else 1.0
        grey = np.clip(arr * scale, 0, 255).round().astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        # out = a * colour + (1 - a) * white, per pixel (PIL's alpha_composite, exact integer math)
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    elif mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.uint8)


def load_rgb(
    source: ImageSource, limits: ImageLimits = DEFAULT_LIMITS, *, min_side: int | None = None
) -> np.ndarray:
    """Read and decode one image -> (H, W, 3) uint8 RGB, EXIF-oriented, transparency on white.

    With ``min_side``, a JPEG is decoded at the coarsest DCT scale (1/2, 1/4, 1/8) that keeps
    both sides >= min_side (``Image.draft``). Raises ImageError (never a PIL exception).
    """
    name = _describe(source)
    with open_checked(source, limits) as image:
        try:
            if min_side is not None and image.format == "JPEG":
                image.draft(None, (int(min_side), int(min_side)))
            image.load()  # the first frame of an animated file
            ImageOps.exif_transpose(image, in_place=True)
            return to_rgb_array(image)
        except Image.DecompressionBombError as err:
            raise ImageError("image_too_large", f"{name}: {err}") from err
        except MemoryError as err:
            raise ImageError("image_too_large", f"{name}: out of memory while decoding") from err
        except _PIL_DECODE_ERRORS as err:
            raise ImageError(
                "corrupt_image", f"{name}: image data is truncated or corrupt ({type(err).__name__}: {err})"
            ) from err


def fit_square(rgb: np.ndarray | Image.Image, side: int) -> np.ndarray:
    """(H, W, 3) uint8 -> (side, side, 3) uint8: centre square crop, then resize to `side`.

    The same geometry as ``preprocess`` (shorter side to `side`, longer side centre-cropped).
    Shrinks reduce by an integer box filter first (``reducing_gap=2``), then resample bilinearly;
    an exact integer factor is k-fold pixel replication (enlarging) or k x k block means (shrinking).
    """
    if isinstance(side, bool) or not isinstance(side, (int, np.integer)) or side < 1:
        raise ValueError(f"side must be a positive integer, got {side!r}")
    image = (
        rgb if isinstance(rgb, Image.Image) else Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8))
    )
    if image.mode != "RGB":
        image = Image.fromarray(to_rgb_array(image))
    w, h = image.size
    s = min(w, h)
    if side % s == 0 or s % side == 0:
        # exact integer factor: integer centre crop, then k-fold pixel replication (which the k x k
        # block means of preprocess undo exactly: an image of the tower's size stays exact) or
        # k x k block means (PIL's reduce; what preprocess does for an exact k-fold reduction)
        left, top = (w - s) // 2, (h - s) // 2
        out = image.crop((left, top, left + s, top + s))
        if s < side:
            out = out.resize((int(side), int(side)), Image.Resampling.NEAREST)
        elif s > side:
            out = out.reduce(s // side)
        return np.asarray(out, dtype=np.uint8)
    box = ((w - s) / 2, (h - s) / 2, (w + s) / 2, (h + s) / 2)
    out = image.resize((int(side), int(side)), Image.Resampling.BILINEAR, box=box, reducing_gap=2.0)
    return np.asarray(out, dtype=np.uint8)


def load_square(source: ImageSource, side: int, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Read, decode and fit one image to a (side, side, 3) uint8 square (see ``fit_square``).

    The pipeline of the folder image cache and of API uploads alike, so a file that is
    indexed and the same file uploaded as a query give the same pixels.
    """
    return fit_square(load_rgb(source, limits, min_side=side), side)


def load_query(source: ImageSource, side: int, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode a query image: shrunk to the (side, side) square exactly as ``load_square`` (and so
    the folder image cache) does when its shorter side is larger than `side`; a smaller image is
    returned as decoded (``preprocess`` resizes it, as it does the in-memory datasets' arrays).
    Either way the query gets the pixels its indexed twin got."""
    rgb = load_rgb(source, limits, min_side=side)
    return fit_square(rgb, side) if min(rgb.shape[:2]) > side else rgb


def cache_resolution(image_size: int) -> int:
    """Side of the stored square for encoders of input `image_size`: 2 x image_size.

    The augmentations crop down to 0.61 of the side (area 0.5, aspect 3/4); at 2x the crops are
    sampled from the stored square without upsampling and then antialiased down to image_size
    (training/augment.py), and plain views are a clean 2x antialiased reduction.
    """
    return 2 * int(image_size)
