"""Text tower: an open_clip text transformer whose output is L2-normalised onto the image sphere.

`TextConfig` describes a small custom tower (`open_clip.model.CLIPTextCfg`, CPU-friendly by default)
or names an open_clip model whose text tower (and weights file) is kept. Tokenising uses open_clip's
`SimpleTokenizer`, whose BPE vocabulary ships inside the wheel: nothing is downloaded, ever.

A checkpoint holding a text tower stores its tensors under the prefix ``text.`` beside the image
tower's and its config under the metadata key ``text`` (training/checkpoint.py); `load_text_encoder`
rebuilds it, and returns None for an image-only checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "TextConfig",
    "TextEncoder",
    "text_config_from_dict",
    "load_text_encoder",
    "TEXT_PREFIX",
    "MAX_TEXT_CHARS",
]

TEXT_PREFIX = "text."
#: longest query text accepted (characters); the tokenizer truncates to the context length anyway
MAX_TEXT_CHARS = 1000


@dataclass
class TextConfig:
    """Architecture of the text tower; JSON-able via `dataclasses.asdict`."""

    context_length: int = 32
    vocab_size: int = 49408  # open_clip's SimpleTokenizer vocabulary
    width: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: float = 4.0
    model_name: str | None = None  # an open_clip model whose text tower is used (weights from the checkpoint)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("context_length", "vocab_size", "width", "heads", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"text.{name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"text.width={self.width} must be divisible by text.heads={self.heads}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"text.mlp_ratio must be positive, got {self.mlp_ratio}")


def text_config_from_dict(data: dict[str, Any]) -> TextConfig:
    """Rebuild a TextConfig from its JSON form; unknown keys -> ValueError naming them."""
    known = {f.name for f in fields(TextConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown text config keys: {unknown}; known: {sorted(known)}")
    config = TextConfig(**data)
    config.validate()
    return config


class _ClipText(nn.Module):
    """The text half of a named open_clip CLIP model (token embedding, transformer, projection)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        for name in ("token_embedding", "positional_embedding", "transformer", "ln_final", "text_projection"):
            setattr(self, name, getattr(model, name))
        self.register_buffer("attn_mask", model.attn_mask, persistent=False)
        self.text_pool_type = getattr(model, "text_pool_type", "argmax")
        self.text_eos_id = getattr(model, "text_eos_id", None)
        self._encode = type(model).encode_text

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._encode(self, tokens, normalize=False)


def _text_tower_of(model: nn.Module) -> nn.Module:
    """A CLIP model's text tower: its `.text` (CustomTextCLIP) or the text half of a CLIP."""
    text = getattr(model, "text", None)
    return text if isinstance(text, nn.Module) else _ClipText(model)


class TextEncoder(nn.Module):
    """Tokenizer + text tower + L2 normalisation: `forward(tokens) = g(t) / |g(t)|`, (B, embed_dim)."""

    def __init__(self, config: TextConfig, embed_dim: int, clip_model: nn.Module | None = None):
        super().__init__()
        from open_clip.tokenizer import SimpleTokenizer

        config.validate()
        self.config = config
        self.embed_dim = int(embed_dim)
        if clip_model is not None:
            self.tower = _text_tower_of(clip_model)
            self.config = config = TextConfig(
                **{
                    **asdict(config),
                    "context_length": int(clip_model.context_length),
                    "vocab_size": int(clip_model.vocab_size),
                }
            )
        elif config.model_name is not None:
            import open_clip

            model = open_clip.create_model(
                config.model_name, pretrained=None, pretrained_image=False, pretrained_text=False
            )
            self.tower = _text_tower_of(model)
        else:
            from open_clip.model import CLIPTextCfg, _build_text_tower

            cfg = CLIPTextCfg(
                context_length=config.context_length,
                vocab_size=config.vocab_size,
                width=config.width,
                heads=config.heads,
                layers=config.layers,
                mlp_ratio=config.mlp_ratio,
            )
            self.tower = _build_text_tower(self.embed_dim, cfg)
        self.tokenizer = SimpleTokenizer(context_length=config.context_length)

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """(B, context_length) int64 tokens (truncated to the context; lower-cased, whitespace cleaned)."""
        if isinstance(texts, str):
            texts = [texts]
        for t in texts:
            if not isinstance(t, str):
                raise ValueError(f"text queries must be strings, got {type(t).__name__}")
        return self.tokenizer(list(texts))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.tower(tokens), dim=-1)

    def encode(self, texts: list[str], batch_size: int = 256) -> np.ndarray:
        """Unit embeddings (B, embed_dim) float32 of texts, without gradients."""
        if isinstance(texts, str):
            texts = [texts]
        device = next(self.parameters()).device
        was = self.training
        self.eval()
        out = []
        try:
            with torch.inference_mode():
                for i in range(0, len(texts), batch_size):
                    out.append(
                        self(self.tokenize(texts[i : i + batch_size]).to(device)).float().cpu().numpy()
                    )
        finally:
            self.train(was)
        if not out:
            return np.zeros((0, self.embed_dim), dtype=np.float32)
        return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)

    def metadata(self) -> dict:
        """What a checkpoint stores to rebuild this tower."""
        return {"config": asdict(self.config), "embed_dim": self.embed_dim}


def load_text_encoder(path: str | Path, device: str | torch.device = "cpu") -> TextEncoder | None:
    """The text tower of a softsearch checkpoint (eval mode), or None when it holds only an image tower."""
    from safetensors import safe_open

    from training.checkpoint import read_checkpoint_metadata

    meta = read_checkpoint_metadata(path)
    text = meta.get("text")
    if not text:
        return None
    try:
        config = text_config_from_dict(dict(text["config"]))
        embed_dim = int(text["embed_dim"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} has an invalid text tower record ({err})") from err
    encoder = TextEncoder(config, embed_dim)
    with safe_open(str(path), framework="pt") as fh:
        state = {k[len(TEXT_PREFIX) :]: fh.get_tensor(k) for k in fh.keys() if k.startswith(TEXT_PREFIX)}
    want = encoder.state_dict()
    if set(state) != set(want):
        missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
        raise ValueError(
            f"{path}: text tower weights do not match its config {json.dumps(asdict(config))}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    encoder.load_state_dict(state, strict=True)
    return encoder.to(device).eval()
