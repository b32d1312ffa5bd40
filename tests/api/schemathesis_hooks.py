"""Schemathesis hooks for the softsearch API: what an image part is.

The OpenAPI schema says an upload part (`file`, `files`) is a non-empty image file (a part's media types
in its multipart `encoding.contentType`), but no JSON Schema can say "a decodable image", so without this
schemathesis fills those parts with arbitrary bytes (a PDF, a zip, noise) that the service rightly
answers 400. Here every image media type gets a generator of real, valid PNG files (random size and
pixels, grey / RGB / RGBA), written with the standard library alone so the hooks load wherever
schemathesis runs. Loaded by `schemathesis.toml` (run the CLI from the repository root) and by
tests/api/test_schema_fuzz.py.
"""

from __future__ import annotations

import struct
import zlib

import schemathesis
from hypothesis import strategies as st
from schemathesis.transport.serialization import Binary

#: PNG colour types and their channels: grey, RGB, RGBA
_CHANNELS = {0: 1, 2: 3, 6: 4}


def png(width: int, height: int, colour: int, pixels: bytes) -> bytes:
    """A valid 8-bit PNG of `width` x `height` (`colour`: 0 grey, 2 RGB, 6 RGBA), rows cut from `pixels`."""
    row = width * _CHANNELS[colour]
    data = (
        (pixels * (1 + (row * height) // max(len(pixels), 1)))[: row * height]
        if pixels
        else bytes(row * height)
    )
    raw = b"".join(b"\x00" + data[y * row : (y + 1) * row] for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


#: real PNG files: 1..96 px a side, any pixels
IMAGES = st.builds(
    png,
    st.integers(1, 96),
    st.integers(1, 96),
    st.sampled_from(sorted(_CHANNELS)),
    st.binary(min_size=0, max_size=512),
)

# a part declared with an image media type (`encoding.contentType`), and every `format: binary` string
# (the items of /v1/search/batch's `files` list): real PNG files
schemathesis.openapi.media_type("image/png", IMAGES)
schemathesis.openapi.format("binary", IMAGES.map(Binary))
