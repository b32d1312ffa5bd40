"""Sharded index versions: one version whose items are split into N shards, each a complete version directory.

Layout of a sharded version (one version for the store: one manifest, one checksum list, one activation)::

    versions/<version>/manifest.json    count = all items; ``shards`` lists each shard's name, rows, offset;
                                        ``files`` lists every shard file as "shard-000/index.faiss", ...
    versions/<version>/shard-000/       its own manifest.json, index.faiss, embeddings.npy, ids.json,
                                        item_metadata.json, normaliser_stats.npz (index/build.write_version)

Rows are split contiguously: global row = shard offset + local row, so a sharded version and the version it
was resharded from number their items alike. Serving merges the shards exactly (search/serving/sharded.py):
log Z = logsumexp of the shards' log Z_s, top-k = the merge of each shard's top-k.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import faiss
import numpy as np

from index import faiss_index, kinds
from index.manifest import (
    MANIFEST_NAME,
    IndexCorruptError,
    Manifest,
    create_manifest,
    describe_files,
    fsync_dir,
    read_manifest,
    verify_files,
    write_manifest,
)
from index.metadata import item_files, read_metadata
from index.options import CommitOptions

logger = logging.getLogger(__name__)

#: Fields a sharded version carries over from the version it was made from (encoder, data, temperature).
CARRIED = (
    "checkpoint",
    "encoder",
    "dataset",
    "sources",
    "source",
    "lineage",
    "search_temperature",
    "search_temperature_source",
    "calibration",
    "skipped_count",
    "trained_on",
)


def shard_name(i: int) -> str:
    """The directory of shard `i` inside a sharded version."""
    return f"shard-{i:03d}"


def split_rows(n: int, shards: int) -> list[tuple[int, int]]:
    """[(start, stop)] of `shards` contiguous, near-equal row ranges covering 0..n-1 (each non-empty)."""
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"--shards must be a positive integer, got {shards!r}")
    if shards > n:
        raise ValueError(f"cannot split {n} items into {shards} shards (each shard needs at least one item)")
    cuts = [n * i // shards for i in range(shards + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def is_sharded(manifest: Manifest) -> bool:
    """True for a sharded version's top-level manifest."""
    return bool(manifest.shards)


