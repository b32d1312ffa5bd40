"""Self-describing checkpoints in safetensors format; loading never unpickles.

`checkpoint.safetensors`: encoder weights + one metadata entry `"softsearch"` holding JSON
`{"format", "version", "encoder", "step", "train_config", "lineage", "metrics"}`.

`train_state.safetensors` (resume): optimizer state flattened into tensors
(`optim.state.<param index>.<key>`), schedule and loss state (`schedule.<name>`, `loss.<name>`,
e.g. a learnable temperature and WEINCE's EMA buffers), RNG states as uint8
tensors (`rng.<name>`), and JSON metadata (param_groups, non-tensor optimizer state, step,
numpy/python RNG states, free-form extras).

All writes are atomic: a temporary file in the same directory, then `os.replace`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from training.encoder import Encoder, create_encoder, encoder_config_from_dict
from training.transforms import MEAN, STD

logger = logging.getLogger(__name__)

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint_metadata",
    "checkpoint_sha256",
    "config_hash",
    "save_train_state",
    "load_train_state",
    "TrainState",
]

CHECKPOINT_FORMAT = "softsearch-checkpoint"
TRAIN_STATE_FORMAT = "softsearch-train-state"
FORMAT_VERSION = 1
_META_KEY = "softsearch"


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict) -> str:
    """sha256 hex of the canonical JSON (sorted keys, no spaces) of a training config dict."""
    return hashlib.sha256(_canonical_json(config).encode("utf-8")).hexdigest()


def checkpoint_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of the checkpoint file's bytes (identifies the exact weights an index used)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """save_file to a temp file beside `path`, then os.replace (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _plain_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage and non-contiguous tensors: copy each to its own buffer.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def _read_metadata(path: Path, expected_format: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            raw = fh.metadata() or {}
    except Exception as err:  # safetensors raises SafetensorError / OSError on bad headers
        raise ValueError(f"{path} is not a valid safetensors file ({err})") from err
    if _META_KEY not in raw:
        raise ValueError(f"{path} has no softsearch metadata; not a {expected_format} file")
    try:
        meta = json.loads(raw[_META_KEY])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} has corrupt softsearch metadata ({err})") from err
    if meta.get("format") != expected_format:
        raise ValueError(f"{path} is a {meta.get('format')!r} file, expected {expected_format!r}")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {meta.get('version')}, newer than supported {FORMAT_VERSION}"
        )
    return meta


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except Exception as err:
        raise ValueError(f"{path} is a corrupt safetensors file ({err})") from err


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    path: str | os.PathLike,
    encoder: Encoder,
    *,
    step: int,
    train_config: dict,
    lineage: dict,
    metrics: dict | None = None,
    text_encoder=None,
) -> Path:
    """Write encoder weights + JSON metadata to `path` atomically; returns the path.

    With `text_encoder` (training/text.py) its tensors go in too, prefixed ``text.``, and its config
    under the metadata key ``text``: one file holds both towers of an image-text model.

    `lineage` should name objective, temperature_schedule, train_config_hash and dataset;
    a missing train_config_hash is filled in from `train_config`.
    """
    path = Path(path)
    encoder = getattr(encoder, "module", encoder)  # unwrap DDP
    if not isinstance(encoder, Encoder):
        raise ValueError(f"save_checkpoint needs an Encoder, got {type(encoder).__name__}")
    lineage = dict(lineage)
    lineage.setdefault("train_config_hash", config_hash(train_config))
    meta = {
        "format": CHECKPOINT_FORMAT,
        "version": FORMAT_VERSION,
        "encoder": asdict(encoder.config),
        "step": int(step),
        "train_config": train_config,
        "lineage": lineage,
        "metrics": metrics or {},
    }
    tensors = dict(encoder.state_dict())
    if text_encoder is not None:
        from training.text import TEXT_PREFIX

        text_encoder = getattr(text_encoder, "module", text_encoder)
        meta["text"] = text_encoder.metadata()
        tensors.update({TEXT_PREFIX + k: v for k, v in text_encoder.state_dict().items()})
    _atomic_save(_plain_tensors(tensors), path, {_META_KEY: _canonical_json(meta)})
    logger.info("saved checkpoint %s (step %d)", path, step)
    return path


