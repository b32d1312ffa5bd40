"""Encoder weights inside the index store, content-addressed: ``R/models/<sha256>.safetensors``.

A version's manifest names its encoder by the sha256 of the checkpoint file
(``Manifest.checkpoint = {"sha256", "model": "models/<sha256>.safetensors", "path", "step"}``;
``path`` only says where the weights came from). The file is written once and shared by every
version that uses it, so a store root copied to another machine (``cp -a``, rsync, ``index
export`` / ``import``) serves, evaluates and grows without the training run directory. Every
load recomputes the hash (remembered per file identity within a process).

Stores written before this layout name only ``checkpoint.path``: on first use the file at that
path is copied in when its sha256 still matches (migration); when it is gone the error says
which file to copy where.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from index.disk import writing
from index.manifest import CheckpointRef, IndexCorruptError, file_sha256, fsync_dir

logger = logging.getLogger(__name__)

MODELS_DIR = "models"
MODEL_SUFFIX = ".safetensors"
DEFAULT_GRACE_S = 3600.0  # prune keeps models this young: a build in progress may be about to use one
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
# (path, inode, size, mtime_ns) -> sha256 of files this process already hashed
_VERIFIED: dict[tuple, str] = {}


def check_sha(sha: str) -> str:
    """A model's name is exactly 64 lowercase hex digits (a sha256); anything else could escape models/."""
    if not isinstance(sha, str) or not _SHA_RE.match(sha):
        raise ValueError(f"invalid model sha256 {sha!r}")
    return sha


def model_relpath(sha: str) -> str:
    """Where a model lives relative to the store root (what manifests record)."""
    return f"{MODELS_DIR}/{check_sha(sha)}{MODEL_SUFFIX}"


def is_store_model(path: str | os.PathLike) -> bool:
    """True for a file inside some store's models/ directory (its path says nothing about provenance)."""
    path = Path(path)
    return (
        path.parent.name == MODELS_DIR
        and path.name.endswith(MODEL_SUFFIX)
        and bool(_SHA_RE.match(path.name[: -len(MODEL_SUFFIX)]))
    )


#: an import stages the archive's own layout in ``root/staging/import-<id>/`` (index/transfer.py)
IMPORT_STAGING_PREFIX = "import-"


def _staged_import(path: Path) -> bool:
    """Is `path` a version an import is staging (``root/staging/import-<id>/versions/<v>``)?"""
    work = path.parent.parent
    return (
        path.parent.name == "versions"
        and work.name.startswith(IMPORT_STAGING_PREFIX)
        and work.parent.name == "staging"
    )


def store_root_of(version_path: str | os.PathLike) -> Path:
    """The store root above a version directory: ``root/versions/<v>``, ``root/staging/<v>`` (a build), or
    ``root/staging/import-<id>/versions/<v>`` (an import, whose model is already in ``root/models``)."""
    path = Path(version_path)
    if path.parent.name not in ("versions", "staging"):
        raise ValueError(f"{path} is not a version directory inside an index store (root/versions/<version>)")
    if _staged_import(path):
        return path.parent.parent.parent.parent
    return path.parent.parent


