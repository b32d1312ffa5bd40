"""Image files for tests: real but awkward inputs a user's folder holds (imported by name;
tests/conftest.py puts this folder on sys.path).

Every file is generated in milliseconds. The 600-megapixel PNG is a *valid* PNG (1-bit grey
rows of zeros, zlib-streamed: ~75 MB of pixel bytes compress to ~80 kB) that the header check
must refuse; decoding it would allocate 600 MB.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

HUGE_SIDE = 24_500  # 24500^2 = 600.25 M pixels


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def png_bytes(
    width: int,
    height: int,
    *,
    bit_depth: int = 8,
    color_type: int = 2,
    rows=None,
    extra_chunks: tuple[bytes, ...] = (),
) -> bytes:
    """A PNG written by hand. `rows`: iterable of per-row pixel bytes (filter byte 0 is added);
    None -> zero rows. Lets tests make 16-bit RGB and huge files PIL cannot write."""
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    row_bytes = (width * channels * bit_depth + 7) // 8
    comp = zlib.compressobj(9)
    body = []
    zero = b"\0" * (row_bytes + 1)
    it = iter(rows) if rows is not None else None
    for _ in range(height):
        body.append(comp.compress(zero if it is None else b"\0" + bytes(next(it))))
    body.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + b"".join(extra_chunks)
        + _chunk(b"IDAT", b"".join(body))
        + _chunk(b"IEND", b"")
    )


def huge_png(path: Path, side: int = HUGE_SIDE) -> Path:
    """A valid side x side 1-bit grey PNG (600 MP by default) that is cheap to write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(side, side, bit_depth=1, color_type=0))
    return path


def save(path: Path, image: Image.Image, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **kw)
    return path


def truncated_png(path: Path, seed: int = 0) -> Path:
    """A 64x64 noise PNG cut in half: the header reads, the pixel data ends early."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
        buf, "PNG"
    )
    raw = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw[: len(raw) // 2])
    return path


def text_png(path: Path) -> Path:
    """A text file named .png."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("this is a shopping list, not a picture\n")
    return path


def rgba_palette_png(path: Path) -> tuple[Path, np.ndarray]:
    """A palette PNG with per-entry alpha (tRNS): left half opaque red, right half fully
    transparent, bottom row half-transparent blue. Returns (path, expected RGB on white)."""
    pal = Image.new("P", (8, 8))
    pal.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0, 0, 0] * 253)
    px = np.zeros((8, 8), np.uint8)
    px[:, 4:] = 1  # green, but fully transparent
    px[7, :] = 2  # blue at alpha 128
    pal.putdata(px.reshape(-1).tolist())
    save(path, pal, transparency=bytes([255, 0, 128] + [255] * 253))
    expected = np.zeros((8, 8, 3), np.uint8)
    expected[:, :4] = (255, 0, 0)
    expected[:, 4:] = (255, 255, 255)
    # alpha_composite: out = (c a + 255 (255 - a)) / 255, rounded
    blend = lambda c, a: int((c * a + 255 * (255 - a) + 127) // 255)  # noqa: E731
    expected[7, :] = (blend(0, 128), blend(0, 128), blend(255, 128))
    return path, expected


def cmyk_jpeg(path: Path) -> tuple[Path, np.ndarray]:
    """A CMYK JPEG: top half pure cyan ink, bottom half pure yellow. Expected RGB approx."""
    cmyk = np.zeros((16, 16, 4), np.uint8)
    cmyk[:8, :, 0] = 255  # cyan -> (0, 255, 255)
    cmyk[8:, :, 2] = 255  # yellow -> (255, 255, 0)
    save(path, Image.fromarray(cmyk, mode="CMYK"), quality=95)
    expected = np.zeros((16, 16, 3), np.uint8)
    expected[:8] = (0, 255, 255)
    expected[8:] = (255, 255, 0)
    return path, expected


def exif_rotated_jpeg(path: Path) -> tuple[Path, np.ndarray]:
    """A 32x16 (w x h) JPEG, left half white, tagged EXIF orientation 6 (display rotated 90
    degrees clockwise): as displayed it is 16 wide, 32 tall, white on top. Returns the expected
    displayed image (RGB)."""
    arr = np.zeros((16, 32, 3), np.uint8)
    arr[:, :16] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    save(path, Image.fromarray(arr), exif=exif.tobytes(), quality=95)
    return path, np.rot90(arr, k=-1)


def sixteen_bit_grey_png(path: Path) -> tuple[Path, np.ndarray]:
    """A 16-bit grey PNG with values 0, 257 k and 65535; expected uint8 grey round(v / 257)."""
    values = np.array([[0, 257, 257 * 128, 65535], [1000, 30000, 65000, 128]], dtype=np.uint16)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        png_bytes(4, 2, bit_depth=16, color_type=0, rows=[r.astype(">u2").tobytes() for r in values])
    )
    return path, ((values.astype(np.int64) + 128) // 257).astype(np.uint8)


def sixteen_bit_rgb_png(path: Path) -> tuple[Path, np.ndarray]:
    """A 16-bit RGB PNG (colour type 2, depth 16) written by hand; expected 8-bit RGB ~ v / 257."""
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 65536, size=(5, 6, 3), dtype=np.uint16)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        png_bytes(6, 5, bit_depth=16, color_type=2, rows=[r.astype(">u2").tobytes() for r in arr])
    )
    return path, (arr / 257.0).round().astype(np.uint8)


def animated_gif(path: Path) -> Path:
    """Two frames: red, then blue. The first frame is the image."""
    frames = [Image.new("RGB", (10, 10), c) for c in ((255, 0, 0), (0, 0, 255))]
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return path


def bad_files(folder: Path, tag: str = "") -> dict[str, str]:
    """Write the three files a folder must survive into `folder`; {file name: expected reason}."""
    huge_png(folder / f"huge{tag}.png")
    truncated_png(folder / f"truncated{tag}.png")
    text_png(folder / f"notes{tag}.png")
    return {
        f"huge{tag}.png": "image_too_large",
        f"truncated{tag}.png": "corrupt_image",
        f"notes{tag}.png": "not_an_image",
    }


TUXPAINT_STAMPS = Path("/usr/share/tuxpaint/stamps")


def tuxpaint_folder(
    dst: Path,
    categories: list[str] | None = None,
    per_class: int | None = None,
    test_every: int = 5,
    src: Path = TUXPAINT_STAMPS,
) -> Path:
    """A train/ + test/ image folder of symlinks to Debian's tuxpaint-stamps-default PNGs.

    Classes are the stamp categories (first-level folders: animals, food, ...); within each,
    the first `per_class` PNGs by path, every `test_every`-th of them into test/.
    """
    cats = categories or sorted(p.name for p in src.iterdir() if p.is_dir())
    for cat in cats:
        files = sorted((src / cat).rglob("*.png"))[:per_class]
        for k, f in enumerate(files):
            split = "test" if k % test_every == test_every - 1 else "train"
            link = dst / split / cat / f.relative_to(src / cat)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(f)
    return dst
