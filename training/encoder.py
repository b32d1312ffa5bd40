"""Image encoder: an open_clip vision tower whose output is L2-normalised onto the sphere.

Two ways to build one (see `EncoderConfig`):

* a custom small tower from `open_clip.model.CLIPVisionCfg` (int `layers` -> VisionTransformer,
  4-tuple `layers` -> ModifiedResNet), the CPU-friendly default;
* a named open_clip model (`model_name="RN50"`, `"ViT-B-32"`, ...) whose `.visual` tower is
  kept, optionally with weights from a *local* file (never downloaded).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

__all__ = ["EncoderConfig", "Encoder", "create_encoder", "embed", "encoder_config_from_dict"]


@dataclass
class EncoderConfig:
    """Architecture of the image encoder; JSON-able via `dataclasses.asdict`."""

    model_name: str | None = None  # open_clip model name ("RN50", "ViT-B-32"); None -> custom tower
    pretrained: str | None = None  # local weights file for model_name (never downloaded)
    image_size: int = 32
    embed_dim: int = 64
    width: int = 64  # custom tower: CLIPVisionCfg.width
    layers: int | tuple[int, ...] = 2  # int -> ViT depth; 4-tuple -> ModifiedResNet stage depths
    heads: int = 4  # attention heads; open_clip takes head_width = width // heads
    patch_size: int = 4  # ViT only
    mlp_ratio: float = 2.0  # ViT only

    def __post_init__(self) -> None:
        # TOML / JSON give lists; a tuple keeps the config hashable and comparable.
        if isinstance(self.layers, list):
            self.layers = tuple(int(v) for v in self.layers)

    @property
    def is_resnet(self) -> bool:
        return self.model_name is None and isinstance(self.layers, tuple)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.image_size <= 0:
            raise ValueError(f"encoder.image_size must be positive, got {self.image_size}")
        if self.model_name is not None:
            if self.pretrained is not None and not os.path.isfile(self.pretrained):
                raise FileNotFoundError(
                    f"encoder.pretrained={self.pretrained!r} is not a local file "
                    "(weights are never downloaded)"
                )
            return
        if self.pretrained is not None:
            raise ValueError(
                f"encoder.pretrained={self.pretrained!r} needs encoder.model_name; "
                "a custom tower has no pretrained weights"
            )
        for name in ("embed_dim", "width", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"encoder.{name} must be positive, got {getattr(self, name)}")
        if self.width % self.heads != 0:
            raise ValueError(
                f"encoder.width={self.width} must be divisible by encoder.heads={self.heads}"
            )
        if isinstance(self.layers, tuple):
            if len(self.layers) != 4 or any(v <= 0 for v in self.layers):
                raise ValueError(
                    f"encoder.layers={list(self.layers)} must be 4 positive ints for a ModifiedResNet"
                )
            if self.image_size % 32 != 0:
                raise ValueError(
                    f"encoder.image_size={self.image_size} must be divisible by 32 for a "
                    "ModifiedResNet tower (it downsamples by 32)"
                )
        else:
            if self.layers <= 0:
                raise ValueError(f"encoder.layers must be positive, got {self.layers}")
            if self.patch_size <= 0 or self.image_size % self.patch_size != 0:
                raise ValueError(
                    f"encoder.image_size={self.image_size} must be divisible by "
                    f"encoder.patch_size={self.patch_size} for a ViT tower"
                )
            if self.mlp_ratio <= 0:
                raise ValueError(f"encoder.mlp_ratio must be positive, got {self.mlp_ratio}")


def encoder_config_from_dict(data: dict[str, Any]) -> EncoderConfig:
    """Rebuild an EncoderConfig from its JSON form; unknown keys -> ValueError."""
    known = {f.name for f in fields(EncoderConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown encoder config keys: {unknown}")
    return EncoderConfig(**data)


def _build_tower(config: EncoderConfig) -> tuple[nn.Module, int]:
    """Return (vision tower, output dim)."""
    import open_clip
    from open_clip.model import CLIPVisionCfg, _build_vision_tower

    if config.model_name is not None:
        if config.model_name not in open_clip.list_models():
            raise ValueError(f"unknown open_clip model_name {config.model_name!r}")
        model = open_clip.create_model(
            config.model_name,
            pretrained=config.pretrained,  # a validated local path or None
            force_image_size=config.image_size,
            pretrained_text=False,
            pretrained_image=False,
        )
        visual = model.visual
        dim = getattr(visual, "output_dim", None)
        if dim is None:  # e.g. timm towers: measure it
            with torch.no_grad():
                dim = visual(torch.zeros(1, 3, config.image_size, config.image_size)).shape[-1]
        return visual, int(dim)

    head_width = config.width // config.heads
    cfg = CLIPVisionCfg(
        layers=config.layers,
        width=config.width,
        head_width=head_width,
        mlp_ratio=config.mlp_ratio,
        patch_size=config.patch_size,
        image_size=config.image_size,
    )
    return _build_vision_tower(config.embed_dim, cfg), config.embed_dim


class Encoder(nn.Module):
    """Vision tower + L2 normalisation: `forward(x) = f(x) / |f(x)|`."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        config.validate()
        tower, dim = _build_tower(config)
        if dim != config.embed_dim:
            logger.warning(
                "open_clip model %s has embed_dim %d; overriding config embed_dim %d",
                config.model_name, dim, config.embed_dim,
            )
            config = replace(config, embed_dim=dim)
        self.config = config
        self.image_size = config.image_size
        self.embed_dim = dim
        self.tower = tower

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != 3 or x.shape[2] != self.image_size or x.shape[3] != self.image_size:
            raise ValueError(
                f"encoder expects images of shape (B, 3, {self.image_size}, {self.image_size}), "
                f"got {tuple(x.shape)}"
            )

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-normalisation tower output h(x), (B, D); its norms are a diagnostic (paper 4)."""
        self._check_input(x)
        h = self.tower(x)
        if isinstance(h, tuple):  # towers with output_tokens return (pooled, tokens)
            h = h[0]
        return h  # (B, D)

    def forward(self, x: torch.Tensor, return_features: bool = False):
        """Unit embeddings z = h / |h|, (B, D); with `return_features`, (z, h) (one forward, DDP-safe)."""
        h = self.features(x)  # (B, D)
        z = F.normalize(h, dim=-1)  # (B, D)
        return (z, h) if return_features else z

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def create_encoder(config: EncoderConfig | dict | None = None) -> Encoder:
    """Build an Encoder from a config (dataclass or its dict form); None -> CPU default."""
    if config is None:
        config = EncoderConfig()
    elif isinstance(config, dict):
        config = encoder_config_from_dict(config)
    elif not isinstance(config, EncoderConfig):
        raise ValueError(f"create_encoder needs an EncoderConfig or dict, got {type(config).__name__}")
    return Encoder(config)


def _iter_batches(images: Any, batch_size: int) -> tuple[Iterable[torch.Tensor], int | None]:
    """Yield (B, 3, S, S) tensors from a tensor/array, a map-style dataset, or an iterable of batches."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if isinstance(images, torch.Tensor):
        if images.ndim == 3:
            images = images.unsqueeze(0)
        n = images.shape[0]
        return (images[i : i + batch_size] for i in range(0, n, batch_size)), n

    from torch.utils.data import DataLoader, Dataset

    if isinstance(images, Dataset) and not isinstance(images, torch.utils.data.IterableDataset):
        loader = DataLoader(images, batch_size=batch_size, shuffle=False)
        n = len(images)  # type: ignore[arg-type]
    else:
        loader = images
        n = len(images.dataset) if isinstance(images, DataLoader) and hasattr(images.dataset, "__len__") else None

    def gen() -> Iterable[torch.Tensor]:
        for batch in loader:
            if isinstance(batch, (tuple, list)):
                batch = batch[0]  # (images, labels, ...) -> images
            if isinstance(batch, np.ndarray):
                batch = torch.from_numpy(batch)
            if not isinstance(batch, torch.Tensor):
                raise ValueError(f"embed: expected tensor batches, got {type(batch).__name__}")
            if batch.ndim == 3:
                batch = batch.unsqueeze(0)
            yield batch

    return gen(), n


