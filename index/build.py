"""Build, rebuild and extend index versions: embed -> FAISS -> staging -> commit -> gate -> activate.

A version is written completely into `staging/<version>/` (index, embeddings, ids, manifest
with checksums) and only then renamed into `versions/`; activation is a separate atomic
pointer switch. A process killed at any point therefore leaves `current` and every listed
version loadable; a rerun resumes from the embedding shards already on disk.

Quality gate: `evaluator(candidate, serving)` is injected by the caller (the search package;
index/ cannot import search/). It gets two loaded `IndexVersion`s and returns a dict with at
least ``"candidate"`` and ``"serving"``: scores where higher is better (plus anything else,
e.g. ``"metric"``, stored verbatim; ``"index_recall": {"candidate": {"recall", "n_queries"}}`` is the
recall@10 the candidate's FAISS index reaches on held-out queries). `gate_record` turns that, and
the recall the index reaches against its target, into the manifest's ``quality_gate``; activation
goes through `IndexStore.activate` (the one activation rule), which refuses (QualityGateError, an
ActivationRefused) when ``candidate < serving - margin`` or the recall is below target, unless
`force`. The version is still committed, so it can be inspected or activated later with
``index activate --force``. A build that fails before its commit removes its staging directory.

Every path takes its inputs as arguments and its knobs as `EmbedOptions` / `CommitOptions`
(index/options.py; `BuildOptions` is both plus what to build), stages with `write_version` and ends in
the one `index.commit.commit` step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np

from index import faiss_index, kinds
from index.commit import Staged, discard_staging
from index.commit import commit as commit_staged
from index.disk import BLOCK, DiskFull, on_disk, writing
from index.embed import (
    EmbedResult,
    barrier,
    broadcast,
    cache_key,
    collect_shards,
    distributed,
    embed_shards,
    prepare_cache,
    shard_count,
)
from index.gate import QualityGateError  # noqa: F401  (re-exported: what a refused build raises)
from index.items import dataset_records, read_records
from index.list_stats import ListStats
from index.manifest import (
    DEFAULT_TEMPERATURE,
    Manifest,
    create_manifest,
    describe_files,
    fsync_dir,
    write_manifest,
)
from index.metadata import (
    Metadata,
    dataset_metadata,
    item_files,
    read_metadata,
    report_unknown_ids,
    user_fields,
)
from index.models import is_store_model, model_relpath
from index.options import CommitOptions, EmbedOptions
from index.store import (
    EMBEDDINGS_FILE,
    IDS_FILE,
    INDEX_FILE,
    LIST_STATS_FILE,
    VERSION_FILES,
    IndexStore,
    new_version_name,
)
from training.distributed import default_device

logger = logging.getLogger(__name__)

TUNE_QUERIES = faiss_index.TUNE_QUERIES
TUNE_K = 10


# ----------------------------------------------------------------------------- helpers


def training_temperature(info: dict) -> tuple[float, str]:
    """(temperature, where it came from) recorded by training, for the manifest's search_temperature.

    Looks at metrics.temperature (the last one logged), lineage.temperature /
    final_temperature, then the schedule options of the train config.
    """
    metrics = info.get("metrics") or {}
    lineage = info.get("lineage") or {}
    for where, source in (("metrics", metrics), ("lineage", lineage)):
        for key in ("temperature", "final_temperature", "tau"):
            value = source.get(key)
            if isinstance(value, (int, float)) and value > 0:
                return float(value), f"checkpoint {where}.{key}"
    options = (info.get("train_config") or {}).get("schedule_options") or {}
    for key in ("temperature", "tau", "tau_min", "final"):
        value = options.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value), f"checkpoint train_config.schedule_options.{key}"
    return DEFAULT_TEMPERATURE, "default (checkpoint records no temperature)"


def _as_list(datasets) -> list:
    if isinstance(datasets, (list, tuple)):
        out = list(datasets)
    else:
        out = [datasets]
    if not out:
        raise ValueError("no dataset given to index")
    for ds in out:
        if not hasattr(ds, "item_id") or not hasattr(ds, "spec"):
            raise ValueError(f"expected an ImageDataset, got {type(ds).__name__}")
        if len(ds) == 0:
            raise ValueError(f"dataset {ds!r} is empty")
    return out


def embed_sources(
    encoder,
    ckpt_sha: str,
    datasets: list,
    store: IndexStore,
    embed: EmbedOptions,
    *,
    indices: list | None = None,
    device,
    rank: int = 0,
    world: int = 1,
) -> tuple[list[EmbedResult], list[Path]] | None:
    """Embed every source into its own resumable cache (`device`: the resolved torch device); rank 0
    gets (results, caches), other ranks None. On a full disk the caches written so far are removed
    (DiskFull)."""
    shard_size = embed.shard_size
    results, caches = [], []
    for s, ds in enumerate(datasets):
        idx = (
            np.arange(len(ds), dtype=np.int64)
            if indices is None or indices[s] is None
            else np.asarray(indices[s], np.int64)
        )
        key = cache_key(ckpt_sha, ds.fingerprint(), idx, shard_size)
        cache = store.staging_dir / f"embed-{key}"
        resumed = 0
        caches.append(cache)
        # the build needs the cache (N x D float32 rows, two files a shard), then a version of about twice
        # the rows (embeddings.npy and an index as large) and ~16 B a row of ids and statistics; add / sync
        # versions also hold the base's rows, not counted here
        rows = len(idx) * encoder.embed_dim * 4
        needed = 3 * rows + 16 * len(idx) + (2 * shard_count(len(idx), shard_size) + 16) * BLOCK
        with released_on_disk_full(caches), writing(cache, needed=needed):
            if rank == 0:
                store.ensure()
                resumed = prepare_cache(cache, key, idx, shard_size)
            barrier()
            t0 = time.perf_counter()
            if len(idx):
                embed_shards(
                    encoder,
                    ds,
                    cache,
                    idx,
                    shard_size=shard_size,
                    batch_size=embed.batch_size,
                    num_workers=embed.num_workers,
                    device=device,
                    rank=rank,
                    world_size=world,
                    progress=embed.progress,
                )
            barrier()
        if rank == 0:
            res = collect_shards(cache, idx, shard_size, encoder.embed_dim)
            res.seconds = time.perf_counter() - t0
            res.resumed_shards = resumed
            results.append(res)
            caches.append(cache)
    return (results, caches) if rank == 0 else None


@contextlib.contextmanager
def released_on_disk_full(caches: list[Path]):
    """A build that runs out of space removes the embedding caches it wrote: they hold the space, and a
    rerun cannot get past the full disk without it (a killed build keeps them, to resume). A failure
    after the caches were complete needed their bytes too: they are added to DiskFull.needed."""
    try:
        yield
    except DiskFull as err:
        caches = [Path(c) for c in caches if Path(c).is_dir()]
        inside = err.filename is not None and any(c in Path(err.filename).parents for c in caches)
        held = sum(p.stat().st_blocks * 512 for c in caches for p in c.rglob("*") if p.is_file())
        if err.needed is not None and not inside:
            err.needed += held
        for cache in caches:
            shutil.rmtree(cache, ignore_errors=True)
            logger.info("disk full: removed the embedding cache %s", cache)
        raise


def _tune(index: faiss.Index, kind: str, embeddings: np.ndarray, target_recall: float, seed: int = 0) -> dict:
    """Tune the search knob on a sample of stored rows used as queries; returns the recall record."""
    if kinds.get(kind).exact:
        return {"k": TUNE_K, "recall": 1.0, "exact": True, "target": target_recall}
    n = embeddings.shape[0]
    k = min(TUNE_K, n - 1)
    if k < 1:
        return faiss_index.single_item_recall(target_recall)
    rows = faiss_index.tuning_rows(n, TUNE_QUERIES, seed)
    queries = embeddings[rows]
    # exact reference (FAISS brute force, BLAS-fast at 1e6 rows); k+1 because each query's own row is
    # dropped (it would be a free hit)
    exact = faiss_index.exact_neighbours(embeddings, queries, k + 1)
    # served recall: PQ candidates are re-ranked exactly from the stored rows, so tune (nprobe, k'/k) on that
    result = faiss_index.tune(
        index,
        queries,
        exact,
        target_recall=target_recall,
        k=k,
        kind=kind,
        self_rows=rows,
        embeddings=embeddings,
    )
    return result.recall_record(k, target_recall, len(rows))


def write_version(
    store: IndexStore,
    embeddings: np.ndarray,
    ids: Sequence[str],
    *,
    kind: str = "flat",
    params: dict | None = None,
    index: faiss.Index | None = None,
    memory_budget: int | None = None,
    target_recall: float = 0.95,
    fields: dict | None = None,
    version: str | None = None,
    timings: dict | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> tuple[str, Path]:
    """Build (or take) the FAISS index, tune it, and write a complete version into staging.

    `embeddings` must be unit rows; `kind="auto"` applies `choose_kind`. Pass a filled `index`
    (with `params`) to skip building (used by `add_items`). `extra_files` ({name: bytes}, e.g.
    item_files.json) are written beside the index and checksummed like it, and so are the bounded
    normaliser's list statistics (`LIST_STATS_FILE`, from 2 rows up), so serving never recomputes
    them. Returns (version, staging dir); nothing is visible in versions/ until `IndexStore.commit`.
    """
    timings = dict(timings or {})
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    if embeddings.ndim != 2 or embeddings.shape[0] == 0:
        raise ValueError(f"need a non-empty (N, D) embedding matrix, got shape {embeddings.shape}")
    ids = [str(i) for i in ids]
    if len(ids) != embeddings.shape[0]:
        raise ValueError(f"{len(ids)} ids for {embeddings.shape[0]} embeddings")
    if len(set(ids)) != len(ids):
        raise ValueError("item ids are not unique")
    norms = np.linalg.norm(embeddings, axis=1)
    if not np.allclose(norms, 1.0, atol=1e-3):
        raise ValueError(f"embeddings must be unit rows (norms range {norms.min():.4f}..{norms.max():.4f})")
    n, dim = embeddings.shape
    params = dict(params or {})
    if kind == "auto":
        kind, auto_params = faiss_index.choose_kind(n, dim, memory_budget)
        params = {**auto_params, **params}
        logger.info("--kind auto chose %s %s for %d x %d", kind, params, n, dim)
    kinds.get(kind)  # refuses an unknown kind
    t0 = time.perf_counter()
    if index is None:
        index, params = faiss_index.build(kind, embeddings, **params)
    timings["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    recall = _tune(index, kind, embeddings, target_recall)
    if recall.get("param"):
        params[recall["param"]] = recall["value"]
    if recall.get("rerank"):
        params["rerank"] = recall["rerank"]
    timings["tune_s"] = time.perf_counter() - t0
    # the bounded normaliser's statistics belong to the artifact (an index version holds what serving
    # it needs); a partition needs 2 rows (the normaliser serves 1 row exactly)
    stats = ListStats.build(embeddings, index, progress=n >= 1 << 20) if n >= 2 else None
    if stats is not None:
        timings["list_stats_s"] = stats.seconds

    t0 = time.perf_counter()
    version = version or new_version_name(salt=f"{n}:{dim}:{kind}")
    staging = store.staging_path(version)
    # roughly what the version takes on disk: embeddings.npy, an index of at most as many bytes (flat; PQ
    # is smaller, HNSW links add ~10 %), the ids, extra files, statistics and the manifest (~ its fields)
    needed = sum(
        map(
            on_disk,
            (
                embeddings.nbytes + 128,
                embeddings.nbytes + 1024,
                sum(len(i) + 4 for i in ids),
                *map(len, (extra_files or {}).values()),
                stats.nbytes + 1024 if stats else 0,
                len(json.dumps(fields or {}, default=str)) + 8192,
            ),
        )
    )
    try:
        with writing(staging / INDEX_FILE, needed):
            faiss.write_index(index, str(staging / INDEX_FILE))
        with writing(staging / EMBEDDINGS_FILE, needed), open(staging / EMBEDDINGS_FILE, "wb") as fh:
            np.save(fh, embeddings, allow_pickle=False)
        with writing(staging / IDS_FILE, needed):
            (staging / IDS_FILE).write_text(json.dumps(ids) + "\n", encoding="utf-8")
        extra_files = dict(extra_files or {})
        for name, data in extra_files.items():
            assert name not in (*VERSION_FILES, LIST_STATS_FILE) and "/" not in name, (
                f"bad extra version file name {name!r}"
            )
            with writing(staging / name, needed):
                (staging / name).write_bytes(data)
        names = [*VERSION_FILES, *extra_files]
        if stats is not None:
            with writing(staging / LIST_STATS_FILE, needed), open(staging / LIST_STATS_FILE, "wb") as fh:
                stats.save(fh)
            names.append(LIST_STATS_FILE)
        with writing(staging, needed):
            for name in names:
                with open(staging / name, "rb") as fh:
                    os.fsync(fh.fileno())
        timings["write_s"] = time.perf_counter() - t0
        extra = dict(fields or {})
        extra.setdefault("recall", recall)
        if stats is not None:
            extra["normaliser_stats"] = {
                "file": LIST_STATS_FILE,
                "partition": stats.source,
                "lists": stats.lists,
                "seconds": stats.seconds,
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
        with writing(staging, needed):
            write_manifest(staging, manifest)
        fsync_dir(staging)
    except BaseException:
        discard_staging(staging)
        raise
    return version, staging


def skipped_items(ds, res: EmbedResult, source: int) -> list[dict]:
    """Every item of a source that is not indexed, once: files the dataset could not decode
    (over a limit, unreadable: ``ds.skipped``, with a ``reason``) and items the embedding skipped."""
    return [{"source": source, **item} for item in [*(getattr(ds, "skipped", None) or []), *res.skipped]]


def embedded_source(ds, res: EmbedResult, source: int) -> dict:
    """The manifest's record of one embedded source (its spec, fingerprint, counts and speed)."""
    return {
        "spec": ds.spec(),
        "fingerprint": ds.fingerprint(),
        "count": int(len(res.rows)),
        "skipped": len(skipped_items(ds, res, source)),
        "source": source,
        "resumed_shards": res.resumed_shards,
        "embed_s": res.seconds,
        "images_per_s": len(res.rows) / res.seconds if res.seconds > 0 else None,
    }


