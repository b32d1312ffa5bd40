"""IDX reader/writer: byte layout, round trips (plain and gzip), malformed files."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from training.idx import IDX_DTYPES, read_idx, write_idx

FASHION = Path("/usr/share/datasets/fashion-mnist")


def test_header_layout_by_hand(tmp_path):
    arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
    path = write_idx(tmp_path / "a.idx", arr)
    raw = path.read_bytes()
    # 0x0000, dtype 0x08, ndim 2, dims 2 and 3 big-endian, then the bytes
    assert raw == bytes([0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3, 0, 1, 2, 3, 4, 5])
    path = write_idx(tmp_path / "b.idx", np.array([1, -2], dtype=np.int32))
    assert path.read_bytes() == bytes([0, 0, 0x0C, 1, 0, 0, 0, 2]) + struct.pack(">ii", 1, -2)


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_images_and_labels(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7).astype(np.uint8)
    pi = write_idx(tmp_path / "img", images, gzip=compress)
    pl = write_idx(tmp_path / "lab", labels, gzip=compress)
    assert (pi.read_bytes()[:2] == b"\x1f\x8b") == compress
    for path, ref in ((pi, images), (pl, labels)):
        out = read_idx(path)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        np.testing.assert_array_equal(out, ref)
        assert out.flags.writeable


@pytest.mark.parametrize("dtype", ["u1", "i1", "i2", "i4", "f4", "f8"])
def test_round_trip_every_dtype(tmp_path, dtype):
    arr = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    out = read_idx(write_idx(tmp_path / "x.idx", arr))
    assert out.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(out, arr)
    # big-endian input arrays write the same file
    be = arr.astype(np.dtype(dtype).newbyteorder(">"))
    assert write_idx(tmp_path / "y.idx", be).read_bytes() == (tmp_path / "x.idx").read_bytes()
    assert set(IDX_DTYPES) == {0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E}


def _write(tmp_path, data, name="bad.idx"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\x00\x00\x08", "too short"),
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x05", "magic"),
        (b"\x00\x00\x0a\x01\x00\x00\x00\x01\x05", "dtype code 0x0A"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x01", "truncated IDX header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x03\x05\x06", "body has 2 bytes"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x01\x05\x06", "body has 2 bytes"),
    ],
)
def test_malformed_files(tmp_path, data, match):
    p = _write(tmp_path, data)
    with pytest.raises(ValueError, match=match) as err:
        read_idx(p)
    assert str(p) in str(err.value)
    # the same bytes gzip-compressed fail the same way
    pg = _write(tmp_path, gzip.compress(data), "bad.idx.gz")
    with pytest.raises(ValueError, match=match):
        read_idx(pg)


def test_corrupt_gzip_and_missing(tmp_path):
    good = gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x04abcd")
    p = _write(tmp_path, good[:-6], "cut.gz")
    with pytest.raises(ValueError, match="gzip"):
        read_idx(p)
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        read_idx(tmp_path / "nope.idx")


def test_write_rejects_unsupported(tmp_path):
    with pytest.raises(ValueError, match="int64"):
        write_idx(tmp_path / "x", np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="dimensions"):
        write_idx(tmp_path / "x", np.array(5, dtype=np.uint8))


@pytest.mark.skipif(not FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist_labels_header():
    path = FASHION / "t10k-labels-idx1-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    assert raw[:8] == bytes([0, 0, 8, 1, 0, 0, 0x27, 0x10])  # uint8, 1-D, 10000 items
    labels = read_idx(path)
    assert labels.shape == (10000,)
    np.testing.assert_array_equal(labels, np.frombuffer(raw[8:], dtype=np.uint8))