class ShardedRows:
    """The stored rows of all shards read as one (N, D) float32 matrix: `rows[i]`, `rows[array]`, `.shape`.

    Reads go to the owning shard's memory map; nothing is concatenated."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [int(p.shape[0]) for p in parts])
        self.shape = (int(self.offsets[-1]), int(parts[0].shape[1]))
        self.ndim, self.dtype = 2, np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def locate(self, row: int) -> tuple[int, int]:
        """(shard, local row) of a global row."""
        if not -self.shape[0] <= row < self.shape[0]:
            raise IndexError(f"row {row} out of range for {self.shape[0]} rows")
        row %= self.shape[0]
        s = int(np.searchsorted(self.offsets, row, side="right") - 1)
        return s, row - int(self.offsets[s])

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            s, r = self.locate(int(key))
            return np.asarray(self.parts[s][r])
        if isinstance(key, slice):
            key = np.arange(*key.indices(self.shape[0]))
        rows = np.asarray(key, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < -self.shape[0] or rows.max() >= self.shape[0]):
            raise IndexError(f"rows out of range for {self.shape[0]} rows")
        rows = rows % max(self.shape[0], 1)
        owner = np.searchsorted(self.offsets, rows, side="right") - 1
        out = np.empty((rows.size, self.shape[1]), dtype=np.float32)
        for s in np.unique(owner).tolist():  # one gather per shard
            where = np.flatnonzero(owner == s)
            out[where] = np.take(self.parts[s], rows[where] - int(self.offsets[s]), axis=0)
        return out

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(p) for p in self.parts])
        return whole if dtype is None else whole.astype(dtype)


class ShardedVersion:
    """A loaded sharded version: its top-level manifest and each shard as an `index.store.IndexVersion`.

    Offers what callers read of an IndexVersion: `path`, `manifest`, `version`, `kind`, `ids` (all shards,
    in global row order), `embeddings` (a `ShardedRows`); `index` is None (each shard has its own)."""

    def __init__(self, path: Path, manifest: Manifest, shards: list):
        self.path = Path(path)
        self.manifest = manifest
        self.version: str = manifest.version
        self.kind: str = manifest.kind
        self.shards = shards
        self.names = [s["name"] for s in manifest.shards]
        self.ids = [i for shard in shards for i in shard.ids]
        self.embeddings = ShardedRows([shard.embeddings for shard in shards])
        self.offsets = [int(o) for o in self.embeddings.offsets[:-1]]
        self.index = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return int(self.manifest.dim)

    def list_stats(self):
        return None  # each shard has its own (search/serving/sharded.py reads them per shard)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores (Q, k'), global rows (Q, k')) of every shard's FAISS index at its tuned parameters, merged
        by score (ties: lower row first), k' = min(k, N); -1 = none. What `IndexVersion.search` answers
        unsharded."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        scores, rows = [], []
        for shard, off in zip(self.shards, self.offsets):
            s, r = faiss_index.search(shard.index, q, min(k, len(shard.ids)))
            scores.append(np.where(r >= 0, s, -np.inf))
            rows.append(np.where(r >= 0, r + off, -1))
        scores, rows = np.concatenate(scores, axis=1), np.concatenate(rows, axis=1)
        order = np.lexsort((np.where(rows >= 0, rows, np.iinfo(np.int64).max), -scores), axis=1)[
            :, : min(k, len(self))
        ]
        scores, rows = np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)
        return np.where(rows >= 0, scores, -np.inf).astype(np.float32), rows

    def item_ids(self, rows) -> list:
        """Caller ids for global rows (as `IndexVersion.item_ids`)."""
        from index.store import IndexVersion

        return IndexVersion.item_ids(self, rows)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        manifest: Manifest | None = None,
        verify: bool = True,
        gpu: bool | None = None,
    ) -> "ShardedVersion":
        """Load every shard of the sharded version at `path`; `verify` checks every file listed in the
        top-level manifest (all shards' files) first. IndexCorruptError when a shard disagrees with it."""
        from index.store import IndexVersion

        path = Path(path)
        manifest = manifest or read_manifest(path)
        if verify:
            verify_files(path, manifest)
        shards, total = [], 0
        for entry in manifest.shards:
            shard = IndexVersion.load(path / entry["name"], verify=False, gpu=gpu)
            if len(shard.ids) != entry["count"] or total != entry["offset"]:
                raise IndexCorruptError(
                    f"{path / entry['name']}: {len(shard.ids)} rows at offset {total}, the "
                    f"manifest says {entry['count']} at {entry['offset']}"
                )
            if shard.manifest.dim != manifest.dim:
                raise IndexCorruptError(
                    f"{path / entry['name']} has dim {shard.manifest.dim}, expected {manifest.dim}"
                )
            total += len(shard.ids)
            shards.append(shard)
        if total != manifest.count:
            raise IndexCorruptError(
                f"{path}: the shards hold {total} rows, the manifest says {manifest.count}"
            )
        return cls(path, manifest, shards)


def version_metadata(path):
    """The metadata of a version directory, a sharded one's merged over its shards
    (index.metadata.Metadata)."""
    path = Path(path)
    manifest = read_manifest(path)
    if not manifest.shards:
        return read_metadata(path)
    merged = read_metadata(path / manifest.shards[0]["name"])
    for entry in manifest.shards[1:]:
        merged = merged.merge(read_metadata(path / entry["name"]))
    return merged


def version_records(path) -> dict:
    """The file records (item_files.json) of a version directory, a sharded one's merged over its shards."""
    from index.items import read_records

    path = Path(path)
    manifest = read_manifest(path)
    if not manifest.shards:
        return read_records(path)
    merged: dict = {}
    for entry in manifest.shards:
        merged.update(read_records(path / entry["name"]))
    return merged


def merged_recall(parent, shard_versions: list, offsets: list[int], target: float) -> dict:
    """recall@10 of the shards' FAISS indexes at their tuned parameters, their top-k merged, against exact
    search over all rows, on stored rows as queries (each query's own row excluded): the activation rule's
    recall check for a sharded version."""
    emb = parent.embeddings
    n = int(emb.shape[0])
    k = min(10, n - 1)
    if k < 1:
        return faiss_index.single_item_recall(target)
    if all(kinds.get(s.kind).exact for s in shard_versions):
        return {"k": k, "recall": 1.0, "exact": True, "target": target}
    rows = faiss_index.tuning_rows(n, faiss_index.TUNE_QUERIES, 0)
    queries = np.asarray(emb[rows], dtype=np.float32)
    exact = faiss_index.exact_neighbours(emb, queries, k + 1)
    sims, found = [], []
    for shard, off in zip(shard_versions, offsets):
        rerank = faiss_index.rerank_factor(shard.kind, shard.manifest.params)
        s, r = faiss_index.search_reranked(shard.index, shard.embeddings, queries, k + 1, rerank)
        sims.append(np.where(r >= 0, s, -np.inf))
        found.append(np.where(r >= 0, r + off, -1))
    sims, found = np.concatenate(sims, axis=1), np.concatenate(found, axis=1)
    order = np.argsort(-sims, axis=1, kind="stable")[:, : k + 1]
    merged = np.take_along_axis(found, order, axis=1)
    merged = faiss_index.drop_rows(merged, rows, k)
    exact = faiss_index.drop_rows(exact, rows, k)
    recall = faiss_index.recall_at_k(merged, exact, k)
    return {
        "k": k,
        "recall": float(recall),
        "exact": False,
        "target": target,
        "sample": int(len(rows)),
        "queries": "stored rows, own row excluded; the shards' top-k merged",
    }


def write_sharded(
    store,
    parent,
    shards: int,
    *,
    target_recall: float = 0.95,
    version: str | None = None,
    kind: str | None = None,
    params: dict | None = None,
) -> tuple[str, Path]:
    """Split the loaded version `parent` (an IndexVersion) into `shards` contiguous shards and write one
    sharded version into staging: each shard built and tuned by `index.build.write_version` with the parent's
    kind (or `kind`), its metadata restricted to its items. Returns (version, staging dir); nothing is in
    versions/ yet."""
    from index.build import write_version
    from index.commit import discard_staging
    from index.store import new_version_name

    t_start = time.perf_counter()
    pm = parent.manifest
    n, dim = int(pm.count), int(pm.dim)
    ranges = split_rows(n, shards)
    kind = kind or pm.kind
    base = dict(
        params
        if params is not None
        else {k: v for k, v in pm.params.items() if k not in ("nprobe", "efSearch", "rerank")}
    )
    version = version or new_version_name(salt=f"{n}:{dim}:{kind}:shards{shards}")
    staging = store.staging_path(version)
    metadata = version_metadata(parent.path)
    records = version_records(parent.path)
    entries, files, shard_versions, timings = [], {}, [], {}
    try:
        staging.mkdir(parents=True, exist_ok=True)
        for s, (a, b) in enumerate(ranges):
            name = shard_name(s)
            ids = [str(parent.ids[i]) for i in range(a, b)]
            extra = item_files(records, metadata, ids)
            fields = {
                **pm.carried(*CARRIED),
                "parent": pm.version,
                "shard": {"name": name, "of": version, "offset": a, "shards": shards},
            }
            t0 = time.perf_counter()
            _, shard_staging = write_version(
                store,
                np.asarray(parent.embeddings[a:b], dtype=np.float32),
                ids,
                kind=kind,
                params=dict(base),
                target_recall=target_recall,
                fields=fields,
                version=f"{version}.{name}",
                extra_files=extra,
            )
            os.rename(shard_staging, staging / name)
            timings[f"{name}_s"] = time.perf_counter() - t0
            shard_manifest = read_manifest(staging / name)
            listed = {**shard_manifest.files, **describe_files(staging / name, [MANIFEST_NAME])}
            files.update({f"{name}/{fname}": info for fname, info in listed.items()})
            entries.append(
                {
                    "name": name,
                    "count": b - a,
                    "offset": a,
                    "kind": shard_manifest.kind,
                    "params": shard_manifest.params,
                    "recall": shard_manifest.recall.recall if shard_manifest.recall else None,
                }
            )
        from index.store import IndexVersion

        shard_versions = [IndexVersion.load(staging / e["name"], verify=False, gpu=False) for e in entries]
        recall = merged_recall(parent, shard_versions, [e["offset"] for e in entries], target_recall)
        shard_versions = []
        timings["total_s"] = time.perf_counter() - t_start
        manifest = create_manifest(
            version=version,
            count=n,
            dim=dim,
            kind=kind,
            params=base,
            faiss_version=faiss.__version__,
            files=files,
            timings=timings,
            **pm.carried(*CARRIED),
            parent=pm.version,
            recall=recall,
            shards=entries,
        )
        write_manifest(staging, manifest)
        fsync_dir(staging)
    except BaseException:
        shard_versions = []
        discard_staging(staging)
        raise
    logger.info(
        "wrote sharded version %s: %d items in %d shards (%.1f s)",
        version,
        n,
        shards,
        time.perf_counter() - t_start,
    )
    return version, staging


def reshard(
    root,
    shards: int,
    *,
    source: str | None = None,
    commit: CommitOptions | None = None,
    path: str = "index reshard",
) -> str:
    """A new sharded version with the items of `source` (default: current) split into `shards` shards, gated
    and activated like any version. The quality gate scores the source's rows and temperature, which the
    sharded version holds unchanged (its search answers equal the source's), and the recall check measures the
    shards' merged FAISS search (`merged_recall`). `commit` None: `CommitOptions(margin=0.0)` (the same rows
    scored twice: no noise to tolerate)."""
    from index.commit import Staged
    from index.commit import commit as commit_staged
    from index.store import IndexStore, IndexVersion

    commit = commit or CommitOptions(margin=0.0)
    commit.check()
    store = IndexStore(root)
    source = source or store.current_version()
    if source is None:
        raise FileNotFoundError(f"no current index version under {root} to reshard; build one first")
    parent = store.load(source, verify=True, gpu=False)
    if isinstance(parent, ShardedVersion):
        parent = flat_view(parent)
    version, staging = write_sharded(store, parent, shards, target_recall=commit.target_recall)
    manifest = read_manifest(staging)
    # the gate runs on the source's rows under the sharded manifest (same items, rows and temperature)
    candidate = IndexVersion(staging, manifest, parent.index, parent.ids, parent.embeddings)
    return commit_staged(store, Staged(version, staging, candidate), commit, path=path)


def flat_view(sharded: ShardedVersion):
    """A sharded version read as one unsharded IndexVersion (rows concatenated, one flat FAISS index over
    them): the source when an already sharded version is resharded."""
    from index.store import IndexVersion

    emb = np.ascontiguousarray(np.asarray(sharded.embeddings), dtype=np.float32)
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(emb)
    return IndexVersion(sharded.path, sharded.manifest, index, list(sharded.ids), emb)


def unshard(store, version: str, *, target_recall: float = 0.95) -> str:
    """Commit (never activate) an unsharded version equal to the sharded `version`: its rows, ids, metadata
    and file records in global row order, the shards' kind rebuilt over all rows, the encoder, data and
    temperature carried over. What `index add / sync / delete` start from on a sharded version (their result
    is resharded)."""
    from index.build import write_version
    from index.commit import discard_staging

    sharded = store.load(version, verify=True, gpu=False)
    m = sharded.manifest
    ids = list(sharded.ids)
    kind = m.shards[0].get("kind") or m.kind
    params = {k: v for k, v in (m.params or {}).items() if k not in ("nprobe", "efSearch", "rerank")}
    fields = {**m.carried(*CARRIED, "skipped", "world_size", "text"), "parent": m.version}
    extra = item_files(version_records(sharded.path), version_metadata(sharded.path), ids)
    whole, staging = write_version(
        store,
        np.asarray(sharded.embeddings, dtype=np.float32),
        ids,
        kind=kind,
        params=params,
        target_recall=target_recall,
        fields=fields,
        extra_files=extra,
    )
    try:
        store.commit(staging, whole)
    except BaseException:
        discard_staging(staging)
        raise
    return whole


def remove_unserved(store, version: str) -> None:
    """Delete a version that was never activated (the unsharded intermediate of `index build --shards`)."""
    if (
        version in (store.current_version(), *store.history().get("stack", []))
        or not (store.versions_dir / version).is_dir()
    ):  # serving, or already pruned
        return
    with store.lock():
        trash = store.root / f".trash-{version}"
        os.rename(store.versions_dir / version, trash)
        shutil.rmtree(trash, ignore_errors=True)
        fsync_dir(store.versions_dir)
