"""Per-list statistics of an index version's embeddings, for the bounded softmax normaliser.

The rows are grouped into lists l (the IVF index's own inverted lists, else a k-means partition of
~sqrt N cells); per list: size n_l, mean mu_l, radius R_l = max_j |y_j - mu_l| and lam_l = largest
eigenvalue of the list covariance (1/n_l) sum_j (y_j - mu_l)(y_j - mu_l)^T (search/serving/normaliser.py
turns these into bounds on log Z). They depend only on the stored rows and the index, so they are
computed once when a version is written (`index.build.write_version`) and stored in it as
`normaliser_stats.npz`, checksummed by the manifest like every other file: a serving process loads
them instead of one pass over all N rows (221 s at N = 10^7, and a transient float64 copy).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["ListStats"]


@dataclass(frozen=True, eq=False)
class ListStats:
    """A partition of the rows into lists and each list's size, mean, radius and top eigenvalue."""

    offsets: np.ndarray  # (L + 1,) int64; list l holds order[offsets[l]:offsets[l + 1]]
    order: np.ndarray  # (N,) int32/int64 rows grouped by list
    where: np.ndarray  # (N,) uint16/int32 list of each row
    means: np.ndarray  # (L, D) float32 list means mu_l (the matmul operand)
    radius: np.ndarray  # (L,) float64 max_j |y_j - mu_l|, rounded up
    lam: np.ndarray  # (L,) float64 largest eigenvalue of the list covariance, rounded up
    source: str  # where the partition came from, for logs and bench output
    seconds: float = 0.0  # time taken to compute

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def lists(self) -> int:
        return int(self.means.shape[0])

    @property
    def nbytes(self) -> int:
        return int(
            sum(a.nbytes for a in (self.offsets, self.order, self.where, self.means, self.radius, self.lam))
        )

    @classmethod
    def build(
        cls,
        embeddings: np.ndarray,
        index=None,
        lists: int | None = None,
        seed: int = 1234,
        chunk_rows: int = 1 << 18,
        progress: bool = False,
    ) -> "ListStats":
        """Statistics of `embeddings` (N, D) over the inverted lists of `index` when it is a CPU IVF
        index holding rows 0..N-1, else over a k-means partition with `lists` (default ~sqrt N) cells."""
        t0 = time.perf_counter()
        n = int(embeddings.shape[0])
        # read through a private mapping of the same file where there is one, dropped afterwards, so
        # this one-off pass does not leave the whole file counted in the serving mapping's RSS
        view = _private_view(embeddings)
        grouped = _ivf_lists(index, n) if index is not None else None
        if grouped is not None:
            order, offsets = grouped
            source = f"IVF lists of the index ({len(offsets) - 1})"
        else:
            k = int(lists or max(1, round(math.sqrt(n))))
            order, offsets = _kmeans_lists(view, k, seed)
            source = f"k-means over the embeddings ({k} lists)"
        means, radius, lam = _list_moments(view, order, offsets, chunk_rows, progress)
        del view
        stats = cls(
            offsets, order, _row_lists(order, offsets), means, radius, lam, source, time.perf_counter() - t0
        )
        logger.info(
            "normaliser statistics: %s, %d rows, %.1f MB, %.1f s",
            source,
            n,
            stats.nbytes / 2**20,
            stats.seconds,
        )
        return stats

    def save(self, path) -> None:
        """Write the statistics to an .npz file (load them back with `ListStats.load`)."""
        np.savez(
            path,
            offsets=self.offsets,
            order=self.order,
            means=self.means,
            radius=self.radius,
            lam=self.lam,
            source=np.array(self.source),
            seconds=np.array(self.seconds),
        )

    @classmethod
    def load(cls, path) -> "ListStats":
        """Statistics written by `save` (OSError / ValueError / KeyError when unreadable)."""
        with np.load(path, allow_pickle=False) as f:
            offsets, order = f["offsets"].astype(np.int64, copy=False), f["order"]
            if (
                offsets.ndim != 1
                or len(offsets) < 2
                or offsets[0] != 0
                or np.any(np.diff(offsets) < 0)
                or offsets[-1] != len(order)
                or order.ndim != 1
            ):
                raise ValueError("offsets do not partition the rows")
            if len(order) and (order.min() < 0 or order.max() >= len(order)):
                raise ValueError("row numbers out of range")
            return cls(
                offsets,
                order,
                _row_lists(order, offsets),
                f["means"],
                f["radius"],
                f["lam"],
                str(f["source"]),
                float(f["seconds"]),
            )

    def problems(self, count: int, dim: int, index=None) -> list[str]:
        """How these statistics disagree with a version of `count` rows of `dim` and its `index`
        (row count, dimension, list count, and the IVF list sizes when the partition is the
        index's lists); empty when they describe it."""
        out = []
        lists = len(self.offsets) - 1
        if len(self.order) != count or len(self.where) != count:
            out.append(f"{len(self.order)} rows, the version has {count}")
        if self.means.ndim != 2 or self.means.shape != (lists, dim) or self.means.dtype != np.float32:
            out.append(f"means are {self.means.shape} {self.means.dtype}, expected ({lists}, {dim}) float32")
        if self.radius.shape != (lists,) or self.lam.shape != (lists,):
            out.append(
                f"radius / eigenvalue arrays of {self.radius.shape} / {self.lam.shape}, expected ({lists},)"
            )
        # (an index moved to a GPU has no readable inverted lists here; the checksum still holds)
        sizes = _ivf_sizes(index) if index is not None and self.source.startswith("IVF") else None
        if sizes is not None and (len(sizes) != lists or not np.array_equal(sizes, self.counts)):
            out.append(f"list sizes differ from the index's {len(sizes)} inverted lists")
        return out


