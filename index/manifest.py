"""The self-describing `manifest.json` of an index version: create, read, write, verify.

A version directory holds `index.faiss`, `embeddings.npy`, `ids.json`, `manifest.json` and, since
they are stored, `normaliser_stats.npz` (index/list_stats.py).
The manifest lists the sha256 of every other file; loading recomputes them so a corrupt or
truncated file is refused (IndexCorruptError) and the caller can keep the previous version.
The manifest itself is validated by parsing and by its required fields.

This module is the one reader of manifests: `read_manifest` returns a frozen, typed `Manifest`
(`Manifest.from_json` migrates every older layout; `to_json` writes today's, byte for byte as read),
and code elsewhere reads its attributes, never string keys.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Callable, ClassVar, Mapping

from index.disk import on_disk, writing

#: Search temperature when neither the manifest nor the checkpoint records one.
DEFAULT_TEMPERATURE = 0.1

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT = "softsearch-index"
FORMAT_VERSION = 1
REQUIRED_FIELDS = (
    "format",
    "format_version",
    "version",
    "created",
    "count",
    "dim",
    "metric",
    "normalised",
    "kind",
    "params",
    "faiss_version",
    "files",
)
# Fields that `update_manifest_fields` may never change: they describe the stored bytes.
FROZEN_FIELDS = frozenset(REQUIRED_FIELDS) | {
    "checkpoint",
    "dataset",
    "sources",
    "encoder",
    "normaliser_stats",
    "shards",
    "shard",
}


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


def atomic_write(
    path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False, needed: int | None = None
) -> None:
    """Call `write(fh)` on a temp file beside `path`, fsync, os.replace, fsync the directory.

    Readers see either the old file or the complete new one, also after a crash mid-write."""
    path = Path(path)
    with writing(path, needed):  # a full disk: DiskFull naming `path` (and `needed`, the temp file's bytes)
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
    atomic_write(path, lambda fh: fh.write(text), needed=on_disk(len(text.encode("utf-8"))))


def create_manifest(
    *, version: str, count: int, dim: int, kind: str, params: dict, faiss_version: str, files: dict, **fields
) -> "Manifest":
    """A new Manifest: the required fields first, then any extra `fields` in the order given.

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
    return Manifest.from_json(manifest)


def describe_files(directory: str | os.PathLike, names: list[str]) -> dict:
    """{name: {"sha256", "bytes"}} for files in `directory` (what the manifest records)."""
    directory = Path(directory)
    return {n: {"sha256": file_sha256(directory / n), "bytes": (directory / n).stat().st_size} for n in names}


def write_manifest(directory: str | os.PathLike, manifest: "Manifest | dict") -> Path:
    """Atomically write `directory/manifest.json` (a Manifest as `to_json`, a dict as it is)."""
    path = Path(directory) / MANIFEST_NAME
    atomic_write_text(path, manifest_text(manifest))
    return path


def manifest_text(manifest: "Manifest | dict") -> str:
    """The bytes `write_manifest` writes, as text."""
    data = manifest.to_json() if isinstance(manifest, Manifest) else manifest
    return json.dumps(data, indent=2, sort_keys=False, default=json_default) + "\n"


def updated_bytes(directory: str | os.PathLike, **fields) -> int:
    """On-disk bytes of `directory`'s manifest once `update_manifest(directory, **fields)` has rewritten
    it."""
    return on_disk(len(manifest_text(read_manifest(directory).updated(**fields)).encode("utf-8")))


def json_default(obj):
    # numpy scalars and paths end up in timings / params; store them as plain JSON.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def read_manifest(directory: str | os.PathLike) -> "Manifest":
    """Parse, validate and migrate `directory/manifest.json` (`Manifest.from_json`); IndexCorruptError
    when unusable. The one reader of manifest files."""
    return Manifest.from_json(read_manifest_json(directory), source=Path(directory) / MANIFEST_NAME)


