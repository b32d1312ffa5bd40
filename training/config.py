"""Training configuration: the `TrainConfig` dataclass, TOML loading and `--set key=value` overrides.

A TOML file maps top-level keys to `TrainConfig` fields; the `[encoder]` table fills the nested
`EncoderConfig`; `*_options` tables are free-form keyword options for the registry factories
(`create_loss`, `create_schedule`, `create_generator`, `create_dataset`). Overrides use dotted
keys (`encoder.width=32`, `loss_options.kappa_rho=10`); their values are parsed as TOML literals
when possible (`[1, 1, 1, 1]`, `true`, `0.1`) and then coerced to the field's declared type.
Unknown keys raise ValueError naming them.
"""

from __future__ import annotations

import logging
import math
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from training.encoder import EncoderConfig

logger = logging.getLogger(__name__)

__all__ = ["TrainConfig", "load_train_config", "apply_overrides", "config_from_dict", "RUNTIME_FIELDS"]

# Fields that do not change the trained weights; excluded from the lineage hash.
RUNTIME_FIELDS = (
    "out_dir",
    "log_every",
    "checkpoint_every",
    "device",
    "num_workers",
    "torch_threads",
    "progress",
    "stop_after",
    "cache_dir",
    "cache_workers",
)


@dataclass
class TrainConfig:
    """Everything a training run depends on. `batch_size` is the GLOBAL number of pairs per step
    (split evenly over DDP ranks), so one config gives the same run on any number of processes."""

    # data
    dataset: str = "synthetic"
    split: str = "train"
    data_root: str | None = None
    dataset_size: int | None = None
    dataset_seed: int = 0
    dataset_options: dict = field(default_factory=dict)
    generator: str | None = None  # None -> dataset.default_generator()
    generator_options: dict = field(default_factory=dict)
    kappa: float | None = None  # synthetic: von Mises concentration of the latent positives
    # model and objective
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    loss: str = "infonce"
    loss_options: dict = field(default_factory=dict)
    schedule: str = "fixed"  # softmax temperature schedule (training/schedules.py)
    schedule_options: dict = field(default_factory=lambda: {"tau": 0.1})
    noise_schedule: str | None = None  # Langevin noise temperature schedule; None -> no noise
    noise_options: dict = field(default_factory=dict)
    # image-text training: the [text] table (training/text_trainer.py); empty -> image-only training
    text: dict = field(default_factory=dict)
    # vanishing Gaussianity regulariser alpha_t (E|h|^2 - log det Cov h), alpha_t = alpha_0/(1 + t/decay)
    gaussian_reg: float = 0.0
    gaussian_reg_decay: float = 500.0
    # KoLeo spread term (training/regularizers.py) on each view's batch of embeddings, at this weight (SSCD's
    # copy-detection recipe, configs/copy.toml); 0 = off
    koleo: float = 0.0
    # with a pixel anchor (encoder.pixel_weight > 0): the loss sees the served (anchored) embedding, so
    # the tower learns what the pixels miss; False: the tower alone (its weights do not depend on the anchor)
    loss_sees_anchor: bool = False
    # with generator "auto": the encoder's anchor weights (pixel_weight, colour_weight, gradient_weight) to
    # use instead when the folder has class folders. A label-trained tower learns the classes themselves and
    # wants less of the fixed parts beside it than a self-supervised one; empty -> [encoder] as written
    anchor_with_classes: dict = field(default_factory=dict)
    # optimisation
    steps: int = 600
    batch_size: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.05  # cosine decays lr to lr * min_lr_ratio
    weight_decay: float = 0.05
    warmup_steps: int = 50
    grad_clip: float | None = None
    seed: int = 0
    sample_chunk: int = 8  # positives of each chunk of this many pairs use their own RNG stream
    # runtime
    out_dir: str = "runs/train"
    log_every: int = 10
    checkpoint_every: int = 200
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_workers: int = 0  # background threads preparing upcoming batches
    torch_threads: int | None = None
    progress: bool = True
    stop_after: int | None = (
        None  # save and stop once this step is reached (time-sliced jobs); --resume continues
    )
    # file-backed datasets (folder): where the decoded-image cache lives (None -> $SOFTSEARCH_CACHE_DIR,
    # else ~/.cache/softsearch) and how many processes decode it the first time (None -> CPU count)
    cache_dir: str | None = None
    cache_workers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.encoder, dict):
            self.encoder = _dataclass_from_dict(EncoderConfig, self.encoder, "encoder")

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in (
            "steps",
            "batch_size",
            "log_every",
            "checkpoint_every",
            "sample_chunk",
            "gaussian_reg_decay",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "num_workers", "weight_decay", "gaussian_reg", "koleo"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be positive or unset, got {self.grad_clip}")
        if self.dataset_size is not None and self.dataset_size <= 0:
            raise ValueError(f"dataset_size must be positive, got {self.dataset_size}")
        if self.stop_after is not None and self.stop_after <= 0:
            raise ValueError(f"stop_after must be positive or unset, got {self.stop_after}")
        if self.cache_workers is not None and self.cache_workers <= 0:
            raise ValueError(f"cache_workers must be positive or unset, got {self.cache_workers}")
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise ValueError(f"torch_threads must be positive, got {self.torch_threads}")
        if self.text and (
            self.encoder.pixel_weight or self.encoder.colour_weight or self.encoder.gradient_weight
        ):
            raise ValueError(
                "encoder.pixel_weight, colour_weight and gradient_weight are for image search; image-text "
                "training ([text]) needs 0"
            )
        self.encoder.validate()
        anchor_keys = {"pixel_weight", "colour_weight", "gradient_weight"}
        if set(self.anchor_with_classes) - anchor_keys:
            raise ValueError(
                f"anchor_with_classes takes {sorted(anchor_keys)}, got {sorted(self.anchor_with_classes)}"
            )
        if self.anchor_with_classes:
            if self.generator != "auto":
                raise ValueError(
                    'anchor_with_classes needs generator = "auto" (it applies when classes are found)'
                )
            replace(self.encoder, **self.anchor_with_classes).validate()

    def to_dict(self) -> dict:
        """JSON-able dict (tuples become lists)."""
        return _jsonable(asdict(self))

    def lineage_dict(self) -> dict:
        """The fields that determine the trained weights (hashed into the lineage)."""
        # an empty [text] or [anchor_with_classes] table and koleo 0 are left out, so runs without them
        # hash as they did before they existed
        return {
            k: v
            for k, v in self.to_dict().items()
            if k not in RUNTIME_FIELDS and not (k in ("text", "anchor_with_classes", "koleo") and not v)
        }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Coerce a TOML/override value to the declared field type `tp`, or raise ValueError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in options:
                return None
            raise ValueError(f"{key} cannot be None")
        # try the more specific types first: tuple before int (so [1,1,1,1] is a tuple), int before float
        order = sorted(
            (o for o in options if o is not type(None)),
            key=lambda o: {tuple: 0, bool: 1, int: 2, float: 3, str: 9}.get(typing.get_origin(o) or o, 5),
        )
        for option in order:
            try:
                return _coerce(value, option, key)
            except ValueError:
                continue
        raise ValueError(f"{key}={value!r} is not a valid {_type_name(tp)}")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{key}={value!r} is not a bool")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is not an int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"{key}={value!r} is not an int")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is not a float")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not a float") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{key}={value!r} is not a string")
        return str(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}={value!r} is not a table")
        return dict(value)
    if tp is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}={value!r} is not a list")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        return tuple(_coerce(v, inner, key) for v in value)
    raise ValueError(f"{key}: unsupported field type {tp}")


