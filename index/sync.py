"""Keep an index version in step with a changing image folder (`sync`), and drop items (`delete`).

`sync_index` makes a new version equal to the folder's current contents, re-embedding only what
changed. Against the base version's `item_files.json` (index/items.py) every current file is

    added      id not in the base                                -> embedded
    retried    id the base had skipped (unreadable then)         -> embedded (skipped again if still bad)
    unchanged  same size and mtime as recorded                   -> row reused, file not read
    touched    size/mtime differ but the sha256 is the recorded one -> row reused
    modified   the sha256 differs (or the base has no record)    -> re-embedded
    removed    base id no longer in the folder                   -> dropped

Rows come out in the folder's order, so the version equals a from-scratch build of the same
folder with the same encoder (reused rows are the base's bytes). Item ids (folder-relative
paths) are stable across versions. The FAISS index is rebuilt from the rows with the base's
kind and parameters (search knob re-tuned), the search temperature recalibrated, and the
version goes through the quality gate and activation like any build.

`delete_items` makes a new version without the given ids (nothing is re-embedded).

Quality gate: the serving version's own items may be gone from disk (that is why one syncs), so
it cannot always be rebuilt for scoring. When scoring it fails and it uses the candidate's
encoder, it is scored by its settings (encoder, search temperature) on the candidate's items.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from index.build import (
    embed_sources,
    embedded_source,
    released_on_disk_full,
    require_encoder,
    skipped_items,
    write_version,
)
from index.commit import Staged, discard_staging
from index.commit import commit as commit_staged
from index.embed import EmbedResult
from index.items import dataset_records, file_record, read_id_lines, read_records
from index.metadata import Metadata, dataset_metadata, item_files, read_metadata, report_unknown_ids
from index.models import model_relpath
from index.options import CommitOptions, EmbedOptions, Evaluator
from index.store import IndexStore, IndexVersion
from training.distributed import default_device

logger = logging.getLogger(__name__)


@dataclass
class SyncPlan:
    """What a sync does with each current file (dataset indices) and each base id."""

    added: list[int] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
    modified: list[int] = field(default_factory=list)
    touched: list[int] = field(default_factory=list)
    unchanged: list[int] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unrecorded: int = 0  # base items without a file record (counted in `modified`)
    records: dict = field(default_factory=dict)  # id -> [size, mtime_ns, sha256] for every current file
    # files the dataset could not decode (over a limit, unreadable: never items) -> the category
    # they would have had ("added", "retried" or "modified"); they end up skipped
    undecodable: dict = field(default_factory=dict)

    @property
    def to_embed(self) -> np.ndarray:
        return np.array(sorted(self.added + self.retried + self.modified), dtype=np.int64)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.retried or self.modified or self.removed or self.undecodable)

    def counts(self) -> dict:
        bad = Counter(self.undecodable.values())
        return {
            "added": len(self.added) + bad["added"],
            "removed": len(self.removed),
            "modified": len(self.modified) + bad["modified"],
            "retried": len(self.retried) + bad["retried"],
            "touched": len(self.touched),
            "unchanged": len(self.unchanged),
            "unrecorded": self.unrecorded,
        }


def plan_sync(base: IndexVersion, dataset) -> SyncPlan:
    """Classify the dataset's files against the base version (stat first; hash only what stat flags)."""
    recorded = read_records(base.path)
    in_base = set(base.ids)
    skipped = {str(s.get("id")) for s in base.manifest.skipped or []}
    plan = SyncPlan()
    now = dataset.item_ids()
    for i, item in enumerate(now):
        path = dataset.path(i)
        if item not in in_base:
            (plan.retried if item in skipped else plan.added).append(i)
            continue
        rec = recorded.get(item)
        try:
            st = path.stat()
        except OSError:
            plan.modified.append(i)  # vanished between listing and stat: embedding will skip and report it
            continue
        if rec is not None and rec[0] == st.st_size and rec[1] == st.st_mtime_ns:
            plan.unchanged.append(i)
            plan.records[item] = rec
            continue
        current = file_record(path)
        if rec is not None and current is not None and current[2] == rec[2]:
            plan.touched.append(i)
            plan.records[item] = current
            continue
        plan.unrecorded += rec is None
        plan.modified.append(i)
    for bad in getattr(dataset, "skipped", None) or []:
        item = str(bad["id"])
        plan.undecodable[item] = "modified" if item in in_base else "retried" if item in skipped else "added"
    present = set(now) | set(plan.undecodable)
    plan.removed = [item for item in base.ids if item not in present]
    return plan