# ----------------------------------------------------------------------------- public API


@dataclasses.dataclass(frozen=True)
class BuildOptions(CommitOptions, EmbedOptions):
    """The knobs of `build_index`, `rebuild_index` and `build_from_vectors`: how to embed (EmbedOptions),
    how to commit (CommitOptions), and what to build."""

    #: FAISS kind (index/kinds/) or "auto" (`choose_kind` under `memory_budget`); None: flat for a build,
    #: the current version's kind for a rebuild
    kind: str | None = None
    params: dict | None = None  # FAISS build parameters (nlist, m, M, ...)
    memory_budget: int | None = None  # bytes, for kind "auto"
    fields: dict | None = None  # extra manifest fields (e.g. search_temperature)
    metadata: Metadata | None = None  # user per-item fields, merged over the built-in ones

    @classmethod
    def combine(cls, embed: EmbedOptions, commit: CommitOptions, **what) -> "BuildOptions":
        """Options from the two records plus what to build (`what`: kind, params, memory_budget, fields,
        metadata)."""
        knobs = {f.name: getattr(o, f.name) for o in (embed, commit) for f in dataclasses.fields(o)}
        return cls(**knobs, **what)

    def check(self) -> None:
        """Both option records' checks, and the kind (an unknown one is refused)."""
        CommitOptions.check(self)
        EmbedOptions.check(self)
        if self.kind is not None and self.kind != "auto":
            kinds.get(self.kind)