def _dataclass_from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        where = f" in [{prefix}]" if prefix else ""
        raise ValueError(
            f"unknown config keys{where}: {', '.join((prefix + '.' if prefix else '') + k for k in unknown)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if hints[name] is EncoderConfig:
            if isinstance(value, EncoderConfig):
                value = asdict(value)
            if not isinstance(value, dict):
                raise ValueError(f"{key} must be a table")
            kwargs[name] = _dataclass_from_dict(EncoderConfig, value, key)
        else:
            kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def config_from_dict(data: dict) -> TrainConfig:
    """Build a TrainConfig from a (TOML/JSON) dict; unknown keys -> ValueError."""
    return _dataclass_from_dict(TrainConfig, data)


def _parse_literal(text: str) -> Any:
    """A TOML literal if `text` is one (`0.1`, `true`, `[1, 2]`, `{a = 1}`, `"s"`), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply `key=value` strings (dotted keys address nested tables) to a config dict in place."""
    hints = typing.get_type_hints(TrainConfig)
    enc_hints = typing.get_type_hints(EncoderConfig)
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        top = parts[0]
        if top not in hints:
            raise ValueError(f"unknown config key {key!r}")
        value = _parse_literal(text.strip())
        if hints[top] is EncoderConfig:
            if len(parts) != 2 or parts[1] not in enc_hints:
                raise ValueError(f"unknown config key {key!r}")
            data.setdefault(top, {})[parts[1]] = value
        elif len(parts) == 1:
            data[top] = value
        elif typing.get_origin(hints[top]) is dict or hints[top] is dict:
            node = data.setdefault(top, {})
            for part in parts[1:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        else:
            raise ValueError(f"config key {top!r} is not a table; cannot set {key!r}")
    return data


def load_train_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a TOML config (None -> defaults), apply `key=value` overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path}: invalid TOML ({err})") from err
    # Overrides of option tables merge into (a copy of) the file's tables.
    data = apply_overrides(_deepcopy(data), overrides)
    config = config_from_dict(data)
    config.validate()
    return config


def _deepcopy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deepcopy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deepcopy(v) for v in obj]
    return obj


# Field defaults, for documentation / CLI help.
def defaults() -> dict:
    out = {}
    for f in fields(TrainConfig):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return _jsonable({k: (asdict(v) if isinstance(v, EncoderConfig) else v) for k, v in out.items()})
