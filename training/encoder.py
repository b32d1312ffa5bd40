"""Image encoder: an open_clip vision tower whose output is L2-normalised onto the sphere.

Two ways to build one (see `EncoderConfig`):

* a custom small tower from `open_clip.model.CLIPVisionCfg` (int `layers` -> VisionTransformer,
  4-tuple `layers` -> ModifiedResNet), the CPU-friendly default;
* a named open_clip model (`model_name="RN50"`, `"ViT-B-32"`, ...) whose `.visual` tower is
  kept, optionally with weights from a *local* file (never downloaded), loaded by open_clip's own
  `create_model(name, pretrained=FILE)`: every layout and file type it accepts (safetensors,
  `torch.save` state dicts, training checkpoints with a `state_dict` and `module.` prefixes,
  OpenAI TorchScript archives), with its conversions and position-embedding resizing.

Input normalisation: `training.transforms.preprocess` gives every path the same tensor,
`x = (p - 0.5) / 0.5` for pixels `p` in [0, 1]. A tower trained with another mean / std (open_clip
models: the model's own preprocessing config, e.g. OpenAI's CLIP mean and std) gets
`x' = (p - mean) / std = x * (0.5 / std) + (0.5 - mean) / std` per channel, applied inside
`Encoder.features`, so training, index building and the API all feed it what it was trained on.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from training.transforms import MEAN, STD

logger = logging.getLogger(__name__)

__all__ = [
    "EncoderConfig",
    "Encoder",
    "create_encoder",
    "embed",
    "encoder_config_from_dict",
    "model_image_size",
]

DEFAULT_IMAGE_SIZE = 32


@dataclass
class EncoderConfig:
    """Architecture of the image encoder; JSON-able via `dataclasses.asdict`."""

    model_name: str | None = None  # open_clip model name ("RN50", "ViT-B-32"); None -> custom tower
    pretrained: str | None = None  # local weights file for model_name (never downloaded)
    image_size: int | None = None  # None -> the named model's own input size, 32 for a custom tower
    embed_dim: int = 64
    width: int = 64  # custom tower: CLIPVisionCfg.width
    layers: int | tuple[int, ...] = 2  # int -> ViT depth; 4-tuple -> ModifiedResNet stage depths
    heads: int = 4  # attention heads; open_clip takes head_width = width // heads
    patch_size: int = 4  # ViT only
    mlp_ratio: float = 2.0  # ViT only
    # per-channel input normalisation the tower was trained with; None -> the named model's own
    # preprocessing config (open_clip), (0.5, 0.5, 0.5) for a custom tower
    image_mean: tuple[float, float, float] | None = None
    image_std: tuple[float, float, float] | None = None
    # pixel anchor: the served embedding is [sqrt(1 - w) z, sqrt(w) p] for the tower's unit vector z and
    # the image's own side x side grey pixels p (centred on the training images' mean, unit), so a
    # cosine is (1 - w) tower cosine + w pixel cosine: a collection that pixels search well cannot fall
    # far below them. 0 = off (the tower alone). Training's loss sees the tower alone.
    pixel_weight: float = 0.0
    pixel_side: int = 32
    # colour part of the anchor: the image's joint RGB histogram (colour_bins per channel, square-rooted
    # fractions, centred on the training images' mean, unit) at weight c beside it, so a cosine is
    # (1 - w - c) tower + w grey pixels + c colour. Grey pixels ignore colour; icon and clip-art classes
    # often share palettes. 0 = off.
    colour_weight: float = 0.0
    colour_bins: int = 4
    # gradient part: orientation histograms of the grey thumbnail's gradients (gradient_bins signed
    # directions, magnitude-weighted, one histogram per cell of a gradient_grid x gradient_grid layout;
    # a HOG), centred on the training images' mean, unit, at weight e: a cosine is (1 - w - c - e) tower
    # + w grey + c colour + e gradient. Grey pixels match shapes only where they overlap; edge directions
    # per region match outlines drawn alike (page and folder shapes, glyphs) a few pixels apart. 0 = off.
    gradient_weight: float = 0.0
    gradient_grid: int = 4
    gradient_bins: int = 16

    def __post_init__(self) -> None:
        # TOML / JSON give lists; a tuple keeps the config hashable and comparable.
        if isinstance(self.layers, list):
            self.layers = tuple(int(v) for v in self.layers)
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                setattr(self, name, tuple(float(v) for v in value))
        if self.image_size is None:
            self.image_size = model_image_size(self.model_name) if self.model_name else DEFAULT_IMAGE_SIZE

    @property
    def is_resnet(self) -> bool:
        return self.model_name is None and isinstance(self.layers, tuple)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.model_name is not None:
            check_model_name(self.model_name)
        if not 0.0 <= self.pixel_weight < 1.0:
            raise ValueError(f"encoder.pixel_weight must be in [0, 1), got {self.pixel_weight}")
        if not 0.0 <= self.colour_weight < 1.0 or self.pixel_weight + self.colour_weight >= 1.0:
            raise ValueError(
                "encoder.colour_weight must be in [0, 1) with pixel_weight + colour_weight < 1, got "
                f"{self.colour_weight} (pixel_weight {self.pixel_weight})"
            )
        if (
            not 0.0 <= self.gradient_weight < 1.0
            or self.pixel_weight + self.colour_weight + self.gradient_weight >= 1.0
        ):
            raise ValueError(
                "encoder.gradient_weight must be in [0, 1) with pixel_weight + colour_weight + "
                f"gradient_weight < 1, got {self.gradient_weight} (pixel_weight {self.pixel_weight}, "
                f"colour_weight {self.colour_weight})"
            )
        for name, low in (("gradient_grid", 1), ("gradient_bins", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"encoder.{name} must be an integer >= {low}, got {value!r}")
        if self.gradient_weight and isinstance(self.pixel_side, int) and self.pixel_side % self.gradient_grid:
            raise ValueError(
                f"encoder.gradient_grid={self.gradient_grid} must divide encoder.pixel_side={self.pixel_side}"
            )
        if (
            isinstance(self.colour_bins, bool)
            or not isinstance(self.colour_bins, int)
            or self.colour_bins < 2
        ):
            raise ValueError(f"encoder.colour_bins must be an integer >= 2, got {self.colour_bins!r}")
        if not isinstance(self.pixel_side, int) or self.pixel_side <= 0:
            raise ValueError(f"encoder.pixel_side must be a positive integer, got {self.pixel_side!r}")
        if not isinstance(self.image_size, int) or self.image_size <= 0:
            raise ValueError(f"encoder.image_size must be a positive integer, got {self.image_size!r}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if value is not None and (len(value) != 3 or (name == "image_std" and min(value) <= 0)):
                raise ValueError(
                    f"encoder.{name} must be 3 numbers{' > 0' if name == 'image_std' else ''}, got {value}"
                )
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
            raise ValueError(f"encoder.width={self.width} must be divisible by encoder.heads={self.heads}")
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


def check_model_name(name: str) -> None:
    """ValueError unless `name` is an open_clip model this project can build offline."""
    import open_clip

    if name not in open_clip.list_models():
        raise ValueError(
            f"unknown open_clip model_name {name!r}; `python -c 'import open_clip; "
            f"print(open_clip.list_models())'` lists them"
        )
    text = (open_clip.get_model_config(name) or {}).get("text_cfg", {})
    if text.get("hf_model_name"):
        raise ValueError(
            f"open_clip model {name!r} builds its text tower from Hugging Face "
            f"({text['hf_model_name']}), which would download its configuration; pick another model"
        )


def model_image_size(name: str) -> int | None:
    """The input side of a named open_clip model (its vision config), or None for an unknown name."""
    import open_clip

    config = open_clip.get_model_config(name)
    if config is None:
        return None
    size = config["vision_cfg"].get("image_size", DEFAULT_IMAGE_SIZE)
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ValueError(f"open_clip model {name!r} takes non-square {tuple(size)} images; not supported")
        size = size[0]
    return int(size)


def encoder_config_from_dict(data: dict[str, Any]) -> EncoderConfig:
    """Rebuild an EncoderConfig from its JSON form; unknown keys -> ValueError."""
    known = {f.name for f in fields(EncoderConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown encoder config keys: {unknown}")
    return EncoderConfig(**data)


@dataclass(frozen=True)
class _Tower:
    module: nn.Module
    dim: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    temperature: float | None = None  # the CLIP model's 1 / exp(logit_scale), named models only


def _build_tower(config: EncoderConfig) -> _Tower:
    """The vision tower, its output dim and the input normalisation it expects."""
    import open_clip
    from open_clip.model import CLIPVisionCfg, _build_vision_tower

    if config.model_name is not None:
        try:
            model = open_clip.create_model(
                config.model_name,
                pretrained=config.pretrained,  # a validated local path or None
                force_image_size=config.image_size,
                pretrained_text=False,
                pretrained_image=False,
            )
        except (
            RuntimeError,
            ValueError,
            KeyError,
            OSError,
            EOFError,
            AssertionError,
            pickle.UnpicklingError,
        ) as err:
            if config.pretrained is None:
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"cannot load encoder.pretrained={config.pretrained} into open_clip model "
                f"{config.model_name!r}: {first}"
            ) from err
        visual = model.visual
        dim = getattr(visual, "output_dim", None)
        if dim is None:  # e.g. timm towers: measure it
            with torch.no_grad():
                dim = visual(torch.zeros(1, 3, config.image_size, config.image_size)).shape[-1]
        own = open_clip.get_model_preprocess_cfg(model)
        scale = getattr(model, "logit_scale", None)
        temperature = float(torch.exp(-scale.detach().float()).reshape(-1)[0]) if scale is not None else None
        return _Tower(
            visual,
            int(dim),
            tuple(float(v) for v in own["mean"]),
            tuple(float(v) for v in own["std"]),
            temperature,
        )

    head_width = config.width // config.heads
    cfg = CLIPVisionCfg(
        layers=config.layers,
        width=config.width,
        head_width=head_width,
        mlp_ratio=config.mlp_ratio,
        patch_size=config.patch_size,
        image_size=config.image_size,
    )
    return _Tower(_build_vision_tower(config.embed_dim, cfg), config.embed_dim, PROJECT_MEAN, PROJECT_STD)


PROJECT_MEAN = (MEAN,) * 3
PROJECT_STD = (STD,) * 3


class Encoder(nn.Module):
    """Vision tower + L2 normalisation: `forward(x) = f(x) / |f(x)|`, with the pixel anchor
    (`pixel_weight` w > 0, `colour_weight` c >= 0) `[sqrt(1 - w - c) f/|f|, sqrt(w) p(x), sqrt(c) q(x)]`
    (see `pixel_descriptor`, `colour_descriptor`)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        config.validate()
        tower = _build_tower(config)
        if tower.dim != config.embed_dim and config.model_name is not None:
            if config.embed_dim != EncoderConfig.embed_dim:
                logger.warning(
                    "open_clip model %s has embed_dim %d; overriding config embed_dim %d",
                    config.model_name,
                    tower.dim,
                    config.embed_dim,
                )
            config = replace(config, embed_dim=tower.dim)
        # the resolved normalisation is part of the config, so a checkpoint names it explicitly
        config = replace(
            config, image_mean=config.image_mean or tower.mean, image_std=config.image_std or tower.std
        )
        self.config = config
        self.image_size = config.image_size
        self.tower_dim = tower.dim
        self.pixel_weight = float(config.pixel_weight)
        self.pixel_dim = config.pixel_side**2 if self.pixel_weight > 0 else 0
        self.colour_weight = float(config.colour_weight)
        self.colour_dim = config.colour_bins**3 if self.colour_weight > 0 else 0
        self.gradient_weight = float(config.gradient_weight)
        self.gradient_dim = config.gradient_grid**2 * config.gradient_bins if self.gradient_weight > 0 else 0
        # the served (indexed) dimension
        self.embed_dim = tower.dim + self.pixel_dim + self.colour_dim + self.gradient_dim
        if self.pixel_dim:
            # the training images' mean grey thumbnail (set_pixel_mean), saved with the weights
            self.register_buffer("pixel_mean", torch.zeros(self.pixel_dim))
        if self.colour_dim:  # the training images' mean colour histogram, likewise
            self.register_buffer("colour_mean", torch.zeros(self.colour_dim))
        if self.gradient_dim:  # the training images' mean gradient histogram, likewise
            self.register_buffer("gradient_mean", torch.zeros(self.gradient_dim))
        self.tower = tower.module
        self.clip_temperature = tower.temperature
        from open_clip.modified_resnet import ModifiedResNet

        # convolutional towers run faster on CPU from channels-last input (oneDNN's NHWC kernels; same
        # outputs; docs/results.md §23); a ViT's patch embedding is slower that way
        self.prefers_channels_last = isinstance(self.tower, ModifiedResNet)
        # x' = x * (0.5 / std) + (0.5 - mean) / std maps the project's (p - 0.5) / 0.5 to (p - mean) / std
        std = torch.tensor(config.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        mean = torch.tensor(config.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        self._renormalise = config.image_mean != PROJECT_MEAN or config.image_std != PROJECT_STD
        # not persistent: derived from the config, so state dicts (and old checkpoints) are unchanged
        self.register_buffer("input_scale", STD / std, persistent=False)
        self.register_buffer("input_shift", (MEAN - mean) / std, persistent=False)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != 3 or x.shape[2] != self.image_size or x.shape[3] != self.image_size:
            raise ValueError(
                f"encoder expects images of shape (B, 3, {self.image_size}, {self.image_size}), "
                f"got {tuple(x.shape)}"
            )

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-normalisation tower output h(x), (B, D); its norms are a diagnostic (paper 4)."""
        self._check_input(x)
        if self._renormalise:
            x = x * self.input_scale + self.input_shift  # (B, 3, S, S), the tower's own normalisation
        h = self.tower(x)
        if isinstance(h, tuple):  # towers with output_tokens return (pooled, tokens)
            h = h[0]
        return h  # (B, D)

    def grey_thumbnail(self, x: torch.Tensor) -> torch.Tensor:
        """(B, side^2) grey pixels of preprocessed images: channel mean, area-resized to pixel_side (the
        report's raw-pixel baseline, search/evaluation/baselines.py)."""
        side = self.config.pixel_side
        grey = x.float().mean(dim=1, keepdim=True)  # (B, 1, S, S)
        if grey.shape[-1] != side:
            grey = F.interpolate(grey, size=(side, side), mode="area")
        return grey.flatten(1)  # (B, side^2)

    def colour_histogram(self, x: torch.Tensor) -> torch.Tensor:
        """(B, bins^3) square-rooted joint RGB histograms (fractions of pixels) of preprocessed images
        (x = (p - 0.5) / 0.5): bin floor(p * bins) per channel. Counted as (one-hot red x green)^T @
        one-hot blue per image, O(B S^2 bins^2) memory and exportable (comparisons and a matmul)."""
        bins = self.config.colour_bins
        p = ((x.float().clamp(-1.0, 1.0) + 1.0) * (bins / 2.0)).floor().clamp(max=bins - 1)  # (B, 3, S, S)
        levels = torch.arange(bins, device=x.device, dtype=p.dtype)
        r, g, b = (
            (p[:, c].flatten(1).unsqueeze(-1) == levels).to(torch.float32) for c in range(3)
        )  # (B, S^2, bins)
        rg = (r.unsqueeze(-1) * g.unsqueeze(-2)).flatten(2)  # (B, S^2, bins^2), column r * bins + g
        counts = torch.bmm(rg.transpose(1, 2), b).flatten(1)  # (B, bins^3), column (r * bins + g) * bins + b
        return (counts / p[:, 0].flatten(1).shape[1]).sqrt()

    def gradient_histogram(self, x: torch.Tensor) -> torch.Tensor:
        """(B, grid^2 bins) orientation histograms of the grey thumbnail's gradients (a HOG): central
        differences (edges replicated), each pixel's magnitude counted in the nearest of `gradient_bins`
        signed directions (the largest projection; ties split), summed per cell of a grid x grid layout,
        L2-normalised over the whole descriptor and square-rooted. Convolution-free and angle-free
        (projections, a max, comparisons), so it traces and exports like the rest of the forward."""
        grid, bins, side = self.config.gradient_grid, self.config.gradient_bins, self.config.pixel_side
        g = self.grey_thumbnail(x).view(-1, 1, side, side)
        g = F.pad(g, (1, 1, 1, 1), mode="replicate")
        gx = g[:, :, 1:-1, 2:] - g[:, :, 1:-1, :-2]  # (B, 1, side, side)
        gy = g[:, :, 2:, 1:-1] - g[:, :, :-2, 1:-1]
        theta = torch.arange(bins, device=x.device, dtype=g.dtype) * (2 * math.pi / bins)
        proj = gx * theta.cos().view(1, -1, 1, 1) + gy * theta.sin().view(
            1, -1, 1, 1
        )  # (B, bins, side, side)
        nearest = (proj == proj.amax(dim=1, keepdim=True)).to(g.dtype)
        nearest = nearest / nearest.sum(dim=1, keepdim=True)
        counts = F.avg_pool2d((gx * gx + gy * gy).sqrt() * nearest, side // grid).flatten(
            1
        )  # (B, bins grid^2)
        return F.normalize(counts, dim=-1).sqrt()

    @torch.no_grad()
    def set_pixel_mean(self, images: Iterable[torch.Tensor]) -> None:
        """Fit the anchor's centres: the mean grey thumbnail (and colour, gradient histograms) over batches
        of the training images."""
        total, n = torch.zeros(self.pixel_dim, dtype=torch.float64), 0
        colour = torch.zeros(self.colour_dim, dtype=torch.float64)
        gradient = torch.zeros(self.gradient_dim, dtype=torch.float64)
        for batch in images:
            if self.pixel_dim:
                total += self.grey_thumbnail(batch).double().sum(dim=0).cpu()
            if self.colour_dim:
                colour += self.colour_histogram(batch).double().sum(dim=0).cpu()
            if self.gradient_dim:
                gradient += self.gradient_histogram(batch).double().sum(dim=0).cpu()
            n += batch.shape[0]
        if n == 0:
            raise ValueError("set_pixel_mean needs at least one image")
        if self.pixel_dim:
            self.pixel_mean.copy_((total / n).to(self.pixel_mean))
        if self.colour_dim:
            self.colour_mean.copy_((colour / n).to(self.colour_mean))
        if self.gradient_dim:
            self.gradient_mean.copy_((gradient / n).to(self.gradient_mean))

    def pixel_descriptor(self, x: torch.Tensor) -> torch.Tensor:
        """(B, side^2) unit rows: the grey thumbnail minus the training mean (a centred cosine)."""
        return F.normalize(self.grey_thumbnail(x) - self.pixel_mean, dim=-1)

    def colour_descriptor(self, x: torch.Tensor) -> torch.Tensor:
        """(B, bins^3) unit rows: the colour histogram minus the training mean (a centred cosine)."""
        return F.normalize(self.colour_histogram(x) - self.colour_mean, dim=-1)

    def gradient_descriptor(self, x: torch.Tensor) -> torch.Tensor:
        """(B, grid^2 bins) unit rows: the gradient histogram minus the training mean (a centred cosine)."""
        return F.normalize(self.gradient_histogram(x) - self.gradient_mean, dim=-1)

    @property
    def has_anchor(self) -> bool:
        """Whether the served embedding carries pixels, colour or gradients beside the tower (the loss, by
        default, sees the tower alone)."""
        return bool(self.pixel_dim or self.colour_dim or self.gradient_dim)

    def tower_embed(self, x: torch.Tensor, return_features: bool = False):
        """The tower's own unit embeddings h / |h|, (B, tower_dim): what training's loss sees."""
        h = self.features(x)  # (B, D)
        z = F.normalize(h, dim=-1)  # (B, D)
        return (z, h) if return_features else z

    def forward(self, x: torch.Tensor, return_features: bool = False, anchored: bool = True):
        """Unit embeddings z = h / |h|, (B, D); with `return_features`, (z, h) (one forward, DDP-safe).
        With the pixel anchor, z is [sqrt(1 - w - c) h / |h|, sqrt(w) p(x), sqrt(c) q(x)] unless `anchored`
        is False."""
        z, h = self.tower_embed(x, return_features=True)
        if self.has_anchor and anchored:
            w, c, e = self.pixel_weight, self.colour_weight, self.gradient_weight
            parts = [z * (1.0 - w - c - e) ** 0.5]
            if self.pixel_dim:
                parts.append(self.pixel_descriptor(x).to(z.dtype) * w**0.5)
            if self.colour_dim:
                parts.append(self.colour_descriptor(x).to(z.dtype) * c**0.5)
            if self.gradient_dim:
                parts.append(self.gradient_descriptor(x).to(z.dtype) * e**0.5)
            z = torch.cat(parts, dim=-1)
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
        n = (
            len(images.dataset)
            if isinstance(images, DataLoader) and hasattr(images.dataset, "__len__")
            else None
        )

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
        with (
            torch.inference_mode(),
            tqdm(total=n, desc="embed", unit="img", disable=not progress, leave=False) as bar,
        ):
            for batch in batches:
                z = encoder(batch.to(device=device, dtype=torch.float32))  # (B, D)
                out.append(z.float().cpu().numpy())
                bar.update(batch.shape[0])
    finally:
        encoder.train(was_training)
    if not out:
        return np.zeros((0, encoder.embed_dim), dtype=np.float32)
    return np.ascontiguousarray(np.concatenate(out, axis=0), dtype=np.float32)