def build_index(
    checkpoint, dataset, root, options: BuildOptions | None = None, *, _parent: str | None = None
) -> str:
    """Embed `dataset` (one ImageDataset or a list) with `checkpoint` and write a new version.

    Returns the version name (activated unless `options.activate` is False; QualityGateError when
    the evaluator refuses it). The manifest's ``search_temperature`` is, in order of precedence: one
    given in `options.fields`, the `calibrator`'s held-out optimum, the checkpoint's training
    temperature. `options.metadata` adds user fields to the built-in per-item ones (index/metadata.py).
    Under torchrun every rank embeds its shards; rank 0 builds, and all ranks return the version.
    """
    from training.checkpoint import checkpoint_sha256, load_checkpoint

    t_start = time.perf_counter()
    o = options or BuildOptions()
    kind = o.kind or kinds.DEFAULT
    datasets = _as_list(dataset)
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    o.check()
    store = IndexStore(root)
    with distributed() as (rank, world, dist_device):
        device = default_device(o.device if o.device is not None else dist_device)
        encoder, info = load_checkpoint(checkpoint, device=device)
        for ds in datasets:
            if getattr(ds, "image_size", encoder.image_size) != encoder.image_size:
                raise ValueError(
                    f"dataset image_size {ds.image_size} differs from the encoder's {encoder.image_size}"
                )
        ckpt_sha = checkpoint_sha256(checkpoint)
        records: dict = {}
        item_metadata = Metadata.empty()
        if rank == 0:  # the store keeps its own copy: the training directory may move after the build
            store.models.add_file(checkpoint, ckpt_sha)
            for ds in datasets:  # file states as read, taken before embedding (see index/items.py)
                records.update(dataset_records(ds))
                item_metadata = item_metadata.merge(dataset_metadata(ds))
            if o.metadata is not None:
                item_metadata = item_metadata.merge(o.metadata)
                report_unknown_ids(o.metadata, [i for ds in datasets for i in ds.item_ids()], "--metadata")
        t0 = time.perf_counter()
        embedded = embed_sources(encoder, ckpt_sha, datasets, store, o, device=device, rank=rank, world=world)
        embed_s = time.perf_counter() - t0
        outcome: tuple[str | None, BaseException | None] = (None, None)
        if rank == 0:
            try:
                version = _finish_build(
                    store,
                    checkpoint,
                    ckpt_sha,
                    info,
                    datasets,
                    embedded,
                    dataclasses.replace(o, kind=kind, metadata=item_metadata),
                    embed_s=embed_s,
                    t_start=t_start,
                    world=world,
                    parent=_parent,
                    records=records,
                )
                outcome = (version, None)
            except BaseException as err:  # noqa: BLE001 - re-raised below after telling the other ranks
                outcome = (None, err)
        shared = broadcast((outcome[0], None if outcome[1] is None else repr(outcome[1])))
        if outcome[1] is not None:
            raise outcome[1]
        if shared[1] is not None:
            raise RuntimeError(f"rank 0 failed to build the index: {shared[1]}")
        return shared[0]