def read_manifest_json(directory: str | os.PathLike) -> dict:
    """The JSON object in `directory/manifest.json` as stored (no validation, no migration); for tools
    and tests that write a layout by hand. IndexCorruptError when it is not a JSON object."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise IndexCorruptError(f"{path} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IndexCorruptError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(manifest, dict):
        raise IndexCorruptError(f"{path} does not hold a JSON object")
    return manifest


def update_manifest(directory: str | os.PathLike, **fields) -> "Manifest":
    """Read, set `fields` (new keys go last, as dict.update orders them) and atomically rewrite
    `directory/manifest.json`; returns the manifest written."""
    manifest = read_manifest(directory).updated(**fields)
    write_manifest(directory, manifest)
    return manifest


def verify_files(directory: str | os.PathLike, manifest: "Manifest") -> None:
    """Recompute size and sha256 of every file the manifest lists; IndexCorruptError on mismatch."""
    directory = Path(directory)
    for name, info in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise IndexCorruptError(f"{path} is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise IndexCorruptError(
                f"{path} has {size} bytes, the manifest says {info['bytes']} (truncated?)"
            )
        digest = file_sha256(path)
        if digest != info["sha256"]:
            raise IndexCorruptError(
                f"{path} sha256 {digest[:12]}... does not match the manifest {info['sha256'][:12]}..."
            )


# ----------------------------------------------------------------- the typed manifest
#
# A manifest on disk is JSON whose layout grew over time. `Manifest.from_json` is the one place that
# knows every older layout and migrates it to today's; everything else reads typed attributes.
# `to_json` writes today's layout with the keys in the order they were read (new keys last, as
# `dict.update` orders them), so reading and rewriting a current manifest reproduces its bytes.
# Keys this version does not know (written by a newer softsearch) are kept in `extra` and written
# back unchanged: dropping them would silently lose a newer writer's data on the next rewrite.

_ORDER = "key_order"
_EXTRA = "extra"


def _known(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in (_EXTRA, _ORDER))


def _from_layout(cls, data: dict):
    """An instance of the record dataclass `cls` from a dict already in today's layout."""
    names = set(_known(cls))
    return cls(
        **{k: v for k, v in data.items() if k in names},
        extra=MappingProxyType({k: v for k, v in data.items() if k not in names}),
        key_order=tuple(data),
    )


def _to_layout(record) -> dict:
    """The dict `record` was read from (keys in their order), with its current field values."""
    names = _known(type(record))
    out: dict = {}
    for key in record.key_order:
        if key in names:
            out[key] = getattr(record, key)
        elif key in record.extra:
            out[key] = record.extra[key]
    for key in names:  # set through dataclasses.replace without being in the original order
        if key not in out and getattr(record, key) is not None:
            out[key] = getattr(record, key)
    for key, value in record.extra.items():
        out.setdefault(key, value)
    return {k: _plain(v) for k, v in out.items()}


def _plain(value):
    """`value` as plain JSON data: records (anything with `to_json`) written out, containers copied."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


def _record(cls, value):
    """A stored JSON object as the record `cls` (None when it is not an object, as for a missing record)."""
    if isinstance(value, cls):
        return value
    return cls.from_json(value) if isinstance(value, dict) else None


class _Record:
    """A frozen record read from a JSON object: known keys are fields, the rest kept in `extra`, and `to_json`
    gives the object back with its keys in the order read (new keys last)."""

    @classmethod
    def from_json(cls, data: dict):
        return _from_layout(cls, _plain(dict(data)))

    def to_json(self) -> dict:
        return _to_layout(self)


def _positive(value) -> float | None:
    """`value` as a temperature: a finite positive number, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