def _folder_dataset(base: IndexVersion, data_root):
    from training.datasets import create_dataset

    sources = base.manifest.sources or []
    folders = [s for s in sources if (s.get("spec") or {}).get("name") == "folder"]
    if not folders:
        raise ValueError(
            f"index version {base.version} was not built from an image folder "
            f"({', '.join(str(s['spec'].get('name')) for s in sources)}); sync follows folder datasets"
        )
    if len(sources) > 1:
        logger.warning(
            "index version %s has %d sources; the synced version holds the folder's files only",
            base.version,
            len(sources),
        )
    spec = dict(folders[0]["spec"], size=None)
    if data_root is not None:
        spec["root"] = str(Path(data_root).expanduser().resolve())
    return create_dataset(**spec)


def _base_fields(
    base: IndexVersion, keys=("encoder", "lineage", "search_temperature", "search_temperature_source", "text")
) -> dict:
    m = base.manifest
    if not m.has_encoder:  # built from vectors: no model to name; its source record carries over
        return {"checkpoint": None, **m.carried(*keys, "source", "added_sources")}
    record = m.checkpoint_record
    if "model" not in record.key_order:  # recorded before models lived in the store: name its place there
        record = dataclasses.replace(record, model=model_relpath(record.sha256))
    return {"checkpoint": record.to_json(), **m.carried(*keys)}


def _rebuild_params(base: IndexVersion, count: int) -> dict:
    """The base's build parameters, with nlist capped for a collection that shrank."""
    params = dict(base.manifest.params)
    if "nlist" in params:
        params["nlist"] = min(int(params["nlist"]), max(1, count))
        if "nprobe" in params:
            params["nprobe"] = min(int(params["nprobe"]), params["nlist"])
    return params


def same_model_gate(evaluator: Evaluator | None, sha: str) -> Evaluator | None:
    """The evaluator, falling back to scoring the serving version's settings on the candidate's items
    when the serving version's own items can no longer be read (see the module docstring)."""
    if evaluator is None:
        return None

    def gate(candidate: IndexVersion, serving: IndexVersion) -> dict:
        try:
            return evaluator(candidate, serving)
        except (ValueError, FileNotFoundError) as err:
            if serving.manifest.checkpoint_record.sha256 != sha:
                raise
            logger.info(
                "serving version %s cannot be scored on its own items (%s); scoring its encoder and "
                "temperature on the candidate's items",
                serving.version,
                err,
            )
            manifest = candidate.manifest.updated(
                version=serving.version, search_temperature=serving.manifest.search_temperature
            )
            view = IndexVersion(serving.path, manifest, candidate.index, candidate.ids, candidate.embeddings)
            result = dict(evaluator(candidate, view))
            result["serving_scored_on"] = f"the candidate's items (its own are gone: {err})"
            return result

    return gate