def _finish_build(
    store,
    checkpoint,
    ckpt_sha,
    info,
    datasets,
    embedded,
    o: BuildOptions,
    *,
    embed_s,
    t_start,
    world,
    parent,
    records,
) -> str:
    """Rank 0's part of `build_index` once every shard is embedded (`o.metadata`: the merged item
    metadata)."""
    results, caches = embedded
    embeddings, ids, skipped, sources = [], [], [], []
    for s, (ds, res) in enumerate(zip(datasets, results)):
        all_ids = ds.item_ids()
        embeddings.append(res.embeddings)
        ids.extend(all_ids[int(i)] for i in res.rows)
        skipped.extend(skipped_items(ds, res, s))
        sources.append(embedded_source(ds, res, s))
    emb = np.concatenate(embeddings, axis=0)
    if emb.shape[0] == 0:
        raise ValueError(f"no readable items to index ({len(skipped)} skipped)")
    temperature, temp_source = training_temperature(info)
    manifest_fields = {
        "checkpoint": checkpoint_field(store, checkpoint, ckpt_sha, info),
        "encoder": info.get("encoder"),
        "dataset": {"spec": sources[0]["spec"], "fingerprint": sources[0]["fingerprint"]},
        "sources": sources,
        "lineage": dict(info.get("lineage") or {}),
        "search_temperature": temperature,
        "search_temperature_source": temp_source,
        "skipped": skipped,
        "skipped_count": len(skipped),
        "world_size": world,
        "parent": parent,
    }
    manifest_fields.update(o.fields or {})
    timings = {"embed_s": embed_s}
    with released_on_disk_full(caches):
        version, staging = write_version(
            store,
            emb,
            ids,
            kind=o.kind,
            params=o.params,
            memory_budget=o.memory_budget,
            target_recall=o.target_recall,
            fields=manifest_fields,
            timings=timings,
            extra_files=item_files(records, o.metadata, ids),
        )
        version = commit_staged(
            store,
            Staged(version, staging),
            o,
            path="index rebuild" if parent else "index build",
            t_start=t_start,
            model=(ckpt_sha, checkpoint),
        )
    for cache in caches:  # the version now holds the embeddings; the shards are no longer needed
        shutil.rmtree(cache, ignore_errors=True)
    return version


