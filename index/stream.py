"""A build whose RAM does not grow with N: IVF kinds from vectors on disk, inverted lists on disk.

`index build --embeddings` with an IVF kind (ivf-flat, ivf-pq; also when --kind auto picks one) writes
its version here (`write_streamed_version`), never holding the N x D rows:

1. train the coarse quantizer (and the PQ codebooks) on a seeded sample of at most TRAIN_BYTES of rows;
   nlist defaults to ~4 sqrt(N) capped at sample / 39 (FAISS's points per centroid), so the sample and
   k-means stay the same size at any N (give --param nlist=... to train a finer quantizer on 39 nlist rows);
2. pass 1 over the source in chunks: normalise (z = v / |v|), append to the version's embeddings.npy,
   assign each row to its nearest centroid (what IndexIVF.add does), keep that list number in a
   scratch file, count rows per list and sum them (the list means mu_l of the normaliser);
3. lay the lists out as FAISS's OnDiskInvertedLists does after merge_ondisk (list l: n_l codes then n_l
   int64 ids, exactly sized, lists in order) in `index.ivfdata`; pass 2 encodes each chunk
   (IndexIVF.encode_vectors with the recorded lists) and writes codes and ids in place with pwrite, in
   row order within a list (as add() would append them);
4. the bounded normaliser's statistics (index/list_stats.py) over those lists: per group of lists whose
   D x D scatter matrices fit SCATTER_BYTES, one more pass accumulates sum_j (y_j - mu_l)(y_j - mu_l)^T and
   max_j |y_j - mu_l|^2; lam_l = top eigenvalue of the scatter / n_l; the row order of the lists is read back
   from the ids in index.ivfdata into normaliser_stats.npz;
5. the index file holds the trained quantizer and the lists' table and names `index.ivfdata`; FAISS reads
   it back with its own IO and maps the lists (faiss_index.read_index), so the version stays
   self-contained (both files checksummed by the manifest, carried by export / import).

Tuning and the gate's recall then read the rows and the lists through memory maps whose pages are dropped
after each block (index/paging.py). Peak RAM: the training sample and k-means, one chunk (CHUNK_ROWS x D
float64 scratch), per-list tables (nlist x D) and one scatter group; ids given in a file (--ids) are held
as a list (~60 B an id), the row-number default never is.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from index import faiss_index, kinds
from index.disk import on_disk, writing
from index.list_stats import round_up, save_streamed
from index.manifest import create_manifest, describe_files, fsync_dir, write_manifest
from index.paging import PagedRows, drop_index_pages, iter_row_blocks, read_rows
from index.store import (
    EMBEDDINGS_FILE,
    IDS_FILE,
    INDEX_FILE,
    IVFDATA_FILE,
    LIST_STATS_FILE,
    IndexStore,
    IndexVersion,
    new_version_name,
)
from index.vectors import VectorSource, sample_unit_rows, unit_blocks

logger = logging.getLogger(__name__)

#: Bytes of rows the quantizer and codebooks train on (32 MiB: 131072 rows at D = 64).
TRAIN_BYTES = 32 << 20
#: Rows read, normalised, assigned and encoded at a time.
CHUNK_ROWS = 1 << 16
#: Bytes of D x D float64 scatter matrices accumulated per pass of the list statistics.
SCATTER_BYTES = 64 << 20
ASSIGN_FILE = "lists.tmp"  # scratch: each row's list number (int32), removed before the commit
ID_BYTES = 8  # FAISS idx_t


def streamed_params(kind: str, count: int, dim: int, params: dict | None = None) -> tuple[dict, int]:
    """(params, training rows) of a streamed build: nlist ~ 4 sqrt(N) capped at training rows / 39 unless
    given; training rows = min(N, TRAIN_BYTES / 4D), raised to 39 nlist for a given nlist and to 64 * 2^nbits
    for PQ."""
    params = dict(params or {})
    train = min(count, max(1, TRAIN_BYTES // (4 * dim)))
    if "nlist" in params:
        train = min(count, max(train, 39 * int(params["nlist"])))
    else:
        params["nlist"] = max(1, min(faiss_index.default_nlist(count), train // 39))
    params = faiss_index.default_params(kind, dim, count, **params)
    train = min(count, max(train, kinds.get(kind).codebook_rows(params)))  # PQ codebooks need their own rows
    return params, train


def stream_kinds() -> tuple[str, ...]:
    """The registered kinds a streamed build makes (`IndexKind.streamable`)."""
    return tuple(name for name in kinds.names() if kinds.get(name).streamable)


@dataclass
class Streamed:
    """What `build_streamed` wrote into a staging directory."""

    index: faiss.Index  # the index read back from its file (lists mapped read-only)
    params: dict
    lists: int
    train_rows: int
    stats_seconds: float
    timings: dict


def build_streamed(
    source: VectorSource,
    staging: Path,
    kind: str,
    params: dict | None = None,
    *,
    seed: int = 0,
    chunk_rows: int = CHUNK_ROWS,
    progress: bool = False,
) -> Streamed:
    """Write embeddings.npy, index.faiss + index.ivfdata and normaliser_stats.npz of `source` into `staging`
    (steps 1-5 of the module docstring); returns the index read back from disk."""
    if not kinds.get(kind).streamable:
        raise ValueError(f"a streamed build makes IVF kinds ({', '.join(stream_kinds())}), not {kind!r}")
    n, d = source.count, source.dim
    params, train_rows = streamed_params(kind, n, d, params)
    timings: dict = {}
    t0 = time.perf_counter()
    index, _ = faiss_index.create_index(kind, d, n, **params)
    rows = (
        np.sort(np.random.default_rng(seed).choice(n, size=train_rows, replace=False))
        if train_rows < n
        else np.arange(n)
    )
    sample = sample_unit_rows(source, rows)
    faiss_index.allow_small_training(index, kind, len(sample))
    index.train(sample)
    del sample
    timings["train_s"] = time.perf_counter() - t0
    ivf = faiss.extract_index_ivf(index)
    nlist, cs = int(ivf.nlist), int(ivf.code_size)

    # pass 1: normalise -> embeddings.npy, assign -> lists.tmp, per-list counts and sums
    t0 = time.perf_counter()
    counts = np.zeros(nlist, np.int64)
    sums = np.zeros((nlist, d))
    with open(staging / EMBEDDINGS_FILE, "wb") as emb_fh, open(staging / ASSIGN_FILE, "wb") as assign_fh:
        np.lib.format.write_array_header_1_0(
            emb_fh, {"descr": np.dtype(np.float32).str, "fortran_order": False, "shape": (n, d)}
        )
        for _start, z in unit_blocks(source, chunk_rows, progress=progress, desc="streamed build: assign"):
            emb_fh.write(memoryview(z).cast("B"))
            _, a = ivf.quantizer.search(z, 1)  # (B, 1) nearest centroid
            a = a[:, 0]
            assign_fh.write(memoryview(a.astype(np.int32)).cast("B"))
            order, lists, starts = _segments(a)
            counts[lists] += np.diff(np.r_[starts, len(a)])
            sums[lists] += np.add.reduceat(z[order].astype(np.float64), starts, axis=0)
        emb_fh.flush()
        os.fsync(emb_fh.fileno())
    timings["assign_s"] = time.perf_counter() - t0

    # pass 2: codes and ids into FAISS's on-disk layout
    t0 = time.perf_counter()
    region = counts * (cs + ID_BYTES)
    offset = np.r_[0, np.cumsum(region)[:-1]]  # list l starts here
    id_offset = offset + counts * cs  # its ids follow its codes
    total = int(region.sum())
    embeddings = np.load(staging / EMBEDDINGS_FILE, mmap_mode="r", allow_pickle=False)
    with open(staging / IVFDATA_FILE, "wb") as fh:
        fh.truncate(total)
    fd = os.open(staging / IVFDATA_FILE, os.O_RDWR)
    try:
        cursor = np.zeros(nlist, np.int64)
        with open(staging / ASSIGN_FILE, "rb") as assign_fh:
            blocks = iter_row_blocks(embeddings, chunk_rows)
            if progress:
                from tqdm import tqdm

                blocks = tqdm(blocks, total=-(-n // chunk_rows), desc="streamed build: encode", unit="block")
            for start, z in blocks:
                a = np.fromfile(assign_fh, np.int32, count=len(z)).astype(np.int64)
                codes = np.empty((len(z), cs), np.uint8)
                ivf.encode_vectors(len(z), faiss.swig_ptr(z), faiss.swig_ptr(a), faiss.swig_ptr(codes), False)
                order, lists, starts = _segments(a)
                codes = codes[order]
                ids = (order + start).astype(np.int64)
                ends = np.r_[starts[1:], len(a)]
                for l, s, e in zip(lists.tolist(), starts.tolist(), ends.tolist()):
                    slot = int(cursor[l])
                    os.pwrite(fd, memoryview(codes[s:e]).cast("B"), int(offset[l]) + slot * cs)
                    os.pwrite(fd, memoryview(ids[s:e]).cast("B"), int(id_offset[l]) + slot * ID_BYTES)
                    cursor[l] += e - s
        assert np.array_equal(cursor, counts), "every list filled to its size"
        os.fsync(fd)
    finally:
        os.close(fd)
    timings["encode_s"] = time.perf_counter() - t0

    # the normaliser's statistics over the lists
    t0 = time.perf_counter()
    means = sums / np.maximum(counts, 1)[:, None]
    radius2, lam = _moments(embeddings, staging / ASSIGN_FILE, means, counts, chunk_rows)
    radius, lam = round_up(np.sqrt(radius2), lam)
    stats_s = time.perf_counter() - t0
    del embeddings
    (staging / ASSIGN_FILE).unlink()
    with open(staging / IVFDATA_FILE, "rb") as fh:
        save_streamed(
            staging / LIST_STATS_FILE,
            np.r_[0, np.cumsum(counts)],
            _order_blocks(fh, counts, id_offset),
            n,
            means.astype(np.float32),
            radius,
            lam,
            f"IVF lists of the index ({nlist})",
            time.perf_counter() - t0,
        )
    stats_s = time.perf_counter() - t0
    timings["list_stats_s"] = stats_s

    # the index file: trained quantizer + the lists' table, naming index.ivfdata (resolved beside it on read)
    invlists = faiss.OnDiskInvertedLists(nlist, cs, IVFDATA_FILE)
    invlists.totsize = total
    sizes = counts.astype(np.uint64)  # named: swig_ptr does not keep its array alive
    invlists.set_all_lists_sizes(faiss.swig_ptr(sizes))
    ivf.replace_invlists(invlists, True)
    invlists.this.disown()
    ivf.ntotal = index.ntotal = n
    faiss.write_index(index, str(staging / INDEX_FILE))
    del index
    index = faiss_index.read_index(staging / INDEX_FILE)
    faiss_index.set_search_params(index, kind, params)
    logger.info(
        "streamed %s build of %d x %d: %d lists, trained on %d rows, %s",
        kind,
        n,
        d,
        nlist,
        train_rows,
        ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()),
    )
    return Streamed(index, params, nlist, train_rows, stats_s, timings)


def _segments(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stable order grouping equal list numbers, the distinct lists, where each starts in that order)."""
    order = np.argsort(a, kind="stable")
    sorted_a = a[order]
    starts = np.flatnonzero(np.r_[True, sorted_a[1:] != sorted_a[:-1]])
    return order, sorted_a[starts], starts