def embed(
    encoder: Encoder,
    images: torch.Tensor | np.ndarray | Iterable,
    batch_size: int = 256,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> np.ndarray:
    """Unit embeddings of preprocessed images as float32 (N, D), computed without gradients.

    `images` is a (N, 3, S, S) tensor/array, a map-style dataset returning such tensors, or an
    iterable of batches (tensors or tuples whose first item is the image tensor). `device`
    None -> the encoder's device; otherwise the encoder is moved there.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if device is None:
        device = next(encoder.parameters()).device
    device = torch.device(device)
    if next(encoder.parameters()).device != device:
        encoder.to(device)  # the encoder follows the requested device (moved in place)
    was_training = encoder.training
    encoder.eval()
    batches, n = _iter_batches(images, batch_size)
    out: list[np.ndarray] = []
    try:
        with torch.inference_mode(), tqdm(total=n, desc="embed", unit="img", disable=not progress, leave=False) as bar:
            for batch in batches:
                z = encoder(batch.to(device=device, dtype=torch.float32))  # (B, D)
                out.append(z.float().cpu().numpy())
                bar.update(batch.shape[0])
    finally:
        encoder.train(was_training)
    if not out:
        return np.zeros((0, encoder.embed_dim), dtype=np.float32)
    return np.ascontiguousarray(np.concatenate(out, axis=0), dtype=np.float32)