def checkpoint_field(store: IndexStore, checkpoint: Path, sha: str, info: dict) -> dict:
    """The manifest's encoder reference: the model's sha256 and place in the store; `path` is provenance
    only (None for a file inside the store, e.g. a pretrained model saved for this build)."""
    path = Path(checkpoint).resolve()
    inside = store.root.resolve() in path.parents or is_store_model(path)
    return {
        "sha256": sha,
        "model": model_relpath(sha),
        "path": None if inside else str(path),
        "step": info.get("step"),
    }


def rebuild_index(root, checkpoint, options: BuildOptions | None = None) -> str:
    """Re-embed the current version's corpus (its manifest's dataset specs) with a new checkpoint
    (`options.kind` None: the current version's kind; its user metadata fields carry over)."""
    from training.datasets import create_dataset

    store = IndexStore(root)
    current = store.current_version()
    if current is None:
        raise FileNotFoundError(f"no current index version under {root} to rebuild")
    manifest = store.manifest(current)
    require_encoder(manifest, "index rebuild")
    datasets = []
    for src in manifest.sources or []:
        ds = create_dataset(**src["spec"])
        if ds.fingerprint() != src["fingerprint"]:
            logger.warning(
                "dataset %s changed since %s was built (fingerprint differs); indexing it as it is now",
                src["spec"],
                current,
            )
        datasets.append(ds)
    o = options or BuildOptions()
    carried = user_fields(read_metadata(store.path(current)))  # the user's fields survive a rebuild
    metadata = carried.merge(o.metadata) if o.metadata is not None else carried
    return build_index(
        checkpoint,
        datasets,
        root,
        dataclasses.replace(o, kind=o.kind or manifest.kind, metadata=metadata),
        _parent=current,
    )