@dataclasses.dataclass(frozen=True)
class CheckpointRef(_Record):
    """A version's ``checkpoint``: the encoder model it was built with -- its sha256, its place in the store
    (``models/<sha256>.safetensors``), where it came from (provenance only; None for a file inside the store)
    and the training step. An empty one (all None) stands for a version built from vectors."""

    sha256: str | None = None
    model: str | None = None
    path: str | None = None
    step: int | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class RecallRecord(_Record):
    """A version's ``recall``: recall@k of its FAISS index at the tuned search parameters, measured by the
    build's tuning on stored rows (`index.build.write_version`), and the target it was tuned to."""

    k: int | None = None
    recall: float | None = None
    exact: bool | None = None
    target: float | None = None
    param: str | None = None  # the tuned search knob (nprobe, efSearch), its value below
    value: Any = None
    reached: bool | None = None
    rerank: int | None = None
    latency_ms: float | None = None
    sample: int | None = None
    queries: str | None = None
    history: list | None = None
    note: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class RecallCheck(_Record):
    """The recall half of the activation rule (`index.gate.recall_check`), as the gate record's
    ``checks.recall`` stores it: recall@10 judged (`served`, measured on `measured_on`) against `target`."""

    name: ClassVar[str] = "recall"
    kind: str | None = None
    params: dict | None = None
    target: float | None = None
    tuned: float | None = None  # the build's tuning measurement
    served: float | None = None  # the figure judged (held-out when measured, else the tuning one)
    measured_on: str | None = None
    passed: bool | None = None  # None: nothing recorded
    message: str | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class GateScore(_Record):
    """The gate record's ``checks.score``: the evaluator's comparison with the version that was serving
    (a record older than the activation rule with no comparison holds only its verdict, `passed`)."""

    metric: str | None = None
    candidate: float | None = None
    serving: float | None = None
    margin: float | None = None
    serving_version: str | None = None
    passed: bool | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Compared(_Record):
    """One of the evaluator's figures for both versions the gate compared (``recall_at_10``,
    ``exact_recall_at_10``, ``index_recall``): the candidate's and the serving version's (None: none)."""

    candidate: Any = None
    serving: Any = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class GateChecks(_Record):
    """The gate record's ``checks``: what the activation rule reads."""

    score: GateScore | None = None  # None: nothing was compared
    recall: RecallCheck | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict) -> "GateChecks":
        data = _plain(dict(data))
        for key, record in (("score", GateScore), ("recall", RecallCheck)):
            if key in data:
                data[key] = _record(record, data[key])
        return _from_layout(cls, data)


