"""Ship one index version to another store: `export_version` writes a tar archive, `import_version` reads it.

Archive layout (plain tar, or gzip when the name ends in .gz / .tgz)::

    softsearch-export.json                 {"format", "format_version", "version", "model", "created",
                                            "files": {member: {"sha256", "bytes"}}}
    versions/<version>/manifest.json, index.faiss, embeddings.npy, ids.json, ...
    models/<sha256>.safetensors            the encoder weights the version names

Import trusts nothing in the archive. The export index must come first; its stated sizes are held
to a total limit (`max_bytes`, DEFAULT_MAX_IMPORT_BYTES), to a compression ratio over the archive
file's size (`max_ratio`, DEFAULT_MAX_RATIO) and to the free space on the store's filesystem before
anything is read further (or the store created). Then every tar header is checked as it is met, before
the member's data is decompressed: only regular files at exactly the listed paths, each with the
size the index states (absolute paths, `..`, links, devices, unlisted members and a header that
disagrees with its stated size are refused before anything is written). The version manifest is
staged first and must list the same sizes and checksums as the export index; then each member is
streamed into staging while its bytes are counted (stopping at the first byte past its stated
size) and its sha256 computed, with the free space checked before each member. The version is
then checked against its own manifest and the model against its name, and becomes current only
through the quality gate (or `force`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tarfile
import time
import uuid
import zlib
from pathlib import Path, PurePosixPath

from index.commit import Staged
from index.commit import commit as commit_staged
from index.disk import DiskFull, format_bytes, free_bytes, on_disk, writing
from index.gate import ActivationRefused, GateUnavailable, gate_for
from index.manifest import MANIFEST_NAME, IndexCorruptError, fsync_dir, read_manifest, utc_now, verify_files
from index.models import IMPORT_STAGING_PREFIX, check_sha, model_relpath
from index.options import CommitOptions
from index.store import IndexStore, VersionExists, check_version_name

logger = logging.getLogger(__name__)

EXPORT_FORMAT = "softsearch-index-export"
EXPORT_FORMAT_VERSION = 1
EXPORT_INDEX = "softsearch-export.json"
MAX_INDEX_BYTES = 1 << 20
#: the most bytes an import writes unless told otherwise (`index import --max-bytes`): a version of
#: 10 million 512-d float32 embeddings with its index and model is about 41 GB
DEFAULT_MAX_IMPORT_BYTES = 64 << 30
#: the most bytes an import writes per byte of archive unless told otherwise (`index import --max-ratio`;
#: 0: no limit): exports measure 1.2:1 gzip (float32 embeddings, index and weights barely compress) and
#: under 1:1 plain tar, while gzip reaches about 1000:1 on zeros
DEFAULT_MAX_RATIO = 20.0
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _compression(path: Path) -> str:
    return "gz" if path.name.endswith((".gz", ".tgz")) else ""


def export_version(root, out, version: str | None = None) -> Path:
    """Write `version` (default: current) of the store at `root` and its encoder model to the archive `out`.

    Every file is verified against its checksum first, so a damaged version is never shipped.
    The archive is written beside `out` and renamed into place (no half-written archive).
    """
    store = IndexStore(root)
    version = version or store.current_version()
    if version is None:
        raise FileNotFoundError(f"no current index version under {root} to export; name one with --version")
    loaded = store.load(version, verify=True, gpu=False)
    record = loaded.manifest.checkpoint_record
    if not record.sha256:
        raise ValueError(
            f"index version {version} was built from vectors (--embeddings) and has no encoder model: "
            "export does not support it; copy the store root or build it again from the vectors"
        )
    model = store.models.resolve(record, version)
    members: dict[str, Path] = {f"versions/{version}/{MANIFEST_NAME}": loaded.path / MANIFEST_NAME}
    for name in loaded.manifest.files:
        members[f"versions/{version}/{name}"] = loaded.path / name
    members[model_relpath(record.sha256)] = model
    index = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_FORMAT_VERSION,
        "version": version,
        "model": record.sha256,
        "created": utc_now(),
        "count": loaded.manifest.count,
        "files": {name: _describe(path) for name, path in members.items()},
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with (
            writing(out, needed=sum(f["bytes"] for f in index["files"].values())),
            tarfile.open(tmp, f"w:{_compression(out)}", format=tarfile.PAX_FORMAT) as tar,
        ):
            data = (json.dumps(index, indent=2) + "\n").encode()
            info = _tar_info(EXPORT_INDEX, len(data))
            tar.addfile(info, io.BytesIO(data))
            for name, path in members.items():
                with open(path, "rb") as fh:
                    tar.addfile(_tar_info(name, path.stat().st_size), fh)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(out.parent)
    logger.info("exported index version %s (%d files) to %s", version, len(members), out)
    return out


def _describe(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o644, int(time.time()), tarfile.REGTYPE
    return info


# ----------------------------------------------------------------------------- import


_SHARD_RE = re.compile(r"^shard-[0-9]{3,}$")


def _allowed(name: str, version: str, model: str) -> bool:
    """Exactly the paths an export writes: the index, versions/<version>/<file>,
    models/<model>.safetensors."""
    if name == EXPORT_INDEX or name == model_relpath(model):
        return True
    parts = PurePosixPath(name).parts
    if len(parts) == 4 and _SHARD_RE.match(parts[2]):  # a sharded version's shard directory (index/shards.py)
        parts = (*parts[:2], parts[3])
    return len(parts) == 3 and parts[:2] == ("versions", version) and bool(_FILE_NAME_RE.match(parts[2]))


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuse anything but a regular file at a relative path without '..' (before any byte is written)."""
    name = member.name
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith(("/", "\\")) or "\\" in name:
        raise ValueError(f"archive member {name!r} has an absolute path; refused")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise ValueError(f"archive member {name!r} escapes the store ('..' or empty path parts); refused")
    if member.issym() or member.islnk():
        raise ValueError(f"archive member {name!r} is a link (to {member.linkname!r}); refused")
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        raise ValueError(f"archive member {name!r} is not a regular file; refused")