def sync_index(
    root,
    data_root=None,
    *,
    base: str | None = None,
    metadata: Metadata | None = None,
    embed: EmbedOptions | None = None,
    commit: CommitOptions | None = None,
) -> tuple[str, dict]:
    """New version = the folder's current contents (see the module docstring) -> (version, counts).

    `metadata` adds or updates user fields (a new version is written for it even when no file changed).

    `data_root` defaults to the folder the base was built from. When nothing was added, removed
    or modified the base version is returned unchanged (counts say so) and nothing is written.
    """
    t_start = time.perf_counter()
    embed, commit = embed or EmbedOptions(), commit or CommitOptions()
    commit.check()
    embed.check()
    store = IndexStore(root)
    base_version = store.load(base, verify=True, gpu=False)
    require_encoder(base_version.manifest, "index sync")
    dataset = _folder_dataset(base_version, data_root)
    plan = plan_sync(base_version, dataset)
    counts = {**plan.counts(), "base": base_version.version, "data_root": dataset.root}
    if not plan.changed and metadata is None:
        logger.info(
            "%s is in step with %s (%d unchanged, %d touched)",
            base_version.version,
            dataset.root,
            len(plan.unchanged),
            len(plan.touched),
        )
        return base_version.version, {**counts, "embedded": 0, "skipped": 0, "count": len(base_version)}
    todo = plan.to_embed
    plan.records.update(dataset_records(dataset, todo))  # the states of the files about to be embedded
    item_metadata = read_metadata(base_version.path).merge(dataset_metadata(dataset, todo))
    if metadata is not None:
        item_metadata = item_metadata.merge(metadata)
        report_unknown_ids(metadata, dataset.item_ids(), "--metadata")
    record = base_version.manifest.checkpoint_record
    device = default_device(embed.device)
    encoder, _, sha = store.models.load_encoder(record, device=device, version=base_version.version)
    if encoder.image_size != dataset.image_size:
        raise ValueError(
            f"folder dataset image_size {dataset.image_size} differs from the encoder's {encoder.image_size}"
        )
    t0 = time.perf_counter()
    if len(todo):
        (res,), caches = embed_sources(encoder, sha, [dataset], store, embed, indices=[todo], device=device)
    else:
        res, caches = EmbedResult(np.zeros((0, encoder.embed_dim), np.float32), np.zeros(0, np.int64)), []
    embed_s = time.perf_counter() - t0
    embeddings, ids = _assemble(base_version, dataset.item_ids(), plan.unchanged + plan.touched, res)
    if not ids:
        raise ValueError(
            f"no readable items left in {dataset.root} "
            f"({len(res.skipped) + len(getattr(dataset, 'skipped', []))} skipped)"
        )
    reused = len(plan.unchanged) + len(plan.touched)
    skipped = skipped_items(dataset, res, 0)  # undecodable files and embedding failures, once each
    counts.update(embedded=int(len(res.rows)), skipped=len(skipped), count=len(ids), reused=reused)
    source = embedded_source(dataset, res, 0)
    source.update(count=len(ids), embedded=int(len(res.rows)))
    fields = _base_fields(base_version)
    fields.update(
        dataset={"spec": source["spec"], "fingerprint": source["fingerprint"]},
        sources=[source],
        skipped=skipped,
        skipped_count=len(skipped),
        parent=base_version.version,
        sync=counts,
    )
    with released_on_disk_full(caches):
        version, staging = write_version(
            store,
            embeddings,
            ids,
            kind=base_version.kind,
            params=_rebuild_params(base_version, len(ids)),
            target_recall=commit.target_recall,
            fields=fields,
            timings={"embed_s": embed_s},
            extra_files=item_files(plan.records, item_metadata, ids),
        )
        commit_staged(
            store,
            Staged(version, staging),
            dataclasses.replace(commit, evaluator=same_model_gate(commit.evaluator, sha)),
            path="index sync",
            t_start=t_start,
            model=(sha,),
        )
    for cache in caches:
        shutil.rmtree(cache, ignore_errors=True)
    logger.info("synced %s -> %s: %s", base_version.version, version, counts)
    return version, counts


