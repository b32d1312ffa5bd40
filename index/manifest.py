"""The self-describing `manifest.json` of an index version: create, read, write, verify.

A version directory holds `index.faiss`, `embeddings.npy`, `ids.json`, `manifest.json` and, since
they are stored, `normaliser_stats.npz` (index/list_stats.py).
The manifest lists the sha256 of every other file; loading recomputes them so a corrupt or
truncated file is refused (IndexCorruptError) and the caller can keep the previous version.
The manifest itself is validated by parsing and by its required fields.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import IO, Callable

from index.disk import writing

#: Search temperature when neither the manifest nor the checkpoint records one.
DEFAULT_TEMPERATURE = 0.1

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT = "softsearch-index"
FORMAT_VERSION = 1
REQUIRED_FIELDS = ("format", "format_version", "version", "created", "count", "dim", "metric",
                   "normalised", "kind", "params", "faiss_version", "files")
# Fields that `update_manifest_fields` may never change: they describe the stored bytes.
FROZEN_FIELDS = frozenset(REQUIRED_FIELDS) | {"checkpoint", "dataset", "sources", "encoder", "normaliser_stats"}


class IndexCorruptError(ValueError):
    """A version directory whose files do not match its manifest (or no valid manifest)."""


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def utc_now() -> str:
    """ISO-8601 UTC timestamp with seconds."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False) -> None:
    """Call `write(fh)` on a temp file beside `path`, fsync, os.replace, fsync the directory.

    Readers see either the old file or the complete new one, also after a crash mid-write."""
    path = Path(path)
    with writing(path):   # a full disk: DiskFull naming `path`
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically replace `path` with `text` (see atomic_write)."""
    atomic_write(path, lambda fh: fh.write(text))


def create_manifest(*, version: str, count: int, dim: int, kind: str, params: dict, faiss_version: str,
                    files: dict, **fields) -> dict:
    """A manifest dict with the required fields first, then any extra `fields`.

    Extra fields used by index.build: checkpoint {path, sha256}, encoder (config dict), dataset
    {spec, fingerprint}, sources (every dataset that contributed rows), lineage {objective,
    temperature_schedule, train_config_hash, ...}, search_temperature, skipped, timings,
    recall, quality_gate, parent.
    """
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": version,
        "created": utc_now(),
        "count": int(count),
        "dim": int(dim),
        "metric": "inner_product",
        "normalised": True,
        "kind": kind,
        "params": dict(params),
        "faiss_version": faiss_version,
        "files": files,
    }
    manifest.update(fields)
    return manifest


def describe_files(directory: str | os.PathLike, names: list[str]) -> dict:
    """{name: {"sha256", "bytes"}} for files in `directory` (what the manifest records)."""
    directory = Path(directory)
    return {n: {"sha256": file_sha256(directory / n), "bytes": (directory / n).stat().st_size} for n in names}


def write_manifest(directory: str | os.PathLike, manifest: dict) -> Path:
    """Atomically write `directory/manifest.json`."""
    path = Path(directory) / MANIFEST_NAME
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=False, default=_json_default) + "\n")
    return path


def _json_default(obj):
    # numpy scalars and paths end up in timings / params; store them as plain JSON.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def read_manifest(directory: str | os.PathLike) -> dict:
    """Parse and validate `directory/manifest.json`; IndexCorruptError when unusable."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise IndexCorruptError(f"{path} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IndexCorruptError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(manifest, dict):
        raise IndexCorruptError(f"{path} does not hold a JSON object")
    missing = [f for f in REQUIRED_FIELDS if f not in manifest]
    if missing:
        raise IndexCorruptError(f"{path} lacks required fields {missing}")
    if manifest["format"] != FORMAT:
        raise IndexCorruptError(f"{path} has format {manifest['format']!r}, expected {FORMAT!r}")
    if manifest["format_version"] > FORMAT_VERSION:
        raise IndexCorruptError(f"{path} has format_version {manifest['format_version']}, newer than {FORMAT_VERSION}")
    if manifest["metric"] != "inner_product" or manifest["normalised"] is not True:
        raise IndexCorruptError(f"{path}: only normalised inner-product indexes are supported")
    return manifest


def verify_files(directory: str | os.PathLike, manifest: dict) -> None:
    """Recompute size and sha256 of every file the manifest lists; IndexCorruptError on mismatch."""
    directory = Path(directory)
    for name, info in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise IndexCorruptError(f"{path} is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise IndexCorruptError(f"{path} has {size} bytes, the manifest says {info['bytes']} (truncated?)")
        digest = file_sha256(path)
        if digest != info["sha256"]:
            raise IndexCorruptError(f"{path} sha256 {digest[:12]}... does not match the manifest {info['sha256'][:12]}...")


# ----------------------------------------------------------------- reading fields that changed shape
def manifest_sources(manifest: dict) -> list[dict]:
    """The datasets a version was built from, as [{"spec": {...}, "fingerprint": ...}, ...], from every
    layout written so far: `sources` (one per dataset), else the single `dataset` record, which the
    oldest versions stored as the bare spec."""
    sources = manifest.get("sources")
    if not sources:
        one = manifest.get("dataset")
        sources = [one] if isinstance(one, dict) else []
    out = []
    for src in sources:
        if isinstance(src, dict) and isinstance(src.get("spec"), dict):
            out.append(src)
        elif isinstance(src, dict) and "name" in src:   # the bare spec of the oldest layout
            out.append({"spec": src})
    return out


def manifest_temperature(manifest: dict) -> float | None:
    """The version's search temperature: `search_temperature` (a number, or a {"temperature"|"tau": ...}
    record in older layouts), else the older `calibrated_temperature`; None when none is positive."""
    for key in ("search_temperature", "calibrated_temperature"):
        value = manifest.get(key)
        if isinstance(value, dict):
            value = value.get("temperature", value.get("tau"))
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            return float(value)
    return None
