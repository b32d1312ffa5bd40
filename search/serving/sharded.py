"""Serving a sharded version: every shard searched, the answers merged exactly.

For a query x at temperature tau, shard s returns its top-k rows with exact similarities and its own
log Z_s = logsumexp over its rows of s_j / tau. Over the whole version

    log Z = logsumexp_s log Z_s,     top-k = the k most similar of the union of the shards' top-k,

and p(j | x) = exp(s_j / tau - log Z): the same numbers as the unsharded version, not probabilities
renormalised over some shards. A filter is split by row range and applied inside each shard (log Z_s over the
shard's passing rows). The fan-out is pluggable: in process (`LocalShard`, the single-node server) or remote
(api/ray_serve.py, one Ray Serve deployment per shard); a shard that cannot answer raises ShardUnavailable
and the whole query fails (the API answers 503 naming it).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import numpy as np

from index.shards import ShardedVersion, version_metadata
from search.serving.normaliser import LogZ
from search.serving.searcher import Hit, SearchAnswer, SearchSnapshot

__all__ = [
    "ShardAnswer",
    "ShardUnavailable",
    "LocalShard",
    "ShardedSnapshot",
    "merge_answers",
    "shard_answer",
]


class ShardUnavailable(RuntimeError):
    """A shard did not answer: the query cannot be answered exactly, so it is not answered at all."""

    def __init__(self, shard: str, reason: str):
        super().__init__(
            f"shard {shard} is unavailable ({reason}); the whole-index probabilities need every shard"
        )
        self.shard = shard
        self.reason = reason


@dataclass
class ShardAnswer:
    """One shard's answer for Q queries: per query its top rows (LOCAL rows, ranked), their exact
    similarities, and log Z_s as (value, lower, upper) with the normaliser's method and rows read. Plain
    arrays: it crosses process boundaries (Ray) as it is."""

    version: str
    rows: list  # Q arrays of int64 local rows
    sims: list  # Q arrays of float32 similarities
    log_z: np.ndarray  # (Q,) float64
    lower: np.ndarray
    upper: np.ndarray
    method: str
    exact: np.ndarray  # (Q,) bool
    rows_read: np.ndarray  # (Q,) int64


def shard_answer(
    snapshot: SearchSnapshot, q: np.ndarray, k: int, taus: np.ndarray, mask: np.ndarray | None = None
) -> ShardAnswer:
    """Search one shard's snapshot (unit queries `q`, per-query `taus`, optional row mask) -> ShardAnswer."""
    answer = snapshot.search(q, k, taus.tolist(), mask=mask)
    norm = answer.normalisers
    n = q.shape[0]
    return ShardAnswer(
        snapshot.version,
        [np.array([h.row for h in hits], dtype=np.int64) for hits in answer],
        [np.array([h.similarity for h in hits], dtype=np.float32) for hits in answer],
        np.asarray(norm.value, dtype=np.float64).reshape(n),
        np.asarray(norm.lower).reshape(n),
        np.asarray(norm.upper).reshape(n),
        norm.method,
        np.asarray(norm.exact_mask).reshape(n),
        np.asarray(norm.rows).reshape(n),
    )


def merge_answers(
    parts: Sequence[ShardAnswer],
    offsets: Sequence[int],
    ids: Sequence[str],
    k: int,
    taus: np.ndarray,
    version: str,
) -> SearchAnswer:
    """The whole version's answer from its shards' answers: log Z = logsumexp of the shards' log Z_s (bounds
    likewise), the top-k the most similar of the shards' top-k (ties: lower global row first), p = exp(s / tau
    - log Z)."""
    n = len(taus)
    value = np.logaddexp.reduce(np.stack([p.log_z for p in parts]), axis=0) if parts else np.full(n, -np.inf)
    lower = np.logaddexp.reduce(np.stack([p.lower for p in parts]), axis=0)
    upper = np.logaddexp.reduce(np.stack([p.upper for p in parts]), axis=0)
    exact = np.logical_and.reduce(np.stack([p.exact for p in parts]), axis=0)
    rows_read = np.sum(np.stack([p.rows_read for p in parts]), axis=0)
    methods = {p.method for p in parts} - {"exact"}
    nan = np.full(n, np.nan)
    norm = LogZ(
        value,
        lower,
        upper,
        methods.pop() if len(methods) == 1 else ("exact" if not methods else "mixed"),
        nan,
        nan,
        None,
        rows_read.astype(np.int64),
        exact,
    )
    hits: list[list[Hit]] = []
    for i in range(n):
        rows = np.concatenate([p.rows[i] + off for p, off in zip(parts, offsets)]).astype(np.int64)
        sims = np.concatenate([p.sims[i] for p in parts]).astype(np.float32)
        order = np.lexsort((rows, -sims))[:k]
        rows, sims = rows[order], sims[order]
        prob = np.exp(sims.astype(np.float64) / taus[i] - value[i])
        hits.append([Hit(ids[r], r, s, p) for r, s, p in zip(rows.tolist(), sims.tolist(), prob.tolist())])
    return SearchAnswer(hits, version, [float(t) for t in taus], value.tolist(), norm)


