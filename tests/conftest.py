"""Shared pytest fixtures: tiny seeded datasets (kept small: six suites share two CPU cores)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # tests/image_files.py: generated awkward image files

from training.datasets import create_dataset


@pytest.fixture(scope="session")
def tiny_synthetic():
    """64-item synthetic train split (seed 0, kappa 8): latents, labels-free, 32x32 RGB."""
    return create_dataset("synthetic", split="train", size=64, seed=0)


@pytest.fixture(scope="session")
def tiny_synthetic_test():
    """32-item synthetic test split (seed 0): an independent seed stream from tiny_synthetic."""
    return create_dataset("synthetic", split="test", size=32, seed=0)


@pytest.fixture
def rng():
    """A fresh seeded numpy Generator per test."""
    return np.random.default_rng(1234)


#: The smallest built-in open_clip CLIP config without timm or Hugging Face towers (43 M parameters).
OPEN_CLIP_MODEL = "ViT-S-32-alt"
OPEN_CLIP_TEMPERATURE = 0.05


@pytest.fixture(scope="session")
def open_clip_weights(tmp_path_factory):
    """A randomly initialised (seeded) open_clip OPEN_CLIP_MODEL saved in the layouts open_clip's own
    `pretrained=FILE` loader accepts -> {"name", "temperature" (its 1 / exp(logit_scale)),
    "model": the model (eval), "files": {layout: path}}.

    Layouts: the Hugging Face hub's safetensors state dict, `torch.save` of a state dict (.bin),
    an open_clip_train checkpoint (`state_dict` under DDP `module.` prefixes, optimizer alongside)
    and a half-precision state dict (as OpenAI's released weights are). Nothing is downloaded.
    """
    import math

    import open_clip
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = open_clip.create_model(OPEN_CLIP_MODEL, pretrained=None, pretrained_text=False).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(1 / OPEN_CLIP_TEMPERATURE))
    base = tmp_path_factory.mktemp("open_clip")
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    files = {
        "safetensors": base / "open_clip_model.safetensors",
        "bin": base / "open_clip_pytorch_model.bin",
        "train_checkpoint": base / "epoch_2.pt",
        "fp16": base / "fp16_state_dict.pt",
    }
    save_file(state, str(files["safetensors"]))
    torch.save(state, files["bin"])
    torch.save(
        {
            "epoch": 2,
            "name": "run",
            "state_dict": {f"module.{k}": v for k, v in state.items()},
            "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": list(range(len(state)))}]},
        },
        files["train_checkpoint"],
    )
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, files["fp16"])
    return {"name": OPEN_CLIP_MODEL, "temperature": OPEN_CLIP_TEMPERATURE, "model": model, "files": files}


TUXPAINT_STAMPS = "/usr/share/tuxpaint/stamps"


@pytest.fixture(scope="session")
def make_image_folder():
    """make_image_folder(dest, count, classes=3, size=64) -> dest: a folder of `count` real PNG files in
    `classes` class subfolders -- tuxpaint stamps (Debian tuxpaint-stamps-default) flattened onto
    white and squared to `size` px, or seeded generated pictures where that package is missing."""
    from pathlib import Path

    from PIL import Image

    stamps = sorted(Path(TUXPAINT_STAMPS).rglob("*.png")) if Path(TUXPAINT_STAMPS).is_dir() else []

    def make(dest, count: int, classes: int = 3, size: int = 64, seed: int = 0) -> Path:
        dest = Path(dest)
        rng = np.random.default_rng(seed)
        picks = rng.choice(len(stamps), size=count, replace=False) if len(stamps) >= count else None
        for i in range(count):
            if picks is not None:
                with Image.open(stamps[picks[i]]) as im:
                    rgba = im.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                image = Image.alpha_composite(white, rgba).convert("RGB").resize((size, size), Image.BICUBIC)
                name = stamps[picks[i]].stem
            else:
                image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
                name = f"generated{i:04d}"
            folder = dest / f"class{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{i:04d}-{name}.png")
        return dest

    return make


_CACHE_ENV = "SOFTSEARCH_CACHE_DIR"


def pytest_configure(config):
    """Image caches of this session go to a private temporary directory, never ~/.cache
    (several suites run at once; each starts from an empty cache). Subprocesses inherit it."""
    config._softsearch_cache = (tempfile.mkdtemp(prefix="softsearch-test-cache-"), os.environ.get(_CACHE_ENV))
    os.environ[_CACHE_ENV] = config._softsearch_cache[0]


def pytest_unconfigure(config):
    path, before = getattr(config, "_softsearch_cache", (None, None))
    if path:
        shutil.rmtree(path, ignore_errors=True)
        if before is None:
            os.environ.pop(_CACHE_ENV, None)
        else:
            os.environ[_CACHE_ENV] = before