def _read_index(tar: tarfile.TarFile, info: tarfile.TarInfo | None) -> dict:
    """The export index, which must be the archive's first member (so sizes are known before any data)."""
    if info is None or info.name != EXPORT_INDEX:
        raise ValueError(f"not a softsearch index export: {EXPORT_INDEX} is not its first member")
    _check_member(info)
    if info.size > MAX_INDEX_BYTES:
        raise ValueError(f"{EXPORT_INDEX} is {info.size} bytes; refusing more than {MAX_INDEX_BYTES}")
    try:
        index = json.loads(tar.extractfile(info).read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{EXPORT_INDEX} is not valid JSON ({err})") from err
    if not isinstance(index, dict) or index.get("format") != EXPORT_FORMAT:
        raise ValueError(
            f"not a softsearch index export ({EXPORT_INDEX} has format "
            f"{index.get('format') if isinstance(index, dict) else None!r})"
        )
    if not isinstance(index.get("format_version"), int) or index["format_version"] > EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"export format_version {index.get('format_version')!r} is newer than {EXPORT_FORMAT_VERSION}"
        )
    check_version_name(index.get("version"))
    check_sha(index.get("model"))
    files = index.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and {"sha256", "bytes"} <= set(v) and type(v["bytes"]) is int and v["bytes"] >= 0
        for v in files.values()
    ):
        raise ValueError(f"{EXPORT_INDEX} lists no valid files (each needs a sha256 and a byte count >= 0)")
    return index


def _check_space(
    index: dict,
    work: Path,
    max_bytes: int | None,
    archive_bytes: int | None = None,
    max_ratio: float | None = None,
) -> int:
    """The bytes the import will write (on disk, whole blocks), refused before any is written when over
    `max_bytes` or over `max_ratio` times the archive's `archive_bytes` (ValueError), or over the free
    space on the store's filesystem (DiskFull)."""
    stated = sum(f["bytes"] for f in index["files"].values())
    if max_bytes is not None and stated > max_bytes:
        raise ValueError(
            f"the archive states {stated} bytes ({format_bytes(stated)}), over the import limit of "
            f"{max_bytes} ({format_bytes(max_bytes)}); raise it with --max-bytes if it is expected"
        )
    if max_ratio and archive_bytes is not None and stated > max_ratio * max(archive_bytes, 1):
        raise ValueError(
            f"the archive states {stated} bytes ({format_bytes(stated)}) from {archive_bytes} "
            f"({format_bytes(archive_bytes)}) on disk, a compression ratio of "
            f"{stated / max(archive_bytes, 1):.0f}:1, over the import limit of {max_ratio:g}:1; "
            "raise it with --max-ratio if it is expected"
        )
    needed = sum(on_disk(f["bytes"]) for f in index["files"].values())
    free = free_bytes(work)
    if free is not None and free < needed:
        raise DiskFull(work, needed)
    return needed