class LocalShard:
    """A shard searched in this process: its own SearchSnapshot (vector queries only)."""

    def __init__(self, name: str, snapshot: SearchSnapshot):
        self.name, self.snapshot = name, snapshot

    def __call__(self, q: np.ndarray, k: int, taus: np.ndarray, mask: np.ndarray | None) -> ShardAnswer:
        return shard_answer(self.snapshot, q, k, taus, mask)


#: fan-out threads shared by every sharded snapshot in the process (numpy and FAISS release the GIL while a
#: shard scans; a remote shard's thread only waits). Shared, so a swap leaves no idle pool behind.
FANOUT_THREADS = 16
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _fanout_pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(FANOUT_THREADS, thread_name_prefix="softsearch-shard")
        return _POOL


@dataclass(frozen=True, eq=False)
class ShardedSnapshot(SearchSnapshot):
    """A SearchSnapshot over a sharded version: the encoder, ids and metadata of the whole version, searches
    fanned out to `shards` (callables (q, k, taus, mask) -> ShardAnswer, one per shard in row order) and
    merged exactly."""

    shards: tuple = ()
    names: tuple = ()
    read_item_metadata: ClassVar = staticmethod(version_metadata)  # every shard's, merged in row order

    @property
    def dim(self) -> int:
        return int(self.index.manifest.dim)

    @property
    def count(self) -> int:
        return int(self.index.manifest.count)

    @property
    def offsets(self) -> list[int]:
        return [int(e["offset"]) for e in self.index.manifest.shards]

    def search(
        self,
        vectors: np.ndarray,
        k: int,
        temperature: float | Sequence[float | None] | None = None,
        mask: np.ndarray | None = None,
        unit: bool = False,
    ) -> SearchAnswer:
        """Top-k over every shard with probabilities over the whole version (or the rows `mask` passes).
        With `unit`, `vectors` are (Q, dim) float32 rows that `unit_queries` already gave (as
        `SearchSnapshot.search`)."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        q = self.query_rows(vectors, unit)
        taus = self.resolve_temperatures(q.shape[0], temperature)
        population = self.count if mask is None else int(np.count_nonzero(mask))
        k_eff = min(int(k), population)
        if q.shape[0] == 0 or k_eff == 0:
            return SearchAnswer(
                [[] for _ in range(q.shape[0])], self.version, taus.tolist(), [float("-inf")] * q.shape[0]
            )
        bounds = [*self.offsets, self.count]
        masks = [None if mask is None else np.asarray(mask[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        futures = [_fanout_pool().submit(shard, q, k_eff, taus, m) for shard, m in zip(self.shards, masks)]
        parts = []
        for name, fut in zip(self.names, futures):
            try:
                part = fut.result()
            except ShardUnavailable:
                raise
            except (ValueError, KeyError):
                raise
            except (
                Exception
            ) as err:  # a shard that failed is down for this query: never renormalise without it
                raise ShardUnavailable(name, f"{type(err).__name__}: {err}") from err
            if (
                part.version != f"{self.version}.{name}"
            ):  # each shard's manifest names the version it belongs to
                raise ShardUnavailable(name, f"it answered for version {part.version}, not {self.version}")
            parts.append(part)
        return merge_answers(parts, self.offsets, self.index.ids, k_eff, taus, self.version)


def local_shards(version: ShardedVersion, make_snapshot: Callable) -> tuple[list[LocalShard], list[str]]:
    """In-process shards of a loaded sharded version; `make_snapshot(shard IndexVersion)` makes each one's
    SearchSnapshot (no encoder: the whole version's snapshot encodes the queries once)."""
    shards = [LocalShard(name, make_snapshot(v)) for name, v in zip(version.names, version.shards)]
    return shards, list(version.names)


def sharded_snapshot(
    base: dict, version: ShardedVersion, shards: Sequence[Callable], names: Sequence[str]
) -> ShardedSnapshot:
    """A ShardedSnapshot from the SearchSnapshot fields `base` (encoder, checkpoint_sha256, temperature,
    ...)."""
    return ShardedSnapshot(index=version, shards=tuple(shards), names=tuple(names), **base)
