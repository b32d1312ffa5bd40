"""Versioned on-disk index store with an atomic `current` pointer, rollback and retention.

Layout under `root`::

    versions/<version>/   immutable: manifest.json, index.faiss, embeddings.npy, ids.json,
                          normaliser_stats.npz (per-list statistics, index/list_stats.py),
                          index.ivfdata (on-disk inverted lists of a streamed build, index/stream.py), ...
    models/<sha256>.safetensors   encoder weights, content-addressed, shared by versions (index/models.py)
    staging/<name>/       builds in progress (embedding shards, a version being written)
    current               the serving version's name; replaced atomically (tmp, fsync, os.replace)
    history.json          activation stack (for rollback) and an action log
    .lock                 flock taken by every pointer / directory change

Activation rule (index/gate.py, its one home): `current` moves only through `IndexStore.activate` /
`IndexStore.rollback`, which apply `activation_checks` to the version (its recorded quality-gate result, and
the recall@10 its FAISS index reaches at the tuned search parameters against the version's target) and either
refuse (ActivationRefused: which check, the figures, how to override) or move the pointer. `force`
overrides a failed check; the override is logged in history.json with the time, the path that asked
("index activate", "POST /v1/admin/reload", ...) and "forced": true. A serving process loads a
version only if `serving_check` accepts it: it passes the rule, or its activation was forced.

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
import zipfile
from pathlib import Path

import faiss
import numpy as np

from index import faiss_index
from index.disk import DiskFull, free_bytes, on_disk, writing
from index.gate import ActivationRefused, Decision, Gate, activation_checks
from index.list_stats import ListStats
from index.manifest import (
    FROZEN_FIELDS,
    MANIFEST_NAME,
    IndexCorruptError,
    Manifest,
    atomic_write_text,
    fsync_dir,
    read_manifest,
    update_manifest,
    updated_bytes,
    verify_files,
)
from index.models import DEFAULT_GRACE_S, MODELS_DIR, ModelStore

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
EMBEDDINGS_FILE = "embeddings.npy"
IDS_FILE = "ids.json"
VERSION_FILES = (INDEX_FILE, EMBEDDINGS_FILE, IDS_FILE)
#: The bounded normaliser's per-list statistics; in every version written since they are stored.
LIST_STATS_FILE = "normaliser_stats.npz"
#: The inverted lists of a streamed IVF build (index/stream.py), FAISS's OnDiskInvertedLists file: the
#: index file names it, FAISS maps it read-only from beside the index (faiss_index.read_index).
IVFDATA_FILE = faiss_index.LISTS_FILE
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class VersionExists(ValueError):
    """`IndexStore.commit` of a name that versions/ already holds (e.g. a concurrent import won)."""


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

    def __init__(
        self, path: Path, manifest: Manifest, index: faiss.Index, ids: list[str], embeddings: np.ndarray
    ):
        self.path = Path(path)
        self.manifest = manifest
        self.version: str = manifest.version
        self.kind: str = manifest.kind
        self.index = index
        self.ids = ids
        self.embeddings = (
            embeddings  # (N, D) float32 unit rows (read-only memmap); row i is ids[i] and FAISS row i
        )

    @classmethod
    def load(
        cls, path: str | os.PathLike, verify: bool = True, gpu: bool | None = None, mmap_index: bool = False
    ) -> "IndexVersion":
        """Load a version directory; `verify` recomputes every file's sha256 first.

        `gpu=None` moves the index onto all visible GPUs when FAISS has that kind on GPU. `mmap_index`: flat
        codes are mapped from the index file, not copied (`faiss_index.read_index`; shared by processes).
        Raises IndexCorruptError (a ValueError) when anything disagrees with the manifest.
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"index version directory not found: {path}")
        manifest = read_manifest(path)
        if manifest.shards:  # a sharded version: each shard a version directory of its own (index/shards.py)
            from index.shards import ShardedVersion

            return ShardedVersion.load(path, manifest, verify=verify, gpu=gpu)
        if verify:
            verify_files(path, manifest)
        try:
            # on-disk lists (IVFDATA_FILE) stay mapped
            index = faiss_index.read_index(path / INDEX_FILE, mmap=mmap_index)
            # memory-mapped, read-only: the serving process holds no second N x D copy; pages come
            # from the OS page cache (shared by every worker process on the machine) as they are read
            embeddings = np.load(path / EMBEDDINGS_FILE, mmap_mode="r", allow_pickle=False)
            ids = json.loads((path / IDS_FILE).read_text(encoding="utf-8"))
        except (RuntimeError, ValueError, OSError, EOFError) as err:
            raise IndexCorruptError(f"{path}: cannot read version files ({err})") from err
        n, d = manifest.count, manifest.dim
        problems = []
        if index.ntotal != n or index.d != d:
            problems.append(f"index has {index.ntotal} x {index.d}, manifest {n} x {d}")
        if embeddings.shape != (n, d) or embeddings.dtype != np.float32:
            problems.append(
                f"embeddings are {embeddings.shape} {embeddings.dtype}, expected ({n}, {d}) float32"
            )
        if not isinstance(ids, list) or len(ids) != n:
            problems.append(
                f"ids.json holds {len(ids) if isinstance(ids, list) else type(ids).__name__} ids, "
                f"expected {n}"
            )
        if faiss_index.kind_of(index) != manifest.kind:
            problems.append(f"index is {faiss_index.kind_of(index)}, manifest says {manifest.kind}")
        if problems:
            raise IndexCorruptError(f"{path}: " + "; ".join(problems))
        faiss_index.set_search_params(index, manifest.kind, manifest.params)
        if gpu or (gpu is None and faiss_index.use_gpu(manifest.kind)):
            try:
                gpu_index = faiss_index.to_gpu(index)
                faiss_index.set_search_params(gpu_index, manifest.kind, manifest.params)
                index = gpu_index
            except RuntimeError as err:  # unsupported on GPU: serve from the CPU copy
                logger.warning(
                    "%s: cannot move the %s index to GPU (%s); searching on CPU", path, manifest.kind, err
                )
        return cls(path, manifest, index, ids, embeddings)

    def __len__(self) -> int:
        return len(self.ids)

    def list_stats(self) -> ListStats | None:
        """The version's stored per-list statistics (`LIST_STATS_FILE`), None when its manifest lists
        none (written before they were stored). IndexCorruptError when the file is unreadable or
        does not describe this version (rows, dimension, lists): a damaged version file is refused,
        as at `load` (whose checksum check already refuses a changed one)."""
        if LIST_STATS_FILE not in self.manifest.files:
            return None
        path = self.path / LIST_STATS_FILE
        try:
            stats = ListStats.load(path)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            raise IndexCorruptError(f"{path}: cannot read the normaliser statistics ({err})") from err
        problems = stats.problems(len(self.ids), int(self.embeddings.shape[1]), self.index)
        if problems:
            raise IndexCorruptError(f"{path} does not describe this version: " + "; ".join(problems))
        logger.info("normaliser statistics from %s: %s", path.name, stats.source)
        return stats

    @property
    def dim(self) -> int:
        return int(self.manifest.dim)

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


