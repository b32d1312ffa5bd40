"""Vectors computed elsewhere ("bring your own vectors"): read, check and normalise them for
`index build --embeddings`.

A source is one `.npy` file or a directory of `.npy` shards concatenated in name order, each a
(rows, D) float16 / float32 / float64 array, read memory-mapped in row blocks (never all of a
float64 file in RAM at once). Rows are normalised to unit length by the build, z = v / ||v||; a
zero or non-finite row has no direction and is refused, naming its row (and the shard it is in).
Ids default to the row number as a string; an ids file holds one id per line, as many as rows,
all distinct. The version records the source (`source_record`): paths, shapes, dtype and sha256.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from index.items import read_id_lines
from index.manifest import file_sha256

logger = logging.getLogger(__name__)

DTYPES = (np.float16, np.float32, np.float64)
BLOCK_ROWS = 65536  # rows normalised at a time (x D x 8 bytes of float64 scratch)


@dataclass(frozen=True)
class VectorSource:
    """The shards of a vector source, memory-mapped: `shards[i]` is a (rows_i, D) array of `files[i]`."""

    path: Path
    files: tuple[Path, ...]
    shards: tuple[np.ndarray, ...]

    @property
    def count(self) -> int:
        return int(sum(s.shape[0] for s in self.shards))

    @property
    def dim(self) -> int:
        return int(self.shards[0].shape[1])

    def where(self, row: int) -> str:
        """'row R' (a file) or 'row R (row r of shard NAME)' (a directory), for error messages."""
        if len(self.files) == 1:
            return f"row {row}"
        start = 0
        for f, s in zip(self.files, self.shards):
            if row < start + s.shape[0]:
                return f"row {row} (row {row - start} of {f.name})"
            start += s.shape[0]
        return f"row {row}"


def open_vectors(path: str | Path) -> VectorSource:
    """Memory-map a `.npy` file or every `*.npy` in a directory (name order); checks shape and dtype."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".npy" and p.is_file())
        if not files:
            raise ValueError(f"--embeddings {path} is a directory without .npy shards")
    elif path.is_file():
        if path.suffix != ".npy":
            raise ValueError(f"--embeddings {path} must be a .npy file or a directory of .npy shards")
        files = [path]
    else:
        raise FileNotFoundError(f"embeddings not found: {path}")
    shards = []
    for f in files:
        try:
            arr = np.load(f, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(f"{f} is not a readable .npy array ({err})") from None
        if arr.dtype not in DTYPES:
            raise ValueError(f"{f} holds {arr.dtype}; expected float16, float32 or float64 vectors")
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ValueError(f"{f} has shape {arr.shape}; expected a non-empty (rows, dim) matrix")
        if shards and arr.shape[1] != shards[0].shape[1]:
            raise ValueError(f"{f} has dimension {arr.shape[1]}, {files[0].name} has {shards[0].shape[1]}")
        shards.append(arr)
    return VectorSource(path, tuple(files), tuple(shards))


def unit_rows(source: VectorSource, progress: bool = False) -> np.ndarray:
    """(N, D) float32 unit rows z = v / ||v|| (norm taken in float64), shards concatenated in order.

    Raises ValueError naming the first zero or non-finite row."""
    out = np.empty((source.count, source.dim), dtype=np.float32)
    for start, z in unit_blocks(source, progress=progress):
        out[start : start + z.shape[0]] = z
    return out


def unit_blocks(
    source: VectorSource,
    block_rows: int = BLOCK_ROWS,
    progress: bool = False,
    desc: str = "normalise vectors",
):
    """Yield (first row, (B, D) float32 unit rows) over the source in blocks (a block never spans two shards),
    dropping the pages of each block from the shard's memory map once read (index/paging.py): one pass
    over a file larger than RAM keeps one block resident."""
    from index.paging import read_span

    blocks = []
    start = 0
    for shard in source.shards:
        blocks += [(shard, start, b) for b in range(0, shard.shape[0], block_rows)]
        start += shard.shape[0]
    if progress:
        from tqdm import tqdm

        blocks = tqdm(blocks, desc=desc, unit="block")
    for shard, first, b in blocks:
        v = read_span(shard, b, b + block_rows).astype(np.float64)  # (B, D), a RAM copy (pread)
        yield first + b, unit_block(v, lambda i, r0=first + b: source.where(r0 + i))


def unit_block(v: np.ndarray, where) -> np.ndarray:
    """float32 z = v / ||v|| of a float64 (B, D) block; `where(i)` names row i in the ValueError for the first
    zero or non-finite row."""
    bad = ~np.isfinite(v).all(axis=1)
    if bad.any():
        raise ValueError(f"embeddings {where(int(np.argmax(bad)))} contains NaN or inf")
    norms = np.sqrt(np.einsum("ij,ij->i", v, v))  # ||v|| per row
    zero = norms == 0
    if zero.any():
        raise ValueError(
            f"embeddings {where(int(np.argmax(zero)))} is a zero vector (no direction to search by)"
        )
    if not np.isfinite(norms).all():  # finite values whose squares overflow float64: scale first
        v = v / np.abs(v).max(axis=1, keepdims=True)
        norms = np.sqrt(np.einsum("ij,ij->i", v, v))
    return (v / norms[:, None]).astype(np.float32)


def sample_unit_rows(source: VectorSource, rows: np.ndarray) -> np.ndarray:
    """float32 unit rows of the sorted global `rows` (a training sample), gathered shard by shard with the
    pages dropped after each shard."""
    from index.paging import read_rows

    out = np.empty((len(rows), source.dim), dtype=np.float32)
    i = start = 0
    for shard in source.shards:
        j = int(np.searchsorted(rows, start + shard.shape[0]))
        if j > i:
            v = read_rows(shard, rows[i:j] - start).astype(np.float64)
            out[i:j] = unit_block(v, lambda q, sel=rows[i:j]: source.where(int(sel[q])))
        i, start = j, start + shard.shape[0]
    return out


def read_ids(path: str | Path, count: int) -> list[str]:
    """One id per line (a final newline is allowed; ids are kept exactly); exactly `count` distinct ids."""
    path = Path(path)
    ids = read_id_lines(path, "--ids")
    for i, item in enumerate(ids):
        if not item.strip():
            raise ValueError(f"--ids {path}: line {i + 1} is empty (one id per line)")
    if len(ids) != count:
        raise ValueError(f"--ids {path} holds {len(ids)} ids for {count} vectors")
    first: dict[str, int] = {}
    for i, item in enumerate(ids):
        if item in first:
            raise ValueError(f"--ids {path}: id {item!r} appears on lines {first[item] + 1} and {i + 1}")
        first[item] = i
    return ids


def default_ids(count: int) -> list[str]:
    """Row numbers as strings: row i has id str(i)."""
    return [str(i) for i in range(count)]


def source_record(source: VectorSource, ids_path: str | Path | None = None) -> dict:
    """The manifest's `source`: where the vectors came from, their shape and dtype, and sha256 of the bytes
    (one file: its sha256; a directory: sha256 over each shard's name and sha256, in order)."""
    shards = [
        {"file": f.name, "rows": int(s.shape[0]), "dtype": str(s.dtype), "sha256": file_sha256(f)}
        for f, s in zip(source.files, source.shards)
    ]
    if len(shards) == 1 and not source.path.is_dir():
        digest = shards[0]["sha256"]
    else:
        h = hashlib.sha256()
        for s in shards:
            h.update(f"{s['file']}\0{s['sha256']}\n".encode())
        digest = h.hexdigest()
    record = {
        "embeddings": str(source.path.resolve()),
        "sha256": digest,
        "count": source.count,
        "dim": source.dim,
        "dtype": sorted({s["dtype"] for s in shards}),
        "shards": shards if source.path.is_dir() else None,
        "normalised_by": "index build (z = v / ||v||)",
        "ids": None if ids_path is None else str(Path(ids_path).resolve()),
        "ids_sha256": None if ids_path is None else file_sha256(ids_path),
    }
    return record
