"""Versioned on-disk index store with an atomic `current` pointer, rollback and retention.

Layout under `root`::

    versions/<version>/   immutable: manifest.json, index.faiss, embeddings.npy, ids.json
    models/<sha256>.safetensors   encoder weights, content-addressed, shared by versions (index/models.py)
    staging/<name>/       builds in progress (embedding shards, a version being written)
    current               the serving version's name; replaced atomically (tmp, fsync, os.replace)
    history.json          activation stack (for rollback) and an action log
    .lock                 flock taken by every pointer / directory change

Version names sort by creation time: `YYYYmmddTHHMMSSmmmZ-<8 hex>`. A version appears in
versions/ only by one `os.rename` of a fully written staging directory, so a build killed at
any point leaves `current` and every listed version intact.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path

import faiss
import numpy as np

from index import faiss_index
from index.manifest import (FROZEN_FIELDS, IndexCorruptError, atomic_write_text, fsync_dir, read_manifest,
                            verify_files, write_manifest)
from index.models import DEFAULT_GRACE_S, ModelStore, checkpoint_record

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
EMBEDDINGS_FILE = "embeddings.npy"
IDS_FILE = "ids.json"
VERSION_FILES = (INDEX_FILE, EMBEDDINGS_FILE, IDS_FILE)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def new_version_name(salt: str = "") -> str:
    """A fresh, time-sortable version name: UTC timestamp (ms) + 8 hex of a random hash."""
    now = _dt.datetime.now(_dt.timezone.utc)
    stamp = now.strftime("%Y%m%dT%H%M%S") + f"{now.microsecond // 1000:03d}Z"
    digest = hashlib.sha256(f"{salt}:{uuid.uuid4()}".encode()).hexdigest()[:8]
    return f"{stamp}-{digest}"


def check_version_name(version: str) -> str:
    """Reject names that could escape the versions directory or are hidden files."""
    if not isinstance(version, str) or not _NAME_RE.match(version):
        raise ValueError(f"invalid version name {version!r}")
    return version


class IndexVersion:
    """One loaded version: the FAISS index, caller ids, unit embeddings and the manifest.

    `embeddings` is a read-only np.memmap of embeddings.npy: callers stream it in row blocks
    (or gather rows) and never need it resident."""

    def __init__(self, path: Path, manifest: dict, index: faiss.Index, ids: list[str], embeddings: np.ndarray):
        self.path = Path(path)
        self.manifest = manifest
        self.version: str = manifest["version"]
        self.kind: str = manifest["kind"]
        self.index = index
        self.ids = ids
        self.embeddings = embeddings    # (N, D) float32 unit rows (read-only memmap); row i is ids[i] and FAISS row i

    @classmethod
    def load(cls, path: str | os.PathLike, verify: bool = True, gpu: bool | None = None) -> "IndexVersion":
        """Load a version directory; `verify` recomputes every file's sha256 first.

        `gpu=None` moves the index onto all visible GPUs when FAISS has that kind on GPU.
        Raises IndexCorruptError (a ValueError) when anything disagrees with the manifest.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"index version directory not found: {path}")
        manifest = read_manifest(path)
        if verify:
            verify_files(path, manifest)
        try:
            index = faiss.read_index(str(path / INDEX_FILE))
            # memory-mapped, read-only: the serving process holds no second N x D copy; pages come
            # from the OS page cache (shared by every worker process on the machine) as they are read
            embeddings = np.load(path / EMBEDDINGS_FILE, mmap_mode="r", allow_pickle=False)
            ids = json.loads((path / IDS_FILE).read_text(encoding="utf-8"))
        except (RuntimeError, ValueError, OSError, EOFError) as err:
            raise IndexCorruptError(f"{path}: cannot read version files ({err})") from err
        n, d = manifest["count"], manifest["dim"]
        problems = []
        if index.ntotal != n or index.d != d:
            problems.append(f"index has {index.ntotal} x {index.d}, manifest {n} x {d}")
        if embeddings.shape != (n, d) or embeddings.dtype != np.float32:
            problems.append(f"embeddings are {embeddings.shape} {embeddings.dtype}, expected ({n}, {d}) float32")
        if not isinstance(ids, list) or len(ids) != n:
            problems.append(f"ids.json holds {len(ids) if isinstance(ids, list) else type(ids).__name__} ids, expected {n}")
        if faiss_index.kind_of(index) != manifest["kind"]:
            problems.append(f"index is {faiss_index.kind_of(index)}, manifest says {manifest['kind']}")
        if problems:
            raise IndexCorruptError(f"{path}: " + "; ".join(problems))
        faiss_index.set_search_params(index, manifest["kind"], manifest["params"])
        if gpu or (gpu is None and faiss_index.use_gpu(manifest["kind"])):
            try:
                gpu_index = faiss_index.to_gpu(index)
                faiss_index.set_search_params(gpu_index, manifest["kind"], manifest["params"])
                index = gpu_index
            except RuntimeError as err:  # unsupported on GPU: serve from the CPU copy
                logger.warning("%s: cannot move the %s index to GPU (%s); searching on CPU", path, manifest["kind"], err)
        return cls(path, manifest, index, ids, embeddings)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores (Q, k'), rows (Q, k')), k' = min(k, N); rows index ids/embeddings, -1 = none."""
        return faiss_index.search(self.index, queries, k)

    def item_ids(self, rows) -> list:
        """Caller ids for FAISS rows (1-D -> list[str], 2-D -> list[list[str]]); -1 rows are dropped."""
        rows = np.asarray(rows)
        if rows.ndim == 2:
            return [self.item_ids(r) for r in rows]
        if rows.ndim != 1:
            raise ValueError(f"rows must be 1-D or 2-D, got shape {rows.shape}")
        out = []
        for r in rows.tolist():
            if r < 0:
                continue
            if r >= len(self.ids):
                raise ValueError(f"row {r} out of range for {len(self.ids)} items")
            out.append(self.ids[r])
        return out


