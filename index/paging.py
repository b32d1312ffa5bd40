"""Reading memory-mapped files without keeping them resident: the one home of "drop the pages I read".

A page read through a memory map stays in the process's resident set (RSS) until the mapping goes
away, even though it is a clean copy of the file the kernel could drop at any time: one pass over a
7.7 GB embeddings file through np.memmap shows up as 7.7 GB of RSS. The streamed build
(index/stream.py) and the recall checks read their files in blocks and, after each block, tell the
kernel this process no longer needs those pages (madvise MADV_DONTNEED). For a file mapping this
only unmaps the pages from the process: they stay in the page cache (dirty ones are still written
back), and the next access re-reads them from there.
"""
from __future__ import annotations

import ctypes
import logging
import mmap

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["drop_pages", "drop_index_pages", "PagedRows", "iter_row_blocks"]

BLOCK_ROWS = 1 << 16


def _mapping(array) -> mmap.mmap | None:
    """The mmap object behind a np.memmap (or a view of one), else None."""
    seen = 0
    while array is not None and seen < 8:
        mm = getattr(array, "_mmap", None)
        if isinstance(mm, mmap.mmap):
            return mm
        array = getattr(array, "base", None)
        seen += 1
    return None


def drop_pages(array) -> None:
    """Unmap the resident pages of the memory map behind `array` from this process (no-op for RAM arrays)."""
    mm = _mapping(array)
    if mm is not None and not mm.closed:
        mm.madvise(mmap.MADV_DONTNEED)


_libc = None


def drop_index_pages(index) -> None:
    """Unmap the resident pages of a FAISS IVF index's on-disk inverted lists (`faiss.OnDiskInvertedLists`,
    whose mapping FAISS owns) from this process; no-op for lists in RAM."""
    global _libc
    import faiss

    try:
        invlists = faiss.extract_index_ivf(index).invlists
    except (RuntimeError, TypeError, AttributeError):
        return
    od = faiss.downcast_InvertedLists(invlists)
    if not isinstance(od, faiss.OnDiskInvertedLists) or od.ptr is None or od.totsize == 0:
        return
    view = faiss.rev_swig_ptr(od.ptr, int(od.totsize))   # (totsize,) uint8 over FAISS's mapping, no copy
    address = view.__array_interface__["data"][0]
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(int(od.totsize)), mmap.MADV_DONTNEED) != 0:
        logger.debug("madvise on the on-disk lists failed (errno %d)", ctypes.get_errno())


class PagedRows:
    """Row gathers from a (memory-mapped) (N, D) array that drop the pages they touched afterwards:
    `rows[idx]` returns a RAM copy of the rows `idx`, as `array[idx]` would (used for re-ranking
    while a build measures recall, so scattered candidate rows do not accumulate in RSS)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape = array.shape
        self.dtype = array.dtype

    def __len__(self) -> int:
        return int(self.shape[0])

    def __getitem__(self, idx) -> np.ndarray:
        out = np.array(self.array[idx])
        drop_pages(self.array)
        return out


def iter_row_blocks(array: np.ndarray, block_rows: int = BLOCK_ROWS):
    """Yield (start, float32 C-contiguous copy of rows start..start+B) over `array`, dropping the pages
    of each block once it is copied: one pass over a mapped file with RSS bounded by one block."""
    n = int(array.shape[0])
    for start in range(0, n, block_rows):
        block = np.array(array[start:start + block_rows], dtype=np.float32, copy=True)   # a RAM copy, never a view
        drop_pages(array)
        yield start, block