def _sha_of(path: Path) -> str:
    """sha256 of a file, remembered per (path, inode, size, mtime) so repeated loads do not rehash."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    sha = _VERIFIED.get(key)
    if sha is None:
        sha = _VERIFIED[key] = file_sha256(path)
    return sha


class ModelStore:
    """The ``models/`` directory of an index store."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.dir = self.root / MODELS_DIR

    def path(self, sha: str) -> Path:
        return self.dir / f"{check_sha(sha)}{MODEL_SUFFIX}"

    def has(self, sha: str) -> bool:
        return self.path(sha).is_file()

    def shas(self) -> list[str]:
        """Every stored model's sha256, sorted."""
        if not self.dir.is_dir():
            return []
        return sorted(
            p.name[: -len(MODEL_SUFFIX)]
            for p in self.dir.iterdir()
            if p.name.endswith(MODEL_SUFFIX) and _SHA_RE.match(p.name[: -len(MODEL_SUFFIX)])
        )

    # ------------------------------------------------------------------ writing
    def _install(self, tmp: Path, sha: str) -> Path:
        """Move a fully written temp file to models/<sha>.safetensors (dropped if that exists and is
        intact)."""
        target = self.path(sha)
        if target.is_file() and _sha_of(target) == sha:
            tmp.unlink(missing_ok=True)
            os.utime(target)  # fresh mtime: prune's grace period protects a model a build just asked for
            return target
        os.replace(tmp, target)
        fsync_dir(self.dir)
        logger.info("stored encoder model %s", target)
        return target

    def _tmp(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".incoming-", suffix=MODEL_SUFFIX, dir=self.dir)
        os.close(fd)
        return Path(tmp)

    def add_file(self, checkpoint: str | os.PathLike, sha: str | None = None) -> str:
        """Copy a checkpoint file into the store (once); returns its sha256.

        With `sha` given (already computed by the caller), a present model is only touched.
        """
        checkpoint = Path(checkpoint)
        if not checkpoint.is_file():
            raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
        sha = sha or _sha_of(checkpoint)
        target = self.path(sha)
        if target.is_file() and (target.resolve() == checkpoint.resolve() or _sha_of(target) == sha):
            os.utime(target)
            return sha
        tmp = self._tmp()
        try:
            with writing(target, needed=checkpoint.stat().st_size):
                shutil.copyfile(checkpoint, tmp)
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
            copied = file_sha256(tmp)
            if copied != sha:
                raise ValueError(
                    f"checkpoint {checkpoint} changed while it was copied into the store "
                    f"(sha256 {copied[:12]} != {sha[:12]})"
                )
            self._install(tmp, sha)
        finally:
            tmp.unlink(missing_ok=True)
        return sha

    def adopt(self, path: str | os.PathLike, sha: str) -> Path:
        """Move a file (same filesystem, e.g. staging/) into the store as models/<sha>; its content must hash
        to `sha`."""
        path = Path(path)
        actual = file_sha256(path)
        if actual != check_sha(sha):
            raise IndexCorruptError(
                f"{path} hashes to {actual[:12]}..., not the {sha[:12]}... it is named after"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        return self._install(path, sha)

    def ensure(self, sha: str, source: str | os.PathLike | None = None) -> Path:
        """Make sure models/<sha> is present (touched, or copied from `source`) just before a commit."""
        target = self.path(sha)
        if target.is_file():
            os.utime(target)
            return target
        if source is None:
            raise FileNotFoundError(
                f"encoder model {target} disappeared during the build (pruned?); rerun it"
            )
        self.add_file(source, sha)
        return target

    def add_encoder(
        self,
        encoder,
        *,
        step: int = 0,
        train_config: dict | None = None,
        lineage: dict | None = None,
        metrics: dict | None = None,
    ) -> str:
        """Save an in-memory encoder as a softsearch checkpoint straight into the store; returns its
        sha256."""
        from training.checkpoint import save_checkpoint

        tmp = self._tmp()
        try:
            save_checkpoint(
                tmp,
                encoder,
                step=step,
                train_config=train_config or {},
                lineage=lineage or {},
                metrics=metrics,
            )
            sha = file_sha256(tmp)
            self._install(tmp, sha)
        finally:
            tmp.unlink(missing_ok=True)
        return sha

    # ------------------------------------------------------------------ reading
    def resolve(self, record: CheckpointRef, version: str = "?", migrate: bool = True) -> Path:
        """The verified model file a manifest's checkpoint record names (migrating an old store on first use).

        Raises FileNotFoundError saying what to copy where when neither the store nor the recorded
        checkpoint path holds those weights, IndexCorruptError when the stored file is damaged.
        `migrate=False` reads only the store's own file (by its sha256), never the recorded path:
        an imported version's path names a file on the machine that exported it.
        """
        sha = record.sha256
        if not sha:
            raise ValueError(
                f"index version {version} names no encoder sha256; rebuild it with 'index rebuild'"
            )
        check_sha(sha)
        target = self.path(sha)
        if not migrate:
            if not target.is_file():
                raise FileNotFoundError(
                    f"index version {version} needs encoder model {sha[:12]}..., which is not in "
                    f"{self.dir}; import the archive again"
                )
            actual = _sha_of(target)
            if actual != sha:
                raise IndexCorruptError(
                    f"{target} is damaged (sha256 {actual[:12]}... != {sha[:12]}...); import the "
                    "archive again"
                )
            return target
        source = record.path

        def source_ok() -> bool:
            return bool(source) and Path(source).is_file() and _sha_of(Path(source)) == sha

        if target.is_file():
            actual = _sha_of(target)
            if actual == sha:
                return target
            if not source_ok():
                raise IndexCorruptError(
                    f"{target} is damaged (sha256 {actual[:12]}... != {sha[:12]}...); restore it "
                    f"from the original checkpoint or re-import the version"
                )
            logger.warning("%s is damaged; restoring it from %s", target, source)
        elif not source_ok():
            where = (
                f"the checkpoint it was built with ({source}) is gone or changed"
                if source
                else "no source is recorded"
            )
            raise FileNotFoundError(
                f"index version {version} needs encoder model {sha[:12]}..., which is not in {self.dir} "
                f"and {where}; copy that checkpoint file to {target} (any file with sha256 {sha}), or run "
                f"'softsearch index rebuild --root {self.root} --checkpoint C'"
            )
        else:
            logger.info("migrating index store %s: copying encoder %s into %s", self.root, source, self.dir)
        self.add_file(source, sha)
        return target

    def load_encoder(self, record: CheckpointRef, device="cpu", version: str = "?", migrate: bool = True):
        """(encoder, checkpoint metadata, sha256) of a manifest's checkpoint record, from the store."""
        from training.checkpoint import load_checkpoint

        path = self.resolve(record, version, migrate=migrate)
        encoder, info = load_checkpoint(path, device=device)
        return encoder, info, record.sha256

    def remove_unused(self, used: set[str], grace_s: float = DEFAULT_GRACE_S) -> list[str]:
        """Delete models no version uses (older than `grace_s`, so a build in progress keeps its own)."""
        removed = []
        now = time.time()
        for sha in self.shas():
            path = self.path(sha)
            if sha in used or now - path.stat().st_mtime < grace_s:
                continue
            path.unlink(missing_ok=True)
            removed.append(sha)
        for tmp in self.dir.glob(".incoming-*") if self.dir.is_dir() else ():
            if now - tmp.stat().st_mtime > max(grace_s, 60.0):
                tmp.unlink(missing_ok=True)  # left by a killed writer
        if removed:
            fsync_dir(self.dir)
            logger.info(
                "removed %d unused encoder model(s): %s", len(removed), ", ".join(s[:12] for s in removed)
            )
        return removed


def load_version_encoder(version, device="cpu"):
    """(encoder, checkpoint metadata, sha256) for a loaded IndexVersion, from its store's models/.

    A version an import is staging reads the model the import moved into the store, by its sha256 only
    (never the training path its manifest records: that names a file on the exporting machine)."""
    store = ModelStore(store_root_of(version.path))
    return store.load_encoder(
        version.manifest.checkpoint_record,
        device=device,
        version=version.version,
        migrate=not _staged_import(Path(version.path)),
    )


ENCODER_SCHEMES = ("open_clip",)


def parse_encoder_spec(spec: str) -> str:
    """'open_clip:ViT-B-32' -> 'ViT-B-32' (the only scheme: a named open_clip model)."""
    scheme, sep, name = str(spec).partition(":")
    if not sep or scheme not in ENCODER_SCHEMES or not name:
        raise ValueError(f"bad --encoder {spec!r}; expected open_clip:MODEL_NAME, e.g. open_clip:ViT-B-32")
    return name


def save_pretrained_checkpoint(
    directory: str | os.PathLike,
    model_name: str,
    pretrained: str | os.PathLike,
    *,
    image_size: int | None = None,
    image_mean=None,
    image_std=None,
) -> Path:
    """A named open_clip model with local weights, saved as a softsearch checkpoint in `directory`.

    Weights load through open_clip's own `pretrained=` path (never downloaded); image size, mean
    and std default to the model's own preprocessing. The lineage records the source file's
    sha256 and the CLIP model's temperature 1 / exp(logit_scale), which becomes the index's
    training temperature (before calibration).
    """
    from training.encoder import EncoderConfig, create_encoder

    pretrained = Path(pretrained)
    if not pretrained.is_file():
        raise FileNotFoundError(
            f"--pretrained {pretrained} is not a local file (weights are never downloaded)"
        )
    encoder = create_encoder(
        EncoderConfig(
            model_name=model_name,
            pretrained=str(pretrained.resolve()),
            image_size=image_size,
            image_mean=image_mean,
            image_std=image_std,
        )
    )
    text = _pretrained_text_tower(model_name, pretrained.resolve(), encoder.embed_dim)
    lineage = {
        "objective": "none (pretrained open_clip weights, not trained here)",
        "pretrained": {
            "model_name": model_name,
            "file": str(pretrained.resolve()),
            "sha256": file_sha256(pretrained),
        },
    }
    if encoder.clip_temperature:
        lineage["temperature"] = encoder.clip_temperature
    Path(directory).mkdir(parents=True, exist_ok=True)
    from training.checkpoint import save_checkpoint

    path = Path(directory) / f"pretrained-{os.getpid()}-{time.time_ns()}{MODEL_SUFFIX}"
    with writing(path, needed=sum(t.numel() * t.element_size() for t in encoder.state_dict().values())):
        save_checkpoint(
            path,
            encoder,
            step=0,
            train_config={"pretrained": lineage["pretrained"]},
            lineage=lineage,
            text_encoder=text,
        )
    return path


def _pretrained_text_tower(model_name: str, pretrained: Path, embed_dim: int):
    """The text tower of the same weights file (training/text.py), None when the model has no usable one."""
    import open_clip

    from training.text import TextConfig, TextEncoder

    model = open_clip.create_model(
        model_name, pretrained=str(pretrained), pretrained_image=False, pretrained_text=False
    )
    try:
        text = TextEncoder(TextConfig(model_name=model_name), embed_dim, clip_model=model)
    except (AttributeError, TypeError) as err:  # e.g. a model without a text transformer
        logger.warning("open_clip model %s: no text tower kept (%s)", model_name, err)
        return None
    probe = text.encode(["a photo"])
    if probe.shape[1] != embed_dim:
        logger.warning(
            "open_clip model %s: its text tower embeds to %d dims, the image tower to %d; not kept",
            model_name,
            probe.shape[1],
            embed_dim,
        )
        return None
    return text