def _moments(
    embeddings: np.ndarray, assign_path: Path, means: np.ndarray, counts: np.ndarray, chunk_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per list: max_j |y_j - mu_l|^2 and the largest eigenvalue of (1/n_l) sum_j (y_j - mu_l)(y_j - mu_l)^T,
    from scatter matrices accumulated over row chunks, one pass per group of lists fitting SCATTER_BYTES."""
    nlist, d = means.shape
    radius2 = np.zeros(nlist)
    lam = np.zeros(nlist)
    group = max(1, SCATTER_BYTES // (d * d * 8))
    for g0 in range(0, nlist, group):
        g1 = min(nlist, g0 + group)
        scatter = np.zeros((g1 - g0, d, d))
        with open(assign_path, "rb") as assign_fh:
            for _start, z in iter_row_blocks(embeddings, chunk_rows):
                a = np.fromfile(assign_fh, np.int32, count=len(z)).astype(np.int64)
                inside = np.flatnonzero((a >= g0) & (a < g1))
                if not len(inside):
                    continue
                order, lists, starts = _segments(a[inside])
                rows = inside[order]
                c = z[rows].astype(np.float64) - means[a[rows]]  # (b, D) y - mu_l
                r2 = np.einsum("ij,ij->i", c, c)
                np.maximum.at(radius2, lists, np.maximum.reduceat(r2, starts))
                ends = np.r_[starts[1:], len(rows)]
                for l, s, e in zip(lists.tolist(), starts.tolist(), ends.tolist()):
                    scatter[l - g0] += c[s:e].T @ c[s:e]
        for l in range(g0, g1):
            if counts[l] > 1:
                lam[l] = float(np.linalg.eigvalsh(scatter[l - g0] / counts[l])[-1])
    return radius2, lam


def _order_blocks(fh, counts: np.ndarray, id_offset: np.ndarray, block_rows: int = CHUNK_ROWS):
    """The rows of every list in list order (the stored ids), read back from index.ivfdata in blocks."""
    buf, held = [], 0
    for l in np.flatnonzero(counts).tolist():
        fh.seek(int(id_offset[l]))
        buf.append(np.fromfile(fh, np.int64, count=int(counts[l])))
        held += int(counts[l])
        if held >= block_rows:
            yield np.concatenate(buf)
            buf, held = [], 0
    if buf:
        yield np.concatenate(buf)


class RowIds:
    """Ids of a version whose ids are its row numbers (row i has id str(i)), without a list of N strings:
    what a streamed build hands the gate instead of reading ids.json back."""

    def __init__(self, count: int):
        self.count = int(count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [str(j) for j in range(*i.indices(self.count))]
        if not -self.count <= i < self.count:
            raise IndexError(i)
        return str(i % self.count)

    def __iter__(self):
        return (str(i) for i in range(self.count))


def _write_ids(path: Path, ids, count: int) -> None:
    """ids.json (a JSON list of strings); row-number ids (`ids` None) written in blocks, never all at once."""
    with open(path, "w", encoding="utf-8") as fh:
        if ids is not None:
            fh.write(json.dumps(list(ids)) + "\n")
            return
        fh.write("[")
        for b in range(0, count, CHUNK_ROWS):
            part = json.dumps([str(i) for i in range(b, min(count, b + CHUNK_ROWS))])[1:-1]
            fh.write((", " if b else "") + part)
        fh.write("]\n")


def tune_streamed(
    index: faiss.Index, kind: str, embeddings: np.ndarray, target_recall: float, k: int, seed: int = 0
) -> dict:
    """The build's tuning (index.build._tune) with every read bounded: exact neighbours over row blocks, the
    search in query batches dropping list pages, re-ranking gathers dropping row pages."""
    n = embeddings.shape[0]
    k = min(k, n - 1)
    if k < 1:
        return faiss_index.single_item_recall(target_recall)
    rows = faiss_index.tuning_rows(n, faiss_index.TUNE_QUERIES, seed)
    queries = read_rows(embeddings, rows).astype(np.float32)
    exact = faiss_index.exact_neighbours(embeddings, queries, k + 1)
    release = lambda: drop_index_pages(index)  # noqa: E731
    result = faiss_index.tune(
        index,
        queries,
        exact,
        target_recall=target_recall,
        k=k,
        kind=kind,
        self_rows=rows,
        embeddings=PagedRows(embeddings),
        release=release,
    )
    return result.recall_record(k, target_recall, len(rows))


def write_streamed_version(
    store: IndexStore,
    source: VectorSource,
    ids: list[str] | None,
    *,
    kind: str,
    params: dict | None,
    target_recall: float,
    fields: dict,
    timings: dict,
    extra_files: dict[str, bytes] | None = None,
    tune_k: int = 10,
    progress: bool = False,
    version: str | None = None,
) -> tuple[str, Path, IndexVersion]:
    """A complete version of `source` in staging, built by `build_streamed` and tuned -> (version, staging
    dir, the staged version loaded with its lists mapped and row-number ids unmaterialised, for the gate).
    `ids` None: row numbers; `version` None: a new name. Nothing is visible in versions/ until
    `IndexStore.commit`."""
    n, dim = source.count, source.dim
    version = version or new_version_name(salt=f"{n}:{dim}:{kind}:streamed")
    staging = store.staging_path(version)
    # embeddings.npy, index.ivfdata (codes + 8 B ids; at most the rows again for ivf-flat), stats (~4 B a row
    # + lists), ids (~ digits + 4 B a row), extra files and the manifest
    needed = sum(
        map(
            on_disk,
            (
                n * dim * 4 + 128,
                n * (dim * 4 + ID_BYTES),
                n * 5 + (1 << 20),
                n * 12,
                n * 4,
                *map(len, (extra_files or {}).values()),
                1 << 16,
            ),
        )
    )
    timings = dict(timings)
    try:
        with writing(staging, needed):
            t0 = time.perf_counter()
            built = build_streamed(source, staging, kind, params, progress=progress)
            timings["build_s"] = time.perf_counter() - t0
            timings.update({f"stream_{k}": v for k, v in built.timings.items()})
            params = dict(built.params)
            embeddings = np.load(staging / EMBEDDINGS_FILE, mmap_mode="r", allow_pickle=False)
            t0 = time.perf_counter()
            recall = tune_streamed(built.index, kind, embeddings, target_recall, tune_k)
            if recall.get("param"):
                params[recall["param"]] = recall["value"]
            if recall.get("rerank"):
                params["rerank"] = recall["rerank"]
            faiss_index.set_search_params(built.index, kind, params)
            timings["tune_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            _write_ids(staging / IDS_FILE, ids, n)
            names = [INDEX_FILE, IVFDATA_FILE, EMBEDDINGS_FILE, IDS_FILE, LIST_STATS_FILE]
            for name, data in (extra_files or {}).items():
                assert name not in names and "/" not in name, f"bad extra version file name {name!r}"
                (staging / name).write_bytes(data)
                names.append(name)
            for name in names:
                with open(staging / name, "rb") as fh:
                    os.fsync(fh.fileno())
            timings["write_s"] = time.perf_counter() - t0
            extra = dict(fields)
            extra.setdefault("recall", recall)
            extra["normaliser_stats"] = {
                "file": LIST_STATS_FILE,
                "partition": f"IVF lists of the index ({built.lists})",
                "lists": built.lists,
                "seconds": built.stats_seconds,
            }
            extra["build"] = {
                "streamed": True,
                "lists_file": IVFDATA_FILE,
                "train_rows": built.train_rows,
                "chunk_rows": CHUNK_ROWS,
            }
            manifest = create_manifest(
                version=version,
                count=n,
                dim=dim,
                kind=kind,
                params=params,
                faiss_version=faiss.__version__,
                files=describe_files(staging, names),
                timings=timings,
                **extra,
            )
            write_manifest(staging, manifest)
            fsync_dir(staging)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
    candidate = IndexVersion(
        staging, manifest, built.index, RowIds(n) if ids is None else list(ids), embeddings
    )
    return version, staging, candidate