def _read_headers(tar: tarfile.TarFile, index: dict) -> dict[str, tarfile.TarInfo]:
    """Every member after the export index, each header checked as it is read -- before tarfile
    decompresses its way past that member's data -- against the layout and its stated size."""
    version, model, files = index["version"], index["model"], index["files"]
    members: dict[str, tarfile.TarInfo] = {}
    while True:
        member = tar.next()
        if member is None:
            return members
        _check_member(member)
        name = member.name
        if name in members or name == EXPORT_INDEX:
            raise ValueError(f"archive member {name!r} appears twice; refused")
        if not _allowed(name, version, model):
            raise ValueError(f"archive members outside the export layout refused: [{name!r}]")
        if name not in files:
            raise ValueError(f"archive does not match its export index (unlisted {name!r})")
        if member.size != files[name]["bytes"]:
            raise ValueError(
                f"archive member {name} has {member.size} bytes, the export index says "
                f"{files[name]['bytes']}; refused before writing it"
            )
        members[name] = member


def extract_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, expected: dict, target: Path, needed: int | None = None
) -> None:
    """Stream one member to `target`, counting and hashing as it goes; ValueError at the first byte past
    its stated size or on a checksum mismatch, DiskFull (naming `needed`, the import's bytes) when the disk
    fills."""
    limit = expected["bytes"]
    digest = hashlib.sha256()
    source = tar.extractfile(member)
    written = 0
    with writing(target, needed):
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            for chunk in iter(lambda: source.read(min(1 << 20, limit - written + 1)), b""):  # noqa: B023 (reads the running count on purpose)
                written += len(chunk)
                if written > limit:
                    raise ValueError(
                        f"archive member {member.name} is larger than the {limit} bytes its export "
                        "index states; refused"
                    )
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    if written != limit:
        raise ValueError(f"archive member {member.name} has {written} bytes, the export index says {limit}")
    if digest.hexdigest() != expected["sha256"]:
        raise ValueError(
            f"archive member {member.name} fails its checksum (sha256 {digest.hexdigest()[:12]}... != "
            f"{expected['sha256'][:12]}...); the archive is damaged"
        )


def _check_manifest_files(path: Path, version: str, files: dict) -> None:
    """The staged version manifest must list exactly the version's files the export index states."""
    listed = read_manifest(path.parent).files  # IndexCorruptError when it is not a valid manifest
    prefix = f"versions/{version}/"
    stated = {
        n[len(prefix) :]: files[n] for n in files if n.startswith(prefix) and n != prefix + MANIFEST_NAME
    }
    if not isinstance(listed, dict) or {
        n: (v.get("bytes"), v.get("sha256")) for n, v in listed.items() if isinstance(v, dict)
    } != {n: (v["bytes"], v["sha256"]) for n, v in stated.items()}:
        raise ValueError(
            "the version manifest in the archive lists other files or sizes than its export index; refused"
        )