def add_items(
    root,
    dataset,
    *,
    checkpoint=None,
    base: str | None = None,
    metadata: Metadata | None = None,
    embed: EmbedOptions | None = None,
    commit: CommitOptions | None = None,
) -> str:
    """New version = `base` (default current) + the items of `dataset`, without re-embedding old rows.

    Uses the base's checkpoint (its sha256 must still match; a different `checkpoint` would mix
    embedding spaces, so that needs `rebuild`). Items whose id is already indexed are skipped.
    """
    from training.checkpoint import checkpoint_sha256, load_checkpoint

    t_start = time.perf_counter()
    embed, commit = embed or EmbedOptions(), commit or CommitOptions()
    commit.check()
    embed.check()
    store = IndexStore(root)
    base_version = store.load(base, verify=True, gpu=False)
    require_encoder(base_version.manifest, "index add")
    kind = base_version.kind
    if not kinds.get(kind).addable:
        raise ValueError(f"index kind {kind!r} does not support adding items; run 'index rebuild'")
    recorded = base_version.manifest.checkpoint_record
    if checkpoint is not None:
        sha = checkpoint_sha256(checkpoint)
        if recorded.sha256 and sha != recorded.sha256:
            raise ValueError(
                f"checkpoint {checkpoint} (sha256 {sha[:12]}) is not the one {base_version.version} was "
                f"built with ({recorded.sha256[:12]}); use 'index rebuild' to change the encoder"
            )
        store.models.add_file(checkpoint, sha)
    ckpt = store.models.resolve(recorded, base_version.version)  # the store's own copy of the weights
    sha = recorded.sha256
    ds = _as_list(dataset)[0]
    known = set(base_version.ids)
    new_ids = ds.item_ids()
    todo = np.array([i for i, item in enumerate(new_ids) if item not in known], dtype=np.int64)
    duplicates = len(new_ids) - len(todo)
    if len(todo) == 0:
        raise ValueError(f"all {len(new_ids)} items of {ds!r} are already in {base_version.version}")
    records = {**read_records(base_version.path), **dataset_records(ds, todo)}
    item_metadata = read_metadata(base_version.path).merge(dataset_metadata(ds, todo))
    if metadata is not None:
        item_metadata = item_metadata.merge(metadata)
        report_unknown_ids(metadata, list(base_version.ids) + new_ids, "--metadata")
    device = default_device(embed.device)
    encoder, info = load_checkpoint(ckpt, device=device)
    if encoder.embed_dim != base_version.dim:
        raise ValueError(f"checkpoint embeds to {encoder.embed_dim} dims, index has {base_version.dim}")
    t0 = time.perf_counter()
    results, caches = embed_sources(encoder, sha, [ds], store, embed, indices=[todo], device=device)
    res = results[0]
    embed_s = time.perf_counter() - t0
    if len(res.rows) == 0:
        raise ValueError(f"none of the {len(todo)} new items could be read ({len(res.skipped)} skipped)")
    # Always extend a fresh CPU copy from disk: the loaded one may live on a GPU.
    index = faiss_index.lists_in_ram(faiss_index.read_index(base_version.path / INDEX_FILE))
    base_train = base_version.manifest.trained_on or base_version.manifest.count
    index.add(res.embeddings)
    if kinds.get(kind).trained and index.ntotal > 2 * base_train:
        logger.warning(
            "%s: %d rows now vs %d the quantizer was trained on; consider 'index rebuild'",
            kind,
            index.ntotal,
            base_train,
        )
    embeddings = np.concatenate([base_version.embeddings, res.embeddings], axis=0)
    ids = list(base_version.ids) + [new_ids[int(i)] for i in res.rows]
    m = base_version.manifest
    sources = list(m.sources or [])
    source_index = len(sources)
    sources = sources + [embedded_source(ds, res, source_index)]
    skipped = list(m.skipped or []) + skipped_items(ds, res, source_index)
    fields = m.carried(
        "checkpoint",
        "encoder",
        "dataset",
        "lineage",
        "search_temperature",
        "search_temperature_source",
        "world_size",
        "text",
    )  # text: the calibrated text temperature
    fields.update(
        sources=sources,
        skipped=skipped,
        skipped_count=len(skipped),
        parent=base_version.version,
        trained_on=base_train,
        added={
            "count": int(len(res.rows)),
            "duplicates": duplicates,
            "skipped": len(skipped_items(ds, res, source_index)),
        },
    )
    params = dict(m.params)
    with released_on_disk_full(caches):
        version, staging = write_version(
            store,
            embeddings,
            ids,
            kind=kind,
            params=params,
            index=index,
            target_recall=commit.target_recall,
            fields=fields,
            timings={"embed_s": embed_s},
            extra_files=item_files(records, item_metadata, ids),
        )
        version = commit_staged(
            store, Staged(version, staging), commit, path="index add", t_start=t_start, model=(sha, ckpt)
        )
    for cache in caches:
        shutil.rmtree(cache, ignore_errors=True)
    return version