def _assemble(
    base: IndexVersion, ids_now: list[str], reused: list[int], fresh: EmbedResult
) -> tuple[np.ndarray, list[str]]:
    """Rows in the folder's order (what a from-scratch build gives): reused base rows and fresh
    embeddings; items in neither were skipped (unreadable)."""
    base_row = {item: r for r, item in enumerate(base.ids)}
    fresh_row = {int(i): k for k, i in enumerate(fresh.rows)}
    keep = np.array(sorted(set(reused) | set(fresh_row)), dtype=np.int64)  # (M,) dataset indices
    from_base = np.isin(keep, np.asarray(reused, dtype=np.int64))  # (M,)
    out = np.empty((len(keep), base.dim), dtype=np.float32)  # (M, D)
    if from_base.any():
        out[from_base] = base.embeddings[np.array([base_row[ids_now[i]] for i in keep[from_base]])]
    if (~from_base).any():
        out[~from_base] = fresh.embeddings[np.array([fresh_row[int(i)] for i in keep[~from_base]])]
    return out, [ids_now[i] for i in keep]


def read_ids_file(path) -> list[str]:
    """One item id per line (blank lines ignored; ids are kept exactly, spaces included)."""
    ids = [i for i in read_id_lines(path) if i.strip()]
    if not ids:
        raise ValueError(f"{path} names no item ids (one per line)")
    return ids


def delete_items(
    root, ids, *, base: str | None = None, ignore_missing: bool = False, commit: CommitOptions | None = None
) -> tuple[str, dict]:
    """New version = `base` (default current) without the items `ids` -> (version, counts). No
    re-embedding."""
    t_start = time.perf_counter()
    commit = commit or CommitOptions()
    commit.check()
    store = IndexStore(root)
    base_version = store.load(base, verify=True, gpu=False)
    drop = set(ids)
    missing = sorted(drop - set(base_version.ids))
    if missing and not ignore_missing:
        raise ValueError(
            f"{len(missing)} of the {len(drop)} ids are not in {base_version.version}, e.g. "
            f"{', '.join(repr(m) for m in missing[:3])} (--ignore-missing to drop the others anyway)"
        )
    keep_rows = np.array([r for r, item in enumerate(base_version.ids) if item not in drop], dtype=np.int64)
    deleted = len(base_version) - len(keep_rows)
    if deleted == 0:
        raise ValueError(f"none of the ids are in {base_version.version}; nothing to delete")
    if len(keep_rows) == 0:
        raise ValueError(f"deleting every item of {base_version.version} would leave an empty index")
    ids_kept = [base_version.ids[r] for r in keep_rows]
    embeddings = np.ascontiguousarray(base_version.embeddings[keep_rows], dtype=np.float32)
    m = base_version.manifest
    counts = {
        "base": base_version.version,
        "deleted": deleted,
        "missing": len(missing),
        "count": len(ids_kept),
    }
    fields = _base_fields(
        base_version,
        keys=(
            "encoder",
            "lineage",
            "search_temperature",
            "search_temperature_source",
            "dataset",
            "sources",
            "world_size",
            "text",
        ),
    )
    fields.update(
        skipped=m.skipped or [],
        skipped_count=m.skipped_count or 0,
        parent=base_version.version,
        deleted=counts,
    )
    version, staging = write_version(
        store,
        embeddings,
        ids_kept,
        kind=base_version.kind,
        params=_rebuild_params(base_version, len(ids_kept)),
        target_recall=commit.target_recall,
        fields=fields,
        extra_files=item_files(read_records(base_version.path), read_metadata(base_version.path), ids_kept),
    )
    sha = m.checkpoint_record.sha256
    try:
        if m.has_encoder:  # a version built from vectors names no model
            store.models.resolve(
                m.checkpoint_record, base_version.version
            )  # present (or migrated) before the commit
    except BaseException:
        discard_staging(staging)
        raise
    commit_staged(
        store,
        Staged(version, staging),
        dataclasses.replace(commit, evaluator=same_model_gate(commit.evaluator, sha)),
        path="index delete",
        t_start=t_start,
    )
    return version, counts