def import_version(
    root,
    archive,
    *,
    commit: CommitOptions | None = None,
    max_bytes: int | None = DEFAULT_MAX_IMPORT_BYTES,
    max_ratio: float | None = DEFAULT_MAX_RATIO,
) -> tuple[str, bool]:
    """Import an exported version into the store at `root` -> (version, whether it was already there).

    At most `max_bytes` are written, and at most `max_ratio` bytes per byte of the archive file (None or
    0: no limit but the free space); see the module docstring for what is checked, and when. An archive
    refused by these checks leaves nothing behind (not even an empty store at a new `root`).

    The version is committed, then activated only if the quality gate passes against the serving
    version (or `force`). When the gate cannot run here (for example the version's dataset is
    not on this machine) the version is committed but not activated, unless `force`. A rerun after
    a kill between the commit and the activation finishes that activation (the gate result the
    first run recorded decides), so an import is rerunnable at any point.
    """
    commit = commit or CommitOptions()
    commit.check()
    archive = Path(archive)
    if not archive.is_file():
        raise FileNotFoundError(f"archive not found: {archive}")
    if max_ratio is not None and not max_ratio >= 0:
        raise ValueError(f"the compression-ratio limit must be >= 0 (0: none), got {max_ratio}")
    store = IndexStore(root)
    # created only once the archive's stated sizes passed (a refused archive leaves nothing behind)
    work = store.staging_dir / f"{IMPORT_STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
    try:
        try:
            tar = tarfile.open(archive, "r:*")
        except (tarfile.TarError, OSError, EOFError) as err:
            reason = str(err).splitlines()[0].rstrip(":")
            raise ValueError(f"{archive} is not a tar archive ({reason})") from err
        with tar:
            try:
                index = _read_index(tar, tar.next())
                version, model = index["version"], index["model"]
                needed = _check_space(index, work, max_bytes, archive.stat().st_size, max_ratio)
                store.ensure()
                work.mkdir()
                members = _read_headers(tar, index)
            except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
                if isinstance(err, DiskFull):
                    raise
                raise ValueError(f"{archive} is damaged or truncated ({str(err).splitlines()[0]})") from err
            listed_files = set(index["files"])
            if set(members) != listed_files:
                missing = sorted(listed_files - set(members))
                raise ValueError(f"archive does not match its export index (missing {missing[:5]})")
            manifest_name = f"versions/{version}/{MANIFEST_NAME}"
            if model_relpath(model) not in listed_files or manifest_name not in listed_files:
                raise ValueError("archive lacks the version manifest or the encoder model")
            if members[manifest_name].size > MAX_INDEX_BYTES:
                raise ValueError(
                    f"{manifest_name} is {members[manifest_name].size} bytes; refusing more than "
                    f"{MAX_INDEX_BYTES}"
                )
            # the manifest first: the files it lists must be the ones the export index states, byte for byte
            order = [manifest_name] + [n for n in members if n != manifest_name]
            remaining = needed  # bytes still to write; the disk may have filled since _check_space
            for name in order:
                free = free_bytes(work)
                if free is not None and free < remaining:
                    raise DiskFull(work / name, needed)
                remaining -= on_disk(index["files"][name]["bytes"])
                try:
                    extract_member(tar, members[name], index["files"][name], work / name, needed)
                except (tarfile.TarError, EOFError, zlib.error) as err:
                    raise ValueError(f"{archive} is damaged or truncated at {name} ({err})") from err
                if name == manifest_name:
                    _check_manifest_files(work / name, version, index["files"])
        staged = work / "versions" / version
        manifest = read_manifest(staged)
        verify_files(staged, manifest)
        named = manifest.checkpoint_record.sha256
        if manifest.version != version or named != model:
            raise IndexCorruptError(
                f"{archive}: the manifest names version {manifest.version} / model "
                f"{named}, the export index {version} / {model}"
            )
        store.models.adopt(work / model_relpath(model), model)
        if version not in store.versions():
            # gated and committed from this import's own staging directory: the commit's rename, under the
            # store lock, decides between concurrent imports of one archive (the loser goes on below)
            try:
                _activate_imported(store, version, staged, commit)
                return version, False
            except VersionExists:
                logger.info("a concurrent import committed index version %s first", version)
        if store.manifest(version).files != manifest.files:
            raise ValueError(f"a different index version named {version} already exists under {root}")
        logger.info("index version %s is already in %s", version, root)
        if commit.activate and store.current_version() != version:
            # committed by a run killed before its activation, a concurrent import, or activate=False
            _activate_imported(store, version, None, commit)
        return version, True
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _activate_imported(store: IndexStore, version: str, staging: Path | None, options: CommitOptions) -> None:
    """Gate, commit and activate an imported version (`staging` None: already committed, activate it,
    through the gate result recorded at its commit). When the gate cannot score it here, that is
    recorded in its manifest (so a plain 'index activate' refuses it too) and it is not activated
    unless `force`."""
    evaluator = options.evaluator

    def guarded(candidate, serving):
        try:
            return evaluator(candidate, serving)
        except (ValueError, FileNotFoundError, OSError) as err:
            raise GateUnavailable(str(err)) from err

    try:
        if staging is not None:
            commit_staged(
                store,
                Staged(version, staging),
                dataclasses.replace(options, evaluator=None if evaluator is None else guarded),
                path="index import",
            )
        else:
            gate = gate_for(store, None if evaluator is None else guarded, options.margin)
            store.activate(version, force=options.force, path="index import", gate=gate)
            if options.keep is not None:
                store.prune(options.keep)
    except ActivationRefused as err:
        gate = store.manifest(version).quality_gate
        error = gate.error if gate is not None else None
        if not error:
            raise
        raise ActivationRefused(
            version,
            err.failed,
            hint=f"imported {version} but did not activate it; activate it "
            f"with 'softsearch index activate {version} --force --root {store.root}'",
        ) from None
