"""`index build --engine ray --shards N`: a sharded version embedded and built on a Ray cluster.

Each shard is one Ray task (`_build_shard`, placed by Ray on any node that reads the store): it decodes and
embeds its contiguous range of items as a Ray Data pipeline, `map_batches` over an actor pool of `Embedder`s
(each actor loads the encoder once), writes the rows into the shard's embeddings file as they arrive, then
builds the shard's version directory: streamed (index/stream.py: rows read from disk in chunks) for the IVF
kinds, `index.build.write_version` for the others. The driver then writes the top-level manifest, measures the
merged recall, calibrates, gates and activates the ONE version as `index build --shards N` does; the rows
equal the single-process build's (the same encoder forward on the same decoded items).

Every node must read and write the store at the same path (a shared filesystem), as for `serve --engine ray`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np

from index import kinds
from index.build import BuildOptions, checkpoint_field, training_temperature, write_version
from index.commit import Staged, discard_staging
from index.commit import commit as commit_staged
from index.items import dataset_records
from index.manifest import (
    MANIFEST_NAME,
    create_manifest,
    describe_files,
    fsync_dir,
    read_manifest,
    update_manifest,
    write_manifest,
)
from index.metadata import dataset_metadata, item_files, report_unknown_ids
from index.shards import ShardedVersion, flat_view, merged_recall, shard_name, split_rows
from index.store import IndexStore, new_version_name

logger = logging.getLogger(__name__)

#: the scratch file a shard task fills with its rows (in item order) before building
SCRATCH_ROWS = "rows.tmp.npy"


class Embedder:
    """A Ray Data actor: decodes a batch of item numbers of the dataset `spec` and embeds them with the
    encoder of `checkpoint` (loaded once per actor). Output columns: row (item number), embedding (unit
    float32 rows; zeros where the item failed), error ("" for a good item)."""

    def __init__(self, checkpoint: str, spec: dict, device: str = "cpu", threads: int = 1):
        import torch

        from index.embed import SafeItems
        from training.checkpoint import load_checkpoint
        from training.datasets import create_dataset

        torch.set_num_threads(max(1, int(threads)))
        self.device = torch.device(device)
        self.encoder, _ = load_checkpoint(checkpoint, device=self.device)
        self.encoder.eval()
        self.dataset = create_dataset(**spec)
        self.items = SafeItems(
            self.dataset, np.arange(len(self.dataset), dtype=np.int64), self.encoder.image_size
        )

    def __call__(self, batch: dict) -> dict:
        import torch

        idx = np.asarray(batch["data"], dtype=np.int64)
        _, tensors, errors = self.items.__getitems__(idx.tolist())
        ok = np.array([not e for e in errors], dtype=bool)
        z = np.zeros((len(idx), self.encoder.embed_dim), np.float32)
        if tensors is not None:
            x = tensors.to(self.device)
            if getattr(self.encoder, "prefers_channels_last", False):
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.inference_mode():
                zg = self.encoder(x).float().cpu().numpy()
            zg /= np.linalg.norm(zg, axis=1, keepdims=True)  # exact unit rows in float32, as embed_shards
            z[ok] = zg
            bad = ok & ~np.isfinite(z).all(axis=1)
            for i in np.flatnonzero(bad):
                ok[i] = False
                errors[i] = "ValueError: non-finite embedding (NaN or inf in the image tensor)"
            z[~ok] = 0.0
        return {"row": idx, "embedding": z, "error": np.asarray(errors, dtype=object)}


def _build_shard(
    root: str,
    version: str,
    position: int,
    start: int,
    stop: int,
    *,
    checkpoint: str,
    spec: dict,
    ids: list[str],
    kind: str,
    params: dict | None,
    target_recall: float,
    fields: dict,
    extra_files: dict | None,
    actors: int,
    actor_cpus: float,
    batch_size: int,
) -> dict:
    """One shard as a Ray task: embed items start..stop-1 (Ray Data over an actor pool), build its version
    directory into the staging of `version` -> its entry (name, count, rows kept, skipped items, timings)."""
    import ray

    from index.stream import write_streamed_version
    from index.vectors import open_vectors

    store = IndexStore(root)
    name = shard_name(position)
    staging = store.staging_path(version)
    scratch_dir = store.staging_path(f"{version}.{name}.rows")
    scratch_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n = stop - start
    dim = None
    rows = errors = None
    out = None
    ray.data.DataContext.get_current().enable_progress_bars = False
    # the item numbers as in-memory blocks (no read tasks to schedule beside the actors), a block a batch
    blocks = [np.arange(a, min(a + batch_size, stop), dtype=np.int64) for a in range(start, stop, batch_size)]
    pipeline = ray.data.from_numpy(blocks).map_batches(
        Embedder,
        fn_constructor_kwargs={"checkpoint": checkpoint, "spec": spec},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=actor_cpus,
        batch_format="numpy",
    )
    try:
        for batch in pipeline.iter_batches(batch_size=None, batch_format="numpy"):
            emb = np.asarray(batch["embedding"], dtype=np.float32)
            if out is None:
                dim = emb.shape[1]
                out = np.lib.format.open_memmap(
                    scratch_dir / SCRATCH_ROWS, mode="w+", dtype=np.float32, shape=(n, dim)
                )
                errors = [""] * n
                rows = np.zeros(n, dtype=bool)
            local = np.asarray(batch["row"], dtype=np.int64) - start
            out[local] = emb  # by item number: batch order does not matter
            rows[local] = True
            for i, e in zip(local.tolist(), batch["error"].tolist()):
                errors[i] = e
        if rows is None or not rows.all():
            raise RuntimeError(
                f"{name}: the embedding pipeline returned {0 if rows is None else int(rows.sum())} "
                f"of {n} items"
            )
        out.flush()
        embed_s = time.perf_counter() - t0
        keep = np.array([not e for e in errors], dtype=bool)
        skipped = [
            {"index": start + i, "id": ids[i], "error": errors[i]} for i in np.flatnonzero(~keep).tolist()
        ]
        kept_ids = [ids[i] for i in np.flatnonzero(keep).tolist()]
        if not kept_ids:
            raise ValueError(f"{name}: no readable items to index ({len(skipped)} skipped)")
        if not keep.all():  # compact the good rows into the file the build reads
            good = np.lib.format.open_memmap(
                scratch_dir / "kept.npy", mode="w+", dtype=np.float32, shape=(len(kept_ids), dim)
            )
            good[:] = out[keep]
            good.flush()
            del good
            os.replace(scratch_dir / "kept.npy", scratch_dir / SCRATCH_ROWS)
        del out
        files = item_files(**extra_files, ids=kept_ids) if extra_files else None
        t1 = time.perf_counter()
        if kinds.get(kind).streamable:
            _, shard_staging, _ = write_streamed_version(
                store,
                open_vectors(scratch_dir / SCRATCH_ROWS),
                kept_ids,
                kind=kind,
                params=params,
                target_recall=target_recall,
                fields=fields,
                timings={"embed_s": embed_s},
                extra_files=files,
                version=f"{version}.{name}",
            )
        else:
            rows_on_disk = np.load(scratch_dir / SCRATCH_ROWS, mmap_mode="r", allow_pickle=False)
            _, shard_staging = write_version(
                store,
                rows_on_disk,
                kept_ids,
                kind=kind,
                params=dict(params or {}),
                target_recall=target_recall,
                fields=fields,
                version=f"{version}.{name}",
                timings={"embed_s": embed_s},
                extra_files=files,
            )
            del rows_on_disk
        os.rename(shard_staging, staging / name)
        return {
            "name": name,
            "count": len(kept_ids),
            "skipped": skipped,
            "embed_s": embed_s,
            "build_s": time.perf_counter() - t1,
            "node": ray.get_runtime_context().get_node_id(),
        }
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)


def build_on_ray(
    checkpoint,
    dataset,
    root,
    shards: int,
    options: BuildOptions | None = None,
    *,
    address: str | None = None,
    actors: int = 1,
    actor_cpus: float = 1.0,
) -> str:
    """Embed `dataset` with `checkpoint` and write ONE sharded version of `shards` shards, each shard embedded
    and built by a Ray task (`_build_shard`), then calibrated, gated and activated as
    `index build --shards N`. `actors` Embedder actors (of `actor_cpus` CPUs each) per shard; `address` None:
    the running Ray, else ray.init(address) (a local Ray when none runs). Returns the version name."""
    import ray

    from training.checkpoint import checkpoint_sha256, load_checkpoint

    t_start = time.perf_counter()
    o = options or BuildOptions()
    kind = o.kind or kinds.DEFAULT
    if kind == "auto":
        raise ValueError(
            "--engine ray needs a named --kind (auto chooses from the whole count; name the shards' kind)"
        )
    kinds.get(kind)
    if isinstance(actors, bool) or not isinstance(actors, int) or actors < 1:
        raise ValueError(f"--ray-actors must be an integer >= 1, got {actors!r}")
    if not actor_cpus > 0:
        raise ValueError(f"--ray-actor-cpus must be > 0, got {actor_cpus}")
    checkpoint = Path(checkpoint).resolve()
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    n = len(dataset)
    ranges = split_rows(n, shards)
    encoder, info = load_checkpoint(checkpoint, device="cpu")
    if getattr(dataset, "image_size", encoder.image_size) != encoder.image_size:
        raise ValueError(
            f"dataset image_size {dataset.image_size} differs from the encoder's {encoder.image_size}"
        )
    del encoder
    store = IndexStore(root)
    store.ensure()
    ckpt_sha = checkpoint_sha256(checkpoint)
    store.models.add_file(checkpoint, ckpt_sha)
    records = dataset_records(dataset)
    metadata = dataset_metadata(dataset)
    ids = [str(i) for i in dataset.item_ids()]
    if o.metadata is not None:
        metadata = metadata.merge(o.metadata)
        report_unknown_ids(o.metadata, ids, "--metadata")
    spec = dataset.spec()
    temperature, temp_source = training_temperature(info)
    version = new_version_name(salt=f"{n}:{kind}:ray:shards{shards}")
    staging = store.staging_path(version)
    started = False
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        staging.mkdir(parents=True, exist_ok=True)
        shared = {
            "checkpoint": checkpoint_field(store, checkpoint, ckpt_sha, info),
            "encoder": info.get("encoder"),
            "dataset": {"spec": spec, "fingerprint": dataset.fingerprint()},
            "lineage": dict(info.get("lineage") or {}),
            "search_temperature": temperature,
            "search_temperature_source": temp_source,
            **(o.fields or {}),
        }
        task = ray.remote(num_cpus=0)(_build_shard)
        t0 = time.perf_counter()
        refs = [
            task.remote(
                str(store.root),
                version,
                s,
                a,
                b,
                checkpoint=str(checkpoint),
                spec=spec,
                ids=ids[a:b],
                kind=kind,
                params=o.params,
                target_recall=o.target_recall,
                fields={
                    **shared,
                    "parent": None,
                    "shard": {"name": shard_name(s), "of": version, "offset": None, "shards": shards},
                },
                extra_files={"records": records, "metadata": metadata}
                if (records or metadata.types)
                else None,
                actors=actors,
                actor_cpus=actor_cpus,
                batch_size=o.batch_size,
            )
            for s, (a, b) in enumerate(ranges)
        ]
        done = ray.get(refs)
        ray_s = time.perf_counter() - t0
        entries, files, offset, skipped = [], {}, 0, []
        for d in done:
            shard_manifest = read_manifest(staging / d["name"])
            update_manifest(
                staging / d["name"], shard={**shard_manifest.to_json()["shard"], "offset": offset}
            )
            shard_manifest = read_manifest(staging / d["name"])
            listed = {**shard_manifest.files, **describe_files(staging / d["name"], [MANIFEST_NAME])}
            files.update({f"{d['name']}/{fname}": info_ for fname, info_ in listed.items()})
            entries.append(
                {
                    "name": d["name"],
                    "count": d["count"],
                    "offset": offset,
                    "kind": shard_manifest.kind,
                    "params": shard_manifest.params,
                    "recall": shard_manifest.recall.recall if shard_manifest.recall else None,
                }
            )
            skipped.extend(d["skipped"])
            offset += d["count"]
        loaded = ShardedVersion.load(
            staging, _provisional(version, entries, offset, shard_manifest), verify=False, gpu=False
        )
        recall = merged_recall(loaded, loaded.shards, loaded.offsets, o.target_recall)
        embed_s = max(d["embed_s"] for d in done)
        timings = {
            "embed_s": embed_s,
            "ray_s": ray_s,
            **{f"{d['name']}_embed_s": d["embed_s"] for d in done},
            **{f"{d['name']}_build_s": d["build_s"] for d in done},
        }
        source = {
            "spec": spec,
            "fingerprint": dataset.fingerprint(),
            "count": offset,
            "skipped": len(skipped),
            "source": 0,
            "resumed_shards": 0,
            "embed_s": embed_s,
            "images_per_s": offset / embed_s if embed_s > 0 else None,
        }
        manifest = create_manifest(
            version=version,
            count=offset,
            dim=shard_manifest.dim,
            kind=kind,
            params={k: v for k, v in (o.params or {}).items()},
            faiss_version=shard_manifest.faiss_version,
            files=files,
            timings=timings,
            **shared,
            sources=[source],
            skipped=skipped,
            skipped_count=len(skipped),
            parent=None,
            recall=recall,
            shards=entries,
            build={
                "engine": "ray",
                "shards": shards,
                "actors_per_shard": actors,
                "nodes": sorted({d["node"] for d in done}),
            },
        )
        write_manifest(staging, manifest)
        fsync_dir(staging)
        loaded = ShardedVersion.load(staging, verify=False, gpu=False)
        # the gate and calibration read the rows as one version, as for a reshard
        candidate = flat_view(loaded)
        loaded = None
        candidate.manifest = read_manifest(staging)
    except BaseException:
        discard_staging(staging)
        raise
    finally:
        if started:
            ray.shutdown()
    version = commit_staged(
        store,
        Staged(version, staging, candidate),
        o,
        path="index build",
        t_start=t_start,
        model=(ckpt_sha, checkpoint),
    )
    logger.info(
        "built %s on Ray: %d items in %d shards (%.1f s)",
        version,
        offset,
        shards,
        time.perf_counter() - t_start,
    )
    return version


def _provisional(version: str, entries: list, count: int, like):
    """The top-level manifest's fields ShardedVersion.load reads, before the recall that needs it is known."""
    return create_manifest(
        version=version,
        count=count,
        dim=like.dim,
        kind=like.kind,
        params={},
        faiss_version=like.faiss_version,
        files={},
        shards=entries,
    )