def _row_lists(order: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(N,) list of each row, in the smallest integer type that holds the list count."""
    lists = len(offsets) - 1
    where = np.empty(len(order), dtype=np.uint16 if lists <= 2**16 else np.int32)
    where[order] = np.repeat(np.arange(lists, dtype=where.dtype), np.diff(offsets))
    return where


def _private_view(embeddings: np.ndarray) -> np.ndarray:
    """A fresh read-only memory map of the file behind `embeddings` (a np.memmap of a .npy), else itself."""
    filename = getattr(embeddings, "filename", None)
    if filename:
        try:
            view = np.load(filename, mmap_mode="r", allow_pickle=False)
            if view.shape == embeddings.shape and view.dtype == embeddings.dtype:
                return view
        except (OSError, ValueError):
            pass
    return embeddings


def _ivf_lists(index, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(order, offsets) from a CPU faiss IVF index whose ids are the rows 0..n-1; None otherwise."""
    import faiss

    try:
        ivf = faiss.extract_index_ivf(index)
    except (RuntimeError, TypeError, AttributeError):
        return None
    invlists = ivf.invlists
    sizes = _ivf_sizes(ivf)
    if int(sizes.sum()) != n:
        return None
    order = np.empty(n, dtype=np.int32 if n < 2**31 else np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for l in np.flatnonzero(sizes):
        ids = faiss.rev_swig_ptr(invlists.get_ids(int(l)), int(sizes[l]))
        order[offsets[l] : offsets[l + 1]] = ids
    seen = np.zeros(n, dtype=bool)
    seen[order] = True  # every row exactly once (sizes sum to n, so "all seen" suffices)
    if order.min() < 0 or order.max() >= n or not seen.all():
        return None
    return order, offsets


def _ivf_sizes(index) -> np.ndarray | None:
    """(nlist,) inverted-list sizes of a CPU faiss IVF index, None when it is not one."""
    import faiss

    try:
        ivf = faiss.extract_index_ivf(index)
    except (RuntimeError, TypeError, AttributeError):
        return None
    return np.array([ivf.invlists.list_size(l) for l in range(ivf.nlist)], dtype=np.int64)


def _kmeans_lists(embeddings: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets) of a faiss k-means partition (trained on <= 64 k rows, assigned in blocks)."""
    import faiss

    n, d = embeddings.shape
    k = max(1, min(k, n))
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(n, size=min(n, 64 * k), replace=False))
    # ~sqrt(N) lists give sqrt(N) points a list: below 1521 rows that is under FAISS's 39, which makes it
    # print "WARNING clustering N points to K centroids"; any partition serves the bound, so it is noise here
    km = faiss.Kmeans(d, k, niter=10, seed=seed, verbose=False, spherical=False, min_points_per_centroid=1)
    km.train(np.ascontiguousarray(embeddings[sample], dtype=np.float32))
    assign = np.empty(n, dtype=np.int64)
    for start in range(0, n, 1 << 16):
        block = np.ascontiguousarray(embeddings[start : start + (1 << 16)], dtype=np.float32)
        assign[start : start + len(block)] = km.index.search(block, 1)[1][:, 0]
    order = np.argsort(assign, kind="stable").astype(np.int32 if n < 2**31 else np.int64)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(assign, minlength=k))])
    return order, offsets


def _list_moments(
    embeddings: np.ndarray, order: np.ndarray, offsets: np.ndarray, chunk_rows: int, progress: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per list (float64): mean, radius max |y - mu|, largest covariance eigenvalue; rows are read in
    chunks of whole lists (each chunk gathered in ascending row order, for the memory map)."""
    lists = len(offsets) - 1
    d = embeddings.shape[1]
    means = np.zeros((lists, d))
    radius = np.zeros(lists)
    lam = np.zeros(lists)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=int(offsets[-1]), unit="row", desc="normaliser statistics")
    l0 = 0
    while l0 < lists:
        l1 = int(np.searchsorted(offsets, offsets[l0] + chunk_rows, side="right")) - 1
        l1 = min(max(l1, l0 + 1), lists)
        rows = order[offsets[l0] : offsets[l1]]
        perm = np.argsort(rows, kind="stable")
        block = np.empty((len(rows), d))
        block[perm] = embeddings[rows[perm]]  # (rows, D) float64, grouped by list
        base = offsets[l0]
        for l in range(l0, l1):
            y = block[offsets[l] - base : offsets[l + 1] - base]  # (n_l, D)
            if len(y) == 0:
                continue
            mu = y.mean(axis=0)
            c = y - mu
            means[l] = mu
            radius[l] = math.sqrt(float(np.max(np.einsum("ij,ij->i", c, c))))
            if len(y) > 1:
                lam[l] = float(np.linalg.eigvalsh(c.T @ c / len(y))[-1])
        if bar is not None:
            bar.update(len(rows))
        l0 = l1
    if bar is not None:
        bar.close()
    radius, lam = round_up(radius, lam)
    return means.astype(np.float32), radius, lam


def round_up(radius: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Radii and eigenvalues as stored: rounded up so they stay upper bounds.

    float64 rounding of these sums is ~1e-16 relative; eigvalsh is backward stable (error <= ~D * 1e-16 *
    |C|), so a 1e-9 relative + 1e-12 absolute margin keeps them upper bounds."""
    radius = radius * (1 + 1e-9) + 1e-12
    lam = np.maximum(lam, 0.0) * (1 + 1e-9) + 1e-12
    lam = np.minimum(lam, radius**2)  # variance along a unit direction <= max squared distance
    return radius, lam


def save_streamed(
    path,
    offsets: np.ndarray,
    order_blocks,
    count: int,
    means: np.ndarray,
    radius: np.ndarray,
    lam: np.ndarray,
    source: str,
    seconds: float,
) -> None:
    """Write the same .npz as `ListStats.save` (read back by `ListStats.load`) with the (N,) row order given
    as an iterable of blocks, written as they come: a streamed build never holds the order in RAM."""
    import zipfile

    dtype = np.dtype(np.int32 if count < 2**31 else np.int64)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, arr in (
            ("offsets", offsets),
            ("means", means),
            ("radius", radius),
            ("lam", lam),
            ("source", np.array(source)),
            ("seconds", np.array(seconds)),
        ):
            with zf.open(name + ".npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, np.asanyarray(arr), allow_pickle=False)
        with zf.open("order.npy", "w", force_zip64=True) as fh:
            np.lib.format.write_array_header_1_0(
                fh, {"descr": dtype.str, "fortran_order": False, "shape": (count,)}
            )
            written = 0
            for block in order_blocks:
                block = np.ascontiguousarray(block, dtype=dtype)
                fh.write(memoryview(block).cast("B"))
                written += len(block)
            assert written == count, f"wrote {written} row numbers for {count} rows"