class IndexStore:
    """Versions of an index under one root; see the module docstring for the layout."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.versions_dir = self.root / "versions"
        self.staging_dir = self.root / "staging"
        self.current_file = self.root / "current"
        self.history_file = self.root / "history.json"
        self.models = ModelStore(self.root)

    # ------------------------------------------------------------------ paths and locking
    def ensure(self) -> None:
        """Create root, versions/ and staging/ if missing."""
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def lock(self):
        """Exclusive flock over pointer/directory changes (builds in other processes wait)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def path(self, version: str) -> Path:
        """Directory of an existing version; ValueError naming it when unknown."""
        p = self.versions_dir / check_version_name(version)
        if not p.is_dir():
            known = ", ".join(self.versions()[-5:]) or "none"
            raise ValueError(f"unknown index version {version!r} under {self.root} (latest: {known})")
        return p

    def staging_path(self, name: str) -> Path:
        """A directory under staging/ (created)."""
        p = self.staging_dir / check_version_name(name)
        p.mkdir(parents=True, exist_ok=True)
        return p

    # ------------------------------------------------------------------ queries
    def versions(self) -> list[str]:
        """All committed versions, oldest first."""
        if not self.versions_dir.is_dir():
            return []
        return sorted(p.name for p in self.versions_dir.iterdir() if p.is_dir() and not p.name.startswith("."))

    def current_version(self) -> str | None:
        """The serving version's name, or None before the first activation."""
        try:
            name = self.current_file.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        return name or None

    def history(self) -> dict:
        """{"stack": [activated versions, oldest first], "log": [{time, action, version}]}."""
        try:
            data = json.loads(self.history_file.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("stack"), list):
                return data
            logger.warning("%s has an unexpected shape; starting a new history", self.history_file)
        except FileNotFoundError:
            pass
        except json.JSONDecodeError:
            logger.warning("%s is not valid JSON; starting a new history", self.history_file)
        return {"stack": [], "log": []}

    def manifest(self, version: str) -> dict:
        """A version's manifest without loading the index."""
        return read_manifest(self.path(version))

    def load(self, version: str | None = None, verify: bool = True, gpu: bool | None = None) -> IndexVersion:
        """Load `version` (default: current); IndexCorruptError leaves the store untouched."""
        version = version or self.current_version()
        if version is None:
            raise FileNotFoundError(f"no current index version under {self.root}; build one first")
        return IndexVersion.load(self.path(version), verify=verify, gpu=gpu)

    # ------------------------------------------------------------------ changes
    def _write_current(self, version: str) -> None:
        atomic_write_text(self.current_file, version + "\n")

    def _record(self, history: dict, action: str, version: str) -> None:
        history.setdefault("log", []).append({"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                              "action": action, "version": version})
        atomic_write_text(self.history_file, json.dumps(history, indent=2) + "\n")

    def commit(self, staging: str | os.PathLike, version: str) -> Path:
        """Move a fully written staging directory into versions/ with one atomic rename."""
        staging = Path(staging)
        target = self.versions_dir / check_version_name(version)
        self.ensure()
        with self.lock():
            if target.exists():
                raise ValueError(f"index version {version!r} already exists under {self.root}")
            fsync_dir(staging)
            os.rename(staging, target)
            fsync_dir(self.versions_dir)
        logger.info("committed index version %s", version)
        return target

    def activate(self, version: str) -> None:
        """Make `version` current (atomic pointer switch) and push it on the activation stack."""
        self.path(version)
        with self.lock():
            history = self.history()
            current = self.current_version()
            stack = history["stack"]
            if current and (not stack or stack[-1] != current):
                stack.append(current)   # pointer written by someone without a history entry
            self._write_current(version)
            if not stack or stack[-1] != version:
                stack.append(version)
            self._record(history, "activate", version)
        logger.info("activated index version %s (was %s)", version, current)

    def rollback(self) -> str:
        """Re-activate the version active before the current one; returns its name.

        Versions deleted since (retention) are skipped; ValueError when none is left.
        """
        with self.lock():
            history = self.history()
            stack = history["stack"]
            current = self.current_version()
            if current and (not stack or stack[-1] != current):
                stack.append(current)
            existing = set(self.versions())
            if stack:
                stack.pop()   # the current version
            while stack and stack[-1] not in existing:
                logger.info("rollback: skipping deleted version %s", stack[-1])
                stack.pop()
            if not stack:
                raise ValueError(f"no earlier activated version to roll back to under {self.root}")
            target = stack[-1]
            self._write_current(target)
            self._record(history, "rollback", target)
        logger.info("rolled back index from %s to %s", current, target)
        return target

    def used_models(self) -> set[str]:
        """sha256 of every encoder model a committed or staged version names."""
        used = set()
        dirs = [self.versions_dir / v for v in self.versions()]
        if self.staging_dir.is_dir():
            dirs += [p for p in self.staging_dir.iterdir() if (p / "manifest.json").is_file()]
        for d in dirs:
            try:
                sha = checkpoint_record(read_manifest(d)).get("sha256")
            except IndexCorruptError:
                continue
            if sha:
                used.add(sha)
        return used

    def prune(self, keep: int, model_grace_s: float = DEFAULT_GRACE_S) -> list[str]:
        """Delete all but the newest `keep` versions, never the current one; returns deleted names.

        Encoder models no remaining version uses are deleted too (unless younger than
        `model_grace_s`: a build in progress may have just stored one)."""
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        removed = []
        with self.lock():
            current = self.current_version()
            versions = self.versions()
            survivors = set(versions[-keep:]) | ({current} if current else set())
            for name in versions:
                if name in survivors:
                    continue
                # Rename first so versions/ never lists a half-deleted directory.
                trash = self.root / f".trash-{name}"
                os.rename(self.versions_dir / name, trash)
                shutil.rmtree(trash, ignore_errors=True)
                removed.append(name)
            if removed:
                fsync_dir(self.versions_dir)
                self._record(self.history(), "prune", ",".join(removed))
        if removed:
            logger.info("pruned %d index versions: %s", len(removed), ", ".join(removed))
        with self.lock():
            self.models.remove_unused(self.used_models(), grace_s=model_grace_s)
        self.clean_staging()
        return removed

    def clean_staging(self, max_age_s: float = 3600.0) -> list[str]:
        """Delete version directories in staging/ untouched for `max_age_s` (left by killed builds).

        Embedding caches (`staging/embed-*`) are kept: they let a rerun of that build resume.
        """
        if not self.staging_dir.is_dir():
            return []
        import time

        removed = []
        now = time.time()
        for p in self.staging_dir.iterdir():
            if p.is_dir() and not p.name.startswith("embed-") and now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
            elif p.is_file() and p.name.startswith("pretrained-") and now - p.stat().st_mtime > max_age_s:
                p.unlink(missing_ok=True)   # a pretrained encoder saved by a killed `index build --encoder`
                removed.append(p.name)
        if removed:
            logger.info("removed %d stale staging directories: %s", len(removed), ", ".join(removed))
        return removed

    def update_manifest_fields(self, version: str, **fields) -> dict:
        """Add or change descriptive manifest fields (e.g. search_temperature) before activation.

        Refused for a version that is or was ever activated (served manifests are immutable)
        and for fields that describe the stored bytes (count, dim, files, kind, ...).
        """
        path = self.path(version)
        frozen = sorted(set(fields) & FROZEN_FIELDS)
        if frozen:
            raise ValueError(f"manifest fields {frozen} describe the stored index and cannot be changed")
        with self.lock():
            if version == self.current_version() or version in self.history()["stack"]:
                raise ValueError(f"index version {version!r} has been activated; its manifest is immutable")
            manifest = read_manifest(path)
            manifest.update(fields)
            write_manifest(path, manifest)
        return manifest