@dataclasses.dataclass(frozen=True)
class GateRecord:
    """A version's ``quality_gate``: the quality gate's result as `index.gate.gate_record` writes it.

    ``checks`` holds what the activation rule reads: ``score`` (the comparison with the serving version,
    None when nothing was compared) and ``recall`` (`index.gate.recall_check`). The evaluator's own keys
    (`search.evaluation.quality.evaluate_version`: metric, candidate, serving, recall_at_10, ...) sit at
    the top level. Frozen; nested dicts are copies owned by the record -- treat them as read-only."""

    passed: bool | None = None
    forced: bool | None = None
    error: str | None = None
    note: str | None = None
    serving_version: str | None = None
    margin: float | None = None
    seconds: float | None = None
    checks: GateChecks | None = None
    metric: str | None = None
    candidate: float | None = None
    serving: float | None = None
    recall_at_10: Compared | None = None
    exact_recall_at_10: Compared | None = None
    index_recall: Compared | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict) -> "GateRecord":
        """Migrate a stored gate record to today's layout. Records written before the activation rule
        existed have no ``checks``: their comparison (metric, candidate, serving, margin) sits at the top
        level, or, with no comparison, their ``passed`` is the score check's verdict."""
        data = _plain(dict(data))
        if not isinstance(data.get("checks"), dict):
            if data.get("candidate") is not None and data.get("serving") is not None:
                score = {
                    "metric": data.get("metric", "score"),
                    "candidate": data["candidate"],
                    "serving": data["serving"],
                    "margin": data.get("margin"),
                    "serving_version": data.get("serving_version"),
                    "passed": data.get("passed"),
                }
            else:
                score = {"passed": data.get("passed")}
            data["checks"] = {"score": score, "recall": None}
        data["checks"] = GateChecks.from_json(data["checks"])
        for key in ("recall_at_10", "exact_recall_at_10", "index_recall"):
            if key in data:
                data[key] = _record(Compared, data[key])
        return _from_layout(cls, data)

    def to_json(self) -> dict:
        """The record in today's layout (keys in the order read)."""
        return _to_layout(self)

    @property
    def score(self) -> GateScore | None:
        """The comparison with the version that was serving (None: nothing was compared)."""
        return self.checks.score if self.checks is not None else None

    @property
    def recall(self) -> RecallCheck:
        """The recall check recorded by the gate (all None when none)."""
        recall = self.checks.recall if self.checks is not None else None
        return recall if recall is not None else RecallCheck()


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A version's manifest.json, typed and immutable (`dataclasses.replace` or `updated` give a changed
    copy). Build with `from_json` (migrates older layouts) or `create_manifest`; write with `to_json` /
    `write_manifest`. Nested dicts and lists are copies owned by the manifest -- treat them as read-only.

    Optional fields are None when a manifest lacks them; `extra` holds keys this version does not know."""

    format: str
    format_version: int
    version: str
    created: str
    count: int
    dim: int
    metric: str
    normalised: bool
    kind: str
    params: dict
    faiss_version: str
    files: dict
    timings: dict | None = None
    #: the encoder model; None when the version was built from vectors computed elsewhere
    checkpoint: CheckpointRef | None = None
    encoder: dict | None = None
    #: the first source's {"spec", "fingerprint"}
    dataset: dict | None = None
    #: every dataset that contributed rows: [{"spec", "fingerprint", "count", ...}]
    sources: list | None = None
    #: where vectors built with --embeddings came from (index/vectors.py source_record)
    source: dict | None = None
    lineage: dict | None = None
    search_temperature: float | None = None
    search_temperature_source: str | None = None
    skipped: list | None = None
    skipped_count: int | None = None
    world_size: int | None = None
    parent: str | None = None
    trained_on: int | None = None
    added: dict | None = None
    added_sources: list | None = None
    deleted: dict | None = None
    sync: dict | None = None
    recall: RecallRecord | None = None
    normaliser_stats: dict | None = None
    calibration: dict | None = None
    #: how a streamed build made the index (index/stream.py): {"streamed": true, "lists_file":
    #: "index.ivfdata", "train_rows", "chunk_rows"}; None for an index trained and filled in one call
    build: dict | None = None
    quality_gate: GateRecord | None = None
    #: a sharded version (index/shards.py): [{"name", "count", "offset", "kind", "params", "recall"}], one per
    #: shard directory; None for a version in one piece
    shards: list | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), repr=False)
    key_order: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    # ------------------------------------------------------------- reading and writing
    @classmethod
    def from_json(cls, data: dict, source: str | os.PathLike = "manifest") -> "Manifest":
        """Validate a manifest's JSON object and migrate every older layout to today's:

        * the flat encoder reference (``checkpoint`` a path string, ``checkpoint_path``,
          ``checkpoint_sha256``) becomes the ``checkpoint`` record {"sha256", "path"};
        * ``dataset`` stored as the bare dataset spec becomes {"spec": ...}; a manifest without
          ``sources`` (one dataset per version) gets ``[dataset]``; bare specs in ``sources`` too;
        * ``search_temperature`` stored as a {"temperature"|"tau": ...} record becomes the number,
          and the older ``calibrated_temperature`` becomes ``search_temperature``; a temperature that
          is not a finite positive number reads as None (the searcher's default applies);
        * ``quality_gate`` records without ``checks`` (GateRecord.from_json); a gate that is not a
          JSON object reads as None (no result recorded).
        IndexCorruptError (naming `source`) when required fields are missing or describe an index
        this version cannot serve."""
        if not isinstance(data, dict):
            raise IndexCorruptError(f"{source} does not hold a JSON object")
        missing = [f for f in REQUIRED_FIELDS if f not in data]
        if missing:
            raise IndexCorruptError(f"{source} lacks required fields {missing}")
        if data["format"] != FORMAT:
            raise IndexCorruptError(f"{source} has format {data['format']!r}, expected {FORMAT!r}")
        if data["format_version"] > FORMAT_VERSION:
            raise IndexCorruptError(
                f"{source} has format_version {data['format_version']}, newer than {FORMAT_VERSION}"
            )
        if data["metric"] != "inner_product" or data["normalised"] is not True:
            raise IndexCorruptError(f"{source}: only normalised inner-product indexes are supported")
        data = _migrate(_plain(data))
        for key, record in (
            ("quality_gate", GateRecord),
            ("checkpoint", CheckpointRef),
            ("recall", RecallRecord),
        ):
            if key in data:
                data[key] = _record(record, data[key])
        return _from_layout(cls, data)

    def to_json(self) -> dict:
        """Today's layout as a fresh dict, keys in the order read (what `write_manifest` stores)."""
        return _to_layout(self)

    def updated(self, **fields) -> "Manifest":
        """A copy with `fields` set: known keys keep their place, new ones go last (as `dict.update`)."""
        data = self.to_json()
        data.update(fields)
        return Manifest.from_json(data)

    def carried(self, *names: str) -> dict:
        """{name: value} of the named fields this manifest records (as written), for a derived
        version that carries them over (add, sync, delete)."""
        data = self.to_json()
        return {k: data[k] for k in names if k in data}

    # ------------------------------------------------------------- derived readings
    @property
    def temperature(self) -> float | None:
        """The version's search temperature (a finite positive number), None when none is recorded."""
        return _positive(self.search_temperature)

    @property
    def checkpoint_record(self) -> CheckpointRef:
        """The encoder reference; an empty one (sha256 and path None) for a version built from vectors."""
        return self.checkpoint if self.checkpoint is not None else CheckpointRef()

    @property
    def has_encoder(self) -> bool:
        """False for a version built from vectors computed elsewhere (`index build --embeddings`,
        ``checkpoint: null``): it names no encoder model, so only vector queries can search it."""
        record = self.checkpoint_record
        return bool(record.sha256 or record.path)

    @property
    def source_specs(self) -> list[dict]:
        """The dataset spec of every source, in build order."""
        return [src["spec"] for src in self.sources or []]


def _migrate(data: dict) -> dict:
    """An older layout's JSON object (a private copy) in today's layout; key order kept where a key stays."""
    # the encoder reference: a flat path string / checkpoint_path + checkpoint_sha256 before the record
    ck = data.get("checkpoint")
    if not isinstance(ck, dict) and (ck or "checkpoint_path" in data or "checkpoint_sha256" in data):
        record = {"sha256": data.get("checkpoint_sha256"), "path": ck or data.get("checkpoint_path")}
        data = _replace_keys(data, "checkpoint", record, drop=("checkpoint_path", "checkpoint_sha256"))
    # datasets: the oldest versions stored the bare spec as `dataset` and had no `sources`
    one = data.get("dataset")
    if isinstance(one, dict) and not isinstance(one.get("spec"), dict) and "name" in one:
        data["dataset"] = one = {"spec": one}
    if "sources" in data or isinstance(one, dict):
        sources = data.get("sources") or ([one] if isinstance(one, dict) else [])
        fixed = [
            src if isinstance(src.get("spec"), dict) else {"spec": src}
            for src in sources
            if isinstance(src, dict) and (isinstance(src.get("spec"), dict) or "name" in src)
        ]
        if "sources" not in data or fixed != data["sources"]:
            data["sources"] = fixed
    # the search temperature: a number now; earlier a {"temperature"|"tau"} record or `calibrated_temperature`
    if "search_temperature" in data or "calibrated_temperature" in data:
        value = None
        for key in ("search_temperature", "calibrated_temperature"):
            raw = data.get(key)
            if isinstance(raw, dict):
                raw = raw.get("temperature", raw.get("tau"))
            if _positive(raw) is not None:
                value = raw
                break
        if "calibrated_temperature" in data or isinstance(data.get("search_temperature"), dict):
            data = _replace_keys(data, "search_temperature", value, drop=("calibrated_temperature",))
    return data


def _replace_keys(data: dict, key: str, value, drop: tuple[str, ...]) -> dict:
    """`data` with `key` set to `value` (at its own place, else where the first of `drop` was, else
    last) and the keys in `drop` removed."""
    anchor = key if key in data else next((d for d in drop if d in data), None)
    out: dict = {}
    for k, v in data.items():
        if k == anchor:
            out[key] = value
        elif k not in drop and k != key:
            out[k] = v
    out.setdefault(key, value)
    return out
