"""search/serving/normaliser.py releases the pages of a memory-mapped embeddings file it has read
(`release_pages`, madvise MADV_DONTNEED): the mapping's resident size in /proc/self/smaps stays
below a block after an exact or bounded log Z, and the values equal the in-RAM computation."""

from __future__ import annotations

import math
from pathlib import Path

import faiss
import numpy as np
import pytest

from search.serving.normaliser import (
    ListStats,
    NormaliserConfig,
    bounded_log_normaliser,
    log_normaliser,
    releasable,
    release_pages,
)

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/smaps").is_file(),
    reason="needs /proc/self/smaps (Linux) to read a mapping's resident pages",
)

D = 128
N = 16384  # 8 MiB of float32 rows
BLOCK = 1024  # 512 KiB per block of the exact scan
PAGE = 4096


def mapping_rss(array: np.ndarray) -> int:
    """Bytes of the vma holding `array`'s data that are mapped in this process (smaps Rss)."""
    addr = array.ctypes.data
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the array")


@pytest.fixture()
def mapped(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    np.save(tmp_path / "emb.npy", x)
    return x, np.load(tmp_path / "emb.npy", mmap_mode="r")


def test_exact_scan_leaves_at_most_one_block_mapped(mapped):
    x, mm = mapped
    assert releasable(mm) and not releasable(x) and not release_pages(x)  # in RAM: nothing to release
    q = x[:4] + 0.1
    taus = np.array([0.05, 0.1, 0.5, 1.0])
    touched = float(np.asarray(mm).sum())  # read every page
    assert math.isfinite(touched) and mapping_rss(mm) >= 0.9 * x.nbytes  # what the scan used to leave
    got = log_normaliser(q, mm, taus, block=BLOCK)
    assert mapping_rss(mm) <= BLOCK * D * 4 + 2 * PAGE
    np.testing.assert_array_equal(got, log_normaliser(q, x, taus, block=BLOCK))  # same blocks, same floats
    kept = log_normaliser(q, mm, taus, block=BLOCK, release=False)  # the switch the bench measures
    assert mapping_rss(mm) >= 0.9 * x.nbytes
    np.testing.assert_array_equal(kept, got)
    assert release_pages(mm, 100, 200) and mapping_rss(mm) <= x.nbytes - 100 * D * 4 + 2 * PAGE
    one = log_normaliser(q, mm[:BLOCK], taus)  # the one-block path
    np.testing.assert_array_equal(one, log_normaliser(q, x[:BLOCK], taus))


def test_bounded_reads_leave_no_rows_mapped(mapped):
    x, mm = mapped
    quant = faiss.IndexFlatIP(D)
    index = faiss.IndexIVFFlat(quant, D, 16, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    stats = ListStats.build(x, index)
    q = x[:6] + 0.05 * np.random.default_rng(1).standard_normal((6, D)).astype(np.float32)
    taus = np.full(6, 0.1)
    cfg = NormaliserConfig("bounded", head_rows=2000, samples=1024, max_samples=4096)
    release_pages(mm)
    got = bounded_log_normaliser(q, mm, stats, taus, cfg, release=True)
    assert mapping_rss(mm) <= 2 * PAGE
    ref = bounded_log_normaliser(q, x, stats, taus, cfg)
    for name in ("value", "lower", "upper", "interval_lower", "interval_upper", "rows"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name))
    bounded_log_normaliser(q, mm, stats, taus, cfg, release=False)
    assert mapping_rss(mm) > 100 * PAGE  # the rows it read, left mapped


def test_a_gather_never_maps_more_than_about_one_stretch(mapped, monkeypatch):
    """Scattered rows are read one stretch of the file at a time and each stretch released once read:
    just before every release the mapping holds at most ~one stretch (plus a large folio at either end)."""
    from search.serving import normaliser

    x, mm = mapped
    rows = np.sort(np.random.default_rng(2).choice(N, 3000, replace=False))
    seen = []
    real = normaliser.release_bytes

    def watched(emb, lo, hi):
        seen.append(mapping_rss(emb))
        return real(emb, lo, hi)

    release_pages(mm)
    monkeypatch.setattr(normaliser, "release_bytes", watched)
    span = 2 << 20  # 2 MiB stretches of an 8 MiB file
    got = normaliser._gather(mm, rows, release=True, span_bytes=span)
    np.testing.assert_array_equal(got, x[rows])
    assert (
        len(seen) in (4, 5) and max(seen) <= 2 * span + PAGE and mapping_rss(mm) <= 2 * PAGE
    )  # (folios may straddle)
    normaliser._gather(mm, rows)  # no release: the rows stay mapped
    assert mapping_rss(mm) >= x.nbytes // 2
