"""Reading memory-mapped files without keeping them resident: the one home of "drop the pages I read".

A page read through a memory map stays in the process's resident set (RSS) until the mapping goes
away, even though it is a clean copy of the file the kernel could drop at any time: one pass over a
7.7 GB embeddings file through np.memmap shows up as 7.7 GB of RSS. The streamed build
(index/stream.py), the recall checks and the server's exact and bounded normalisers
(search/serving/normaliser.py) read their files in blocks and, after each block, tell the
kernel this process no longer needs those pages (madvise MADV_DONTNEED). For a file mapping this
only unmaps the pages from the process: they stay in the page cache (dirty ones are still written
back), and the next access re-reads them from there.
"""

from __future__ import annotations

import logging
import mmap
import os

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "drop_pages",
    "drop_index_pages",
    "PagedRows",
    "iter_row_blocks",
    "read_rows",
    "read_span",
    "advise_random",
    "releasable",
    "release_pages",
]

BLOCK_ROWS = 1 << 16


def drop_pages(array) -> None:
    """Unmap the resident pages of the read-only memory map `array` from this process (`release_pages` of all
    its rows; no-op for RAM arrays)."""
    release_pages(array)


def drop_index_pages(index) -> None:
    """Unmap the resident pages of a FAISS IVF index's on-disk inverted lists (`faiss.OnDiskInvertedLists`,
    whose mapping FAISS owns) from this process; no-op for lists in RAM."""
    import faiss

    try:
        invlists = faiss.extract_index_ivf(index).invlists
    except (RuntimeError, TypeError, AttributeError):
        return
    od = faiss.downcast_InvertedLists(invlists)
    if not isinstance(od, faiss.OnDiskInvertedLists) or od.ptr is None or od.totsize == 0:
        return
    view = faiss.rev_swig_ptr(od.ptr, int(od.totsize))  # (totsize,) uint8 over FAISS's mapping, no copy
    _madvise(view.__array_interface__["data"][0], int(od.totsize), getattr(mmap, "MADV_DONTNEED", 4))


def _madvise(start: int, length: int, advice: int) -> bool:
    """madvise(2) on [start, start + length) (start page-aligned; the kernel rounds length up to
    whole pages); False where there is no madvise (not POSIX) or it fails."""
    global _LIBC
    try:
        import ctypes

        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        return _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):  # only a residency hint is lost
        return False


_LIBC = None


def advise_random(embeddings: np.ndarray) -> bool:
    """madvise(MADV_RANDOM) on the memory map behind `embeddings`: bounded reads scattered rows, so
    a fault on a page not yet in the page cache should not read ahead its neighbours. (It does not
    stop a fault from mapping the pages around it: on current kernels one read can map a whole
    large folio, up to 2 MiB, so a few thousand scattered rows map the whole file; `release_pages`
    after each query is what keeps them out of the process.) True if the advice was given."""
    if getattr(embeddings, "filename", None) is None or not embeddings.size:
        return False
    import mmap

    start = embeddings.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    return _madvise(
        start, embeddings.ctypes.data + embeddings.nbytes - start, getattr(mmap, "MADV_RANDOM", 1)
    )


def releasable(embeddings: np.ndarray) -> bool:
    """True for a read-only, file-backed, C-contiguous memory map (np.load(..., mmap_mode="r")):
    the only kind `release_pages` touches (an in-RAM array, or a writable or copy-on-write map, is
    left alone)."""
    return (
        isinstance(embeddings, np.memmap)
        and getattr(embeddings, "mode", None) == "r"
        and getattr(embeddings, "filename", None) is not None
        and embeddings.size > 0
        and embeddings.flags.c_contiguous
    )


def release_pages(embeddings: np.ndarray, start: int = 0, stop: int | None = None) -> bool:
    """Unmap from this process the pages of the memory map `embeddings` that hold rows [start, stop)
    (all rows by default): madvise(MADV_DONTNEED). True if released; False (a no-op) unless
    `releasable(embeddings)`.

    Why: pages of a file mapping that a process has read stay mapped in it, and count in its RSS,
    until it unmaps them, so a server that scans all N rows per query soon shows the whole file in
    its RSS. For a read-only shared file mapping MADV_DONTNEED only drops this process's page-table
    entries: the data stays in the OS page cache (shared, reclaimable) and a later read of those
    rows faults the same bytes back in, so it is safe while other threads read them too.
    The range is rounded out to whole pages, all inside the mapping (it covers the file's last page)."""
    if not releasable(embeddings):
        return False

    n = embeddings.shape[0]
    stop = n if stop is None else min(int(stop), n)
    if stop <= start:
        return False
    row, base = embeddings.strides[0], embeddings.ctypes.data
    return release_bytes(embeddings, base + int(start) * row, base + stop * row)