def require_encoder(manifest: Manifest, command: str) -> None:
    """A command that embeds images (add, rebuild, sync) refuses a version built from vectors, in one line."""
    if not manifest.has_encoder:
        raise ValueError(
            f"index version {manifest.version} was built from vectors (--embeddings) and has no "
            f"encoder: '{command}' cannot embed images for it; build a new version with "
            "'index build --embeddings' over all the vectors"
        )


def build_from_vectors(
    embeddings, root, options: BuildOptions | None = None, *, ids=None, stream: bool | None = None
) -> str:
    """A new version from vectors computed elsewhere: `embeddings` is a `.npy` file or a directory of `.npy`
    shards (index/vectors.py), `ids` an ids file (one per line; default: the row number as a string).

    The version has no encoder (manifest ``checkpoint`` and ``encoder`` null, ``source`` naming the
    vectors and their sha256): it serves vector queries only. Its quality gate is the recall check on
    held-out stored rows (index/gate.py). IVF kinds (given, or chosen by ``auto``) are built streaming
    (index/stream.py: trained on a sample, lists on disk, RAM independent of N) unless `stream` is False.
    `options`: kind (default flat), params, memory_budget, fields, metadata, progress and the commit knobs
    (nothing is embedded: the embedding knobs are unused). Returns the version name (activated unless
    `options.activate` is False)."""
    from index import stream as streaming
    from index.vectors import default_ids, open_vectors, read_ids, source_record, unit_rows

    t_start = time.perf_counter()
    o = options or BuildOptions()
    o.check()
    kind, metadata, progress = o.kind or kinds.DEFAULT, o.metadata, o.progress
    source = open_vectors(embeddings)
    params = dict(o.params or {})
    if kind == "auto":
        kind, auto_params = faiss_index.choose_kind(source.count, source.dim, o.memory_budget)
        params = {**auto_params, **params}
        logger.info("--kind auto chose %s %s for %d x %d", kind, params, source.count, source.dim)
    streamable = kinds.get(kind).streamable
    streamed = streamable if stream is None else bool(stream)
    if streamed and not streamable:
        raise ValueError(f"a streamed build makes {' or '.join(streaming.stream_kinds())}, not {kind}")
    # row-number ids of a streamed build are never held as N strings (written to ids.json in blocks)
    item_ids = (
        (None if streamed else default_ids(source.count)) if ids is None else read_ids(ids, source.count)
    )
    item_metadata = Metadata.empty()
    if metadata is not None:
        item_metadata = metadata
        item_ids = default_ids(source.count) if item_ids is None else item_ids  # metadata is per id anyway
        report_unknown_ids(metadata, item_ids, "--metadata")
    if streamed:
        record = source_record(source, ids)
        store = IndexStore(root)
        store.ensure()
        version, staging, candidate = streaming.write_streamed_version(
            store,
            source,
            item_ids,
            kind=kind,
            params=params,
            target_recall=o.target_recall,
            fields=_vector_fields(record, o.fields),
            timings={},
            extra_files=item_files({}, item_metadata, item_ids) if metadata is not None else None,
            progress=progress,
        )
        return commit_staged(
            store, Staged(version, staging, candidate), o, path="index build --embeddings", t_start=t_start
        )
    t0 = time.perf_counter()
    emb = unit_rows(source, progress=progress)
    record = source_record(source, ids)
    load_s = time.perf_counter() - t0
    store = IndexStore(root)
    store.ensure()
    version, staging = write_version(
        store,
        emb,
        item_ids,
        kind=kind,
        params=params,
        memory_budget=o.memory_budget,
        target_recall=o.target_recall,
        fields=_vector_fields(record, o.fields),
        timings={"load_vectors_s": load_s},
        extra_files=item_files({}, item_metadata, item_ids),
    )
    return commit_staged(store, Staged(version, staging), o, path="index build --embeddings", t_start=t_start)


