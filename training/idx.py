"""IDX file format (MNIST / Fashion-MNIST) reader and writer, plain or gzip.

Layout: 2 zero bytes, a dtype code byte, a byte with the number of dimensions d, then d
big-endian uint32 sizes, then the data in C order, big-endian.
"""

from __future__ import annotations

import gzip as _gzip
import logging
import os
import struct
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["read_idx", "write_idx", "IDX_DTYPES"]

# dtype code -> big-endian numpy dtype
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES = {dt.newbyteorder("=").str[1:]: code for code, dt in IDX_DTYPES.items()}  # "u1" -> 0x08, ...
_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(2)
        fh.seek(0)
        if head == _GZIP_MAGIC:
            try:
                return _gzip.decompress(fh.read())
            except (OSError, EOFError) as exc:
                raise ValueError(f"{path}: corrupt gzip stream ({exc})") from exc
        return fh.read()


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (gzip detected from its magic bytes) into a native-endian array."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    data = _read_bytes(path)
    if len(data) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(data)} bytes)")
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0:
        raise ValueError(f"{path}: bad IDX magic {data[:4].hex()} (first two bytes must be zero)")
    if code not in IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX dtype code 0x{code:02X}")
    if ndim == 0:
        raise ValueError(f"{path}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes, need {header})")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{path}: IDX body has {len(data) - header} bytes, header {shape} "
            f"of {dtype.name} needs {expected}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | os.PathLike, array: np.ndarray, gzip: bool = False) -> Path:
    """Write `array` (uint8, int8, int16, int32, float32 or float64) as an IDX file."""
    arr = np.asarray(array)
    key = arr.dtype.str[1:]  # drop the byte-order character: "<f4" -> "f4"
    if key not in _CODES:
        raise ValueError(
            f"IDX cannot store dtype {arr.dtype}; use one of uint8, int8, int16, int32, float32, float64"
        )
    if not 1 <= arr.ndim <= 255:
        raise ValueError(f"IDX needs 1..255 dimensions, got {arr.ndim}")
    if any(s >= 2**32 for s in arr.shape):
        raise ValueError(f"IDX dimension sizes must fit in uint32, got {arr.shape}")
    code = _CODES[key]
    payload = (
        struct.pack(">HBB", 0, code, arr.ndim)
        + struct.pack(f">{arr.ndim}I", *arr.shape)
        + np.ascontiguousarray(arr, dtype=IDX_DTYPES[code]).tobytes()
    )
    path = Path(path)
    if gzip:
        payload = _gzip.compress(payload, mtime=0)
    path.write_bytes(payload)
    return path