def release_bytes(embeddings: np.ndarray, lo: int, hi: int) -> bool:
    """MADV_DONTNEED on the addresses [lo, hi) of the releasable map `embeddings`, clipped to it."""
    import mmap

    base = embeddings.ctypes.data
    lo = max(lo, base) // mmap.PAGESIZE * mmap.PAGESIZE
    hi = min(hi, base + embeddings.nbytes)
    return hi > lo and _madvise(lo, hi - lo, getattr(mmap, "MADV_DONTNEED", 4))


def _file_rows(array) -> tuple[str, int, int] | None:
    """(file name, byte offset of row 0, bytes a row) when `array` is a whole read-only .npy memory map
    (what np.load(mmap_mode="r") returns), so its rows can be read with pread; else None."""
    if not releasable(array) or array.ndim != 2:
        return None
    mm = getattr(array, "_mmap", None)
    offset = getattr(array, "offset", None)
    if not isinstance(mm, mmap.mmap) or offset is None or mm.closed:
        return None
    start = np.frombuffer(mm, np.uint8, count=1).ctypes.data  # the mapping's first byte
    if array.ctypes.data != start + offset % mmap.ALLOCATIONGRANULARITY:
        return None  # a view into the map: its file position is not `offset`
    return str(array.filename), int(offset), int(array.strides[0])


def read_rows(array: np.ndarray, rows) -> np.ndarray:
    """A RAM copy of `array[rows]` (rows: 1-D integers, any order, repeats allowed). For a whole memory-mapped
    .npy the rows are read with pread, runs of consecutive rows in one call, never through the mapping:
    a fault on a mapped page can map a whole large folio (up to 2 MiB) around it, so a few thousand
    scattered rows read through the map would put most of the file in this process's RSS."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    where = _file_rows(array)
    if where is None or len(rows) == 0:
        return np.array(array[rows])
    name, offset, row_bytes = where
    n = array.shape[0]
    if rows.min() < -n or rows.max() >= n:
        raise IndexError(f"row out of range for {n} rows")
    rows = np.where(rows < 0, rows + n, rows)
    uniq, inverse = np.unique(rows, return_inverse=True)
    out = np.empty((len(uniq),) + array.shape[1:], dtype=array.dtype)
    flat = out.reshape(-1).view(np.uint8)
    breaks = np.flatnonzero(np.diff(uniq) != 1) + 1
    starts, ends = np.r_[0, breaks], np.r_[breaks, len(uniq)]
    fd = os.open(name, os.O_RDONLY)
    try:
        for s, e in zip(starts.tolist(), ends.tolist()):
            want = (e - s) * row_bytes
            got = os.preadv(
                fd, [memoryview(flat[s * row_bytes : e * row_bytes])], offset + int(uniq[s]) * row_bytes
            )
            if got != want:
                raise OSError(f"{name}: short read ({got} of {want} bytes)")
    finally:
        os.close(fd)
    return out[inverse]


def read_span(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    """A RAM copy of rows start..stop of `array` (one pread for a whole memory-mapped .npy)."""
    stop = min(int(stop), int(array.shape[0]))
    if _file_rows(array) is None:
        out = np.array(array[start:stop])
        drop_pages(array)
        return out
    return read_rows(array, np.arange(start, stop))


class PagedRows:
    """Row gathers from a (memory-mapped) (N, D) array that never keep its pages: `rows[idx]` returns a RAM
    copy of the rows `idx`, as `array[idx]` would, read with pread (`read_rows`; used for re-ranking while a
    build measures recall, so scattered candidate rows do not accumulate in RSS)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape = array.shape
        self.dtype = array.dtype

    def __len__(self) -> int:
        return int(self.shape[0])

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, (int, np.integer)):
            return read_rows(self.array, [idx])[0]
        if isinstance(idx, slice):
            return read_span(self.array, *idx.indices(self.shape[0])[:2])
        return read_rows(self.array, idx)


def iter_row_blocks(array: np.ndarray, block_rows: int = BLOCK_ROWS):
    """Yield (start, float32 C-contiguous copy of rows start..start+B) over `array`, each block read with one
    pread (`read_span`): one pass over a mapped file with RSS bounded by one block."""
    n = int(array.shape[0])
    for start in range(0, n, block_rows):
        yield start, np.ascontiguousarray(read_span(array, start, start + block_rows), dtype=np.float32)