def read_checkpoint_metadata(path: str | os.PathLike) -> dict:
    """The checkpoint's JSON metadata without building the encoder (cheap; for manifests)."""
    return _read_metadata(Path(path), CHECKPOINT_FORMAT)


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Encoder, dict]:
    """Rebuild the encoder from a checkpoint's metadata and load its weights (no pickle).

    Returns (encoder in eval mode on `device`, metadata dict). Missing file ->
    FileNotFoundError; corrupt file or weights that do not fit the stored config -> ValueError.
    """
    path = Path(path)
    meta = _read_metadata(path, CHECKPOINT_FORMAT)
    try:
        stored = dict(meta["encoder"])
        for key in ("image_mean", "image_std"):
            # checkpoints written before these fields existed were trained on preprocess()'s 0.5 / 0.5
            stored.setdefault(key, [MEAN] * 3 if key == "image_mean" else [STD] * 3)
        config = encoder_config_from_dict(stored)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} has an invalid encoder config ({err})") from err
    # Weights come from the checkpoint, so the original pretrained file is not needed.
    encoder = create_encoder(replace(config, pretrained=None))
    state = _load_tensors(path)
    if meta.get("text"):  # the text tower's tensors (training/text.py load_text_encoder reads them)
        state = {k: v for k, v in state.items() if not k.startswith("text.")}
    missing, unexpected = set(encoder.state_dict()) - set(state), set(state) - set(encoder.state_dict())
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match encoder config {asdict(config)}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    for name, ref in encoder.state_dict().items():
        if tuple(state[name].shape) != tuple(ref.shape):
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(state[name].shape)}, "
                f"the encoder config needs {tuple(ref.shape)}"
            )
    encoder.load_state_dict(state, strict=True)
    encoder.to(device).eval()
    return encoder, meta


# ----------------------------------------------------------------------------- resume state


class TrainState(dict):
    """What `load_train_state` returns: keys step, optimizer (a torch state_dict), schedule and
    loss (state_dicts of tensors), rng (name -> uint8 tensor), extra (JSON extras)."""


def _flatten_optimizer(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state_dict -> (tensors, JSON); inverse is `_unflatten_optimizer`."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, pstate in state_dict["state"].items():
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.state.{idx}.{key}"] = value
            else:
                scalars.setdefault(str(idx), {})[key] = value
    groups = []
    for group in state_dict["param_groups"]:
        g = {}
        for key, value in group.items():
            if isinstance(value, tuple):
                g[key] = {"__tuple__": list(value)}
            elif isinstance(value, torch.Tensor):
                g[key] = {"__tensor_scalar__": value.item()}
            else:
                g[key] = value
        groups.append(g)
    return tensors, {"param_groups": groups, "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], info: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith("optim.state."):
            continue
        idx, key = name[len("optim.state.") :].split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for idx, extra in info.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(extra)
    groups = []
    for group in info["param_groups"]:
        g = {}
        for key, value in group.items():
            if isinstance(value, dict) and "__tuple__" in value:
                g[key] = tuple(value["__tuple__"])
            elif isinstance(value, dict) and "__tensor_scalar__" in value:
                g[key] = torch.tensor(value["__tensor_scalar__"])
            else:
                g[key] = value
        groups.append(g)
    return {"state": state, "param_groups": groups}


def save_train_state(
    path: str | os.PathLike,
    *,
    step: int,
    optimizer: torch.optim.Optimizer,
    schedule_state: dict[str, torch.Tensor] | None = None,
    loss_state: dict[str, torch.Tensor] | None = None,
    rng_tensors: dict[str, torch.Tensor] | None = None,
    extra_json: dict | None = None,
) -> Path:
    """Write everything needed to resume exactly, as tensors + JSON (no pickle), atomically.

    `rng_tensors`: uint8 RNG states (torch CPU/CUDA). Non-tensor RNG states (numpy
    bit_generator.state, python random.getstate()) go in `extra_json`.
    """
    path = Path(path)
    tensors, optim_info = _flatten_optimizer(optimizer.state_dict())
    for key, value in (schedule_state or {}).items():
        tensors[f"schedule.{key}"] = value
    for key, value in (loss_state or {}).items():  # e.g. WEINCE's EMA buffers
        tensors[f"loss.{key}"] = value
    for key, value in (rng_tensors or {}).items():
        if value.dtype != torch.uint8:
            raise ValueError(f"RNG state {key!r} must be a uint8 tensor, got {value.dtype}")
        tensors[f"rng.{key}"] = value
    meta = {
        "format": TRAIN_STATE_FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "optimizer": optim_info,
        "extra": extra_json or {},
    }
    _atomic_save(_plain_tensors(tensors), path, {_META_KEY: _canonical_json(meta)})
    return path


def load_train_state(path: str | os.PathLike) -> TrainState:
    """Inverse of `save_train_state`: {step, optimizer, schedule, loss, rng, extra}."""
    path = Path(path)
    meta = _read_metadata(path, TRAIN_STATE_FORMAT)
    tensors = _load_tensors(path)
    return TrainState(
        step=int(meta["step"]),
        optimizer=_unflatten_optimizer(tensors, meta["optimizer"]),
        schedule={k[len("schedule.") :]: v for k, v in tensors.items() if k.startswith("schedule.")},
        loss={k[len("loss.") :]: v for k, v in tensors.items() if k.startswith("loss.")},
        rng={k[len("rng.") :]: v for k, v in tensors.items() if k.startswith("rng.")},
        extra=meta.get("extra", {}),
    )