def require_store(root) -> Path:
    """The root of an existing store, or FileNotFoundError with one line saying what is wrong (a typo or a
    file) and how to create one; commands that read a store never create a mistyped root."""
    root = Path(root)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise FileNotFoundError(
            f"index root {root} {what}; create one with `softsearch index build --root {root} ...`"
        )
    return root


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

    def duplicates_path(self, version: str, suffix: str = ".json") -> Path:
        """Where `softsearch dedup` keeps a version's duplicate groups (`.json`) and their page (`.html`)."""
        return self.root / "duplicates" / f"{check_version_name(version)}{suffix}"

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
        return sorted(
            p.name for p in self.versions_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
        )

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

    def manifest(self, version: str) -> Manifest:
        """A version's manifest without loading the index."""
        return read_manifest(self.path(version))

    def load(
        self,
        version: str | None = None,
        verify: bool = True,
        gpu: bool | None = None,
        mmap_index: bool = False,
    ) -> IndexVersion:
        """Load `version` (default: current); IndexCorruptError leaves the store untouched."""
        version = version or self.current_version()
        if version is None:
            raise FileNotFoundError(f"no current index version under {self.root}; build one first")
        return IndexVersion.load(self.path(version), verify=verify, gpu=gpu, mmap_index=mmap_index)

    # ------------------------------------------------------------------ changes
    def _write_current(self, version: str) -> None:
        atomic_write_text(self.current_file, version + "\n")

    def _record(
        self,
        history: dict,
        action: str,
        version: str,
        *,
        path: str | None = None,
        previous: str | None = None,
        decision: dict | None = None,
    ) -> dict:
        """Append one entry to the action log (activations: the path that asked, whether forced and
        which checks the force overrode) and write history.json atomically."""
        entry = self._log_entry(history, action, version, path=path, previous=previous, decision=decision)
        atomic_write_text(self.history_file, json.dumps(history, indent=2) + "\n")
        return entry

    @staticmethod
    def _log_entry(
        history: dict,
        action: str,
        version: str,
        *,
        path: str | None = None,
        previous: str | None = None,
        decision: Decision | None = None,
    ) -> dict:
        """Append one entry to `history`'s action log (in memory) -> the entry."""
        entry = {
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "action": action,
            "version": version,
        }
        if path is not None:
            entry.update(path=path, previous=previous, forced=bool(decision and decision.forced))
            if entry["forced"]:
                entry["overridden"] = [c.message for c in decision.failed]
        history.setdefault("log", []).append(entry)
        return entry

    def switch_bytes(self, version: str) -> int:
        """About the bytes an activation of `version` writes: the pointer and history.json with one more
        entry (each a whole-block temp file beside the old one)."""
        try:
            history = self.history_file.stat().st_size
        except FileNotFoundError:
            history = 0
        return on_disk(len(version) + 1) + on_disk(history + 1024)

    def _serving_as_before(self, current: str | None) -> str:
        return (
            f"`current` still points at {current}, which keeps serving"
            if current
            else "no version is current, as before"
        )

    def _switch(
        self, action: str, version: str, current: str | None, history: dict, *, path: str, decision: dict
    ) -> dict:
        """Point `current` at `version` and log it in history.json, both or neither (under the lock): the
        free space is checked for both first, and the pointer is put back when the history write fails."""
        entry = self._log_entry(history, action, version, path=path, previous=current, decision=decision)
        text = json.dumps(history, indent=2) + "\n"
        needed = on_disk(len(version) + 1) + on_disk(len(text.encode("utf-8")))
        if action == "rollback":
            outcome = (
                f"the rollback to {version} was not made: {self._serving_as_before(current)}; free some "
                f"space and rerun 'softsearch index rollback --root {self.root}'"
            )
        else:
            outcome = (
                f"index version {version} was not activated: {self._serving_as_before(current)}; free "
                f"some space and run 'softsearch index activate {version} --root {self.root}'"
            )
        with writing(self.current_file, needed, outcome):
            free = free_bytes(self.root)
            if free is not None and free < needed:
                raise DiskFull(self.current_file, needed)
            self._write_current(version)
            try:
                atomic_write_text(self.history_file, text)
            except BaseException as err:
                try:
                    if current:
                        self._write_current(current)
                    else:
                        self.current_file.unlink(missing_ok=True)
                except OSError:
                    if isinstance(err, DiskFull):
                        err.outcome = (
                            f"`current` now points at {version} but history.json does not record it "
                            f"(the disk filled between the two writes); free some space and run "
                            f"'softsearch index activate {version} --root {self.root}'"
                        )
                    raise err from None
                raise
        return entry

    def commit(self, staging: str | os.PathLike, version: str) -> Path:
        """Move a fully written staging directory into versions/ with one atomic rename."""
        staging = Path(staging)
        target = self.versions_dir / check_version_name(version)
        self.ensure()
        with self.lock():
            if target.exists():
                raise VersionExists(f"index version {version!r} already exists under {self.root}")
            fsync_dir(staging)
            os.rename(staging, target)
            fsync_dir(self.versions_dir)
        logger.info("committed index version %s", version)
        return target

    # ------------------------------------------------------------------ the activation rule
    def check_activation(self, version: str, *, force: bool = False) -> Decision:
        """Apply the activation rule to `version` without changing anything.

        Returns the Decision; raises ActivationRefused when a check failed and not `force`. A version with no
        gate result is judged on its recall alone here (`activate` with a `gate` first gates it)."""
        manifest = self.manifest(version)
        checks = tuple(activation_checks(manifest))
        failed = tuple(c for c in checks if c.passed is False)
        if failed and not force:
            raise ActivationRefused(version, failed)
        return Decision(version, checks, failed, bool(failed))

    def serving_check(self, version: str) -> Decision:
        """May a serving process load `version` (start-up, following `current`, a plain reload)?

        Yes when it passes the activation rule, or when the activation that made it current was
        forced (recorded in history.json); ActivationRefused otherwise (e.g. a pointer written by hand)."""
        try:
            return self.check_activation(version)
        except ActivationRefused:
            entry = self.last_activation(version)
            if entry is not None and entry.get("forced") and self.current_version() == version:
                return self.check_activation(version, force=True)
            raise

    def last_activation(self, version: str) -> dict | None:
        """The newest history entry that made `version` current (activate / rollback), or None."""
        for entry in reversed(self.history().get("log") or []):
            if entry.get("action") in ("activate", "rollback") and entry.get("version") == version:
                return entry
        return None

    def activate(
        self,
        version: str,
        *,
        force: bool = False,
        path: str = "library",
        gate: Gate | None = None,
        verify: bool = True,
    ) -> dict:
        """Make `version` current through the activation rule -> the history entry written.

        A version without a gate result is first gated with `gate` (recorded in its manifest).
        `verify` re-checks every file's sha256 first (never point `current` at a corrupt version).
        ActivationRefused (nothing changed) when a check fails and not `force`."""
        self._gate_if_missing(version, gate)
        if verify:
            IndexVersion.load(self.path(version), verify=True, gpu=False)
        with self.lock():
            decision = self.check_activation(version, force=force)
            history = self.history()
            current = self.current_version()
            stack = history["stack"]
            if current and (not stack or stack[-1] != current):
                stack.append(current)  # pointer written by someone without a history entry
            if not stack or stack[-1] != version:
                stack.append(version)
            entry = self._switch("activate", version, current, history, path=path, decision=decision)
        self._log_activation(entry)
        return entry

    def rollback(
        self, *, force: bool = False, path: str = "library", gate: Gate | None = None, verify: bool = True
    ) -> str:
        """Re-activate the version active before the current one, through the activation rule;
        returns its name. Versions deleted since (retention) are skipped; ValueError when none is left."""
        target = self._rollback_target(self.history())[1]
        self._gate_if_missing(target, gate)
        if verify:
            IndexVersion.load(self.path(target), verify=True, gpu=False)
        with self.lock():
            history = self.history()
            stack, target = self._rollback_target(history)
            decision = self.check_activation(target, force=force)
            current = self.current_version()
            history["stack"] = stack
            entry = self._switch("rollback", target, current, history, path=path, decision=decision)
        self._log_activation(entry)
        return target

    def _rollback_target(self, history: dict) -> tuple[list[str], str]:
        """(the activation stack after rolling back, the version to roll back to)."""
        stack = list(history["stack"])
        current = self.current_version()
        if current and (not stack or stack[-1] != current):
            stack.append(current)
        existing = set(self.versions())
        if stack:
            stack.pop()  # the current version
        while stack and stack[-1] not in existing:
            logger.info("rollback: skipping deleted version %s", stack[-1])
            stack.pop()
        if not stack:
            raise ValueError(f"no earlier activated version to roll back to under {self.root}")
        return stack, stack[-1]

    def _gate_if_missing(self, version: str, gate: Gate | None) -> None:
        """Gate a version that has no gate result (older stores, versions written without one) and
        record the result in its manifest, so it is judged like any build (gated at first activation)."""
        path = self.path(version)
        if gate is None or read_manifest(path).quality_gate is not None:
            return
        record = gate(version)
        current = self.current_version()
        needed = updated_bytes(path, quality_gate=record) + self.switch_bytes(version)  # then its activation
        with (
            self.lock(),
            writing(
                path / MANIFEST_NAME,
                needed,
                f"the quality gate result of {version} was not recorded and it was not "
                f"activated: {self._serving_as_before(current)}; free some space and rerun",
            ),
        ):
            update_manifest(path, quality_gate=record)
        logger.info(
            "gated %s at its first activation: %s", version, "passed" if record.get("passed") else "FAILED"
        )

    @staticmethod
    def _log_activation(entry: dict) -> None:
        if entry.get("forced"):
            logger.warning(
                "activated %s by force (%s): %s",
                entry["version"],
                entry["path"],
                "; ".join(entry.get("overridden") or []),
            )
        else:
            logger.info(
                "%s %s (was %s) via %s",
                "rolled back to" if entry["action"] == "rollback" else "activated",
                entry["version"],
                entry.get("previous"),
                entry["path"],
            )

    def used_models(self) -> set[str]:
        """sha256 of every encoder model a committed or staged version names."""
        used = set()
        dirs = [self.versions_dir / v for v in self.versions()]
        if (
            self.staging_dir.is_dir()
        ):  # builds in staging/<version>/, imports in staging/import-*/versions/<version>/
            dirs += [
                p
                for p in [*self.staging_dir.iterdir(), *self.staging_dir.glob("import-*/versions/*")]
                if (p / "manifest.json").is_file()
            ]
        for d in dirs:
            try:
                sha = read_manifest(d).checkpoint_record.sha256
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
                for suffix in (".json", ".html"):  # its duplicate scan, if one was made
                    self.duplicates_path(name, suffix).unlink(missing_ok=True)
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
        """Delete leftovers untouched for `max_age_s`: version directories in staging/ (killed builds),
        `.trash-<version>/` (a killed prune, already out of versions/), `.<file>.*.tmp` (a write of
        `current` or the history killed before its rename) and `models/.incoming-*` (a model write killed
        before its rename). The root-level ones go under the store lock,
        so a write in progress is never touched.

        Embedding caches (`staging/embed-*`) are kept: they let a rerun of that build resume.
        """
        import time

        removed = []
        now = time.time()
        with self.lock():
            for p in self.root.iterdir() if self.root.is_dir() else []:
                stale = now - p.lstat().st_mtime > max_age_s
                if stale and p.is_dir() and p.name.startswith(".trash-"):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
                elif stale and p.is_file() and p.name.startswith(".") and p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)
                    removed.append(p.name)
        # a build or import killed while storing its encoder model leaves models/.incoming-*.safetensors
        models = self.root / MODELS_DIR
        for p in sorted(models.glob(".incoming-*")) if models.is_dir() else []:
            try:
                if p.is_file() and now - p.stat().st_mtime > max_age_s:
                    p.unlink()
                    removed.append(f"{MODELS_DIR}/{p.name}")
            except FileNotFoundError:  # its writer finished (renamed it) meanwhile
                continue
        if not self.staging_dir.is_dir():
            return removed
        for p in self.staging_dir.iterdir():
            if p.is_dir() and not p.name.startswith("embed-") and now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
            elif p.is_file() and p.name.startswith("pretrained-") and now - p.stat().st_mtime > max_age_s:
                p.unlink(missing_ok=True)  # a pretrained encoder saved by a killed `index build --encoder`
                removed.append(p.name)
        if removed:
            logger.info("removed %d stale staging directories: %s", len(removed), ", ".join(removed))
        return removed

    def update_manifest_fields(self, version: str, **fields) -> Manifest:
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
            manifest = update_manifest(path, **fields)
        return manifest