def _vector_fields(record: dict, fields: dict | None) -> dict:
    """The manifest fields of a version built from vectors: no encoder, the vectors' `record` as its
    source."""
    out = {
        "checkpoint": None,
        "encoder": None,
        "dataset": None,
        "sources": [],
        "source": record,
        "lineage": {},
        "search_temperature": DEFAULT_TEMPERATURE,
        "search_temperature_source": "default (vectors computed elsewhere record no temperature)",
        "skipped": [],
        "skipped_count": 0,
        "world_size": 1,
        "parent": None,
    }
    out.update(fields or {})
    return out


def add_vectors(
    root,
    embeddings,
    *,
    ids=None,
    base: str | None = None,
    metadata: Metadata | None = None,
    progress: bool = True,
    commit: CommitOptions | None = None,
) -> str:
    """New version = `base` (default current, a version built from vectors) + the rows of `embeddings`
    (a .npy file or a directory of shards), added to a copy of its FAISS index without retraining.

    New ids come from `ids` (one per new row) or continue the row numbers (row i of the new version has
    id str(i)); an id already indexed is refused. Metadata of the base is kept and `metadata` merged in."""
    from index.vectors import open_vectors, read_ids, source_record, unit_rows

    t_start = time.perf_counter()
    commit = commit or CommitOptions()
    commit.check()
    store = IndexStore(root)
    base_version = store.load(base, verify=True, gpu=False)
    m = base_version.manifest
    if m.has_encoder:
        raise ValueError(
            f"index version {base_version.version} has an encoder: add images to it ('index add "
            "--dataset ...'); vectors from elsewhere would mix embedding spaces"
        )
    if not kinds.get(base_version.kind).addable:
        raise ValueError(
            f"index kind {base_version.kind!r} does not support adding items; build a new version"
        )
    source = open_vectors(embeddings)
    if source.dim != base_version.dim:
        raise ValueError(
            f"--embeddings {embeddings} has dimension {source.dim}, index version "
            f"{base_version.version} has {base_version.dim}"
        )
    n0 = len(base_version)
    new_ids = [str(n0 + i) for i in range(source.count)] if ids is None else read_ids(ids, source.count)
    known = set(base_version.ids)
    clash = next((i for i in new_ids if i in known), None)
    if clash is not None:
        raise ValueError(
            f"id {clash!r} is already in {base_version.version}"
            + (
                ""
                if ids is not None
                else " (the row-number ids of the new rows collide with its ids: give --ids)"
            )
        )
    t0 = time.perf_counter()
    new = unit_rows(source, progress=progress)
    record = source_record(source, ids)
    load_s = time.perf_counter() - t0
    # a fresh CPU copy, extended below (on-disk lists of a streamed build copied into RAM: the new version
    # is written by write_version, which holds all rows anyway)
    index = faiss_index.lists_in_ram(faiss_index.read_index(base_version.path / INDEX_FILE))
    base_train = m.trained_on or m.count
    index.add(new)
    if kinds.get(base_version.kind).trained and index.ntotal > 2 * base_train:
        logger.warning(
            "%s: %d rows now vs %d the quantizer was trained on; consider building a new version",
            base_version.kind,
            index.ntotal,
            base_train,
        )
    emb = np.concatenate([np.asarray(base_version.embeddings), new], axis=0)
    item_ids = list(base_version.ids) + new_ids
    item_metadata = read_metadata(base_version.path)
    if metadata is not None:
        item_metadata = item_metadata.merge(metadata)
        report_unknown_ids(metadata, item_ids, "--metadata")
    fields = m.carried(
        "checkpoint",
        "encoder",
        "dataset",
        "sources",
        "source",
        "lineage",
        "search_temperature",
        "search_temperature_source",
        "skipped",
        "skipped_count",
        "world_size",
    )
    fields.update(
        parent=base_version.version,
        trained_on=base_train,
        added={"count": int(source.count), "source": record},
        added_sources=[*(m.added_sources or []), record],
    )
    store.ensure()
    version, staging = write_version(
        store,
        emb,
        item_ids,
        kind=base_version.kind,
        params=dict(m.params),
        index=index,
        target_recall=commit.target_recall,
        fields=fields,
        timings={"load_vectors_s": load_s},
        extra_files=item_files({}, item_metadata, item_ids),
    )
    return commit_staged(
        store, Staged(version, staging), commit, path="index add --embeddings", t_start=t_start
    )
