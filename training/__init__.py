"""softsearch.training: datasets with positive generators, open_clip encoders, contrastive
objectives (InfoNCE, WEINCE), temperature schedules, Langevin noise and the trainer.

Names resolve lazily (PEP 562): `import training` (or a light module such as training.train_args) loads
no torch until a name below is used, so every command parses its arguments first."""

from __future__ import annotations

import importlib

_HOMES = {
    "checkpoint_sha256": "training.checkpoint",
    "load_checkpoint": "training.checkpoint",
    "save_checkpoint": "training.checkpoint",
    "TrainConfig": "training.config",
    "load_train_config": "training.config",
    "DATASETS": "training.datasets",
    "ImageDataset": "training.datasets",
    "create_dataset": "training.datasets",
    "register_dataset": "training.datasets",
    "Encoder": "training.encoder",
    "EncoderConfig": "training.encoder",
    "create_encoder": "training.encoder",
    "embed": "training.encoder",
    "GENERATORS": "training.generators",
    "PositiveGenerator": "training.generators",
    "create_generator": "training.generators",
    "register_generator": "training.generators",
    "LangevinNoise": "training.langevin",
    "LOSSES": "training.losses",
    "ContrastiveLoss": "training.losses",
    "InfoNCELoss": "training.losses",
    "LossOutput": "training.losses",
    "create_loss": "training.losses",
    "register_loss": "training.losses",
    "gaussian_regularizer": "training.regularizers",
    "vanishing_weight": "training.regularizers",
    "SCHEDULES": "training.schedules",
    "TemperatureSchedule": "training.schedules",
    "create_schedule": "training.schedules",
    "register_schedule": "training.schedules",
    "oracle_embedding": "training.synthetic",
    "train": "training.trainer",
    "preprocess": "training.transforms",
    "WEINCEConfig": "training.weince",
    "WEINCELoss": "training.weince",
    "fit_tail": "training.weince",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    """Import a public name's home module on first use (index.lazy does the same one layer up)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'training' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
