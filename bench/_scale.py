"""A 10^6-item index store for the at-scale benchmarks (bench/serve_memory.py, bench/eval_scale.py).

The database is the synthetic dataset (exact latent generator, so `softsearch eval` has its ideal
search) rendered at 16 x 16 and embedded by a small seeded ViT tower (d = 128), in an IVF-PQ index
(nlist 1024, 32 bytes per vector) built by `index.build.build_index` like any other version. The
store is reused when `root` already holds a current version of that shape (building takes a few
minutes on 2 cores).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger("bench.scale")

MILLION = 1_000_000
ENCODER = dict(image_size=16, width=32, layers=1, heads=2, patch_size=4, embed_dim=128)
IVF_PQ = {"nlist": 1024}


def encoder_checkpoint(path: Path, seed: int = 0) -> Path:
    """The seeded, untrained tower every at-scale store uses (speed and memory do not depend on training)."""
    from training.checkpoint import save_checkpoint
    from training.encoder import EncoderConfig, create_encoder

    if path.is_file():
        return path
    torch.manual_seed(seed)
    return save_checkpoint(path, create_encoder(EncoderConfig(**ENCODER)), step=0, train_config={"bench": "scale"},
                           lineage={"objective": "untrained", "temperature": 0.1})


def synthetic_store(root: Path, size: int, kind: str = "ivf-pq", params: dict | None = None,
                    checkpoint: Path | None = None) -> tuple[Path, str]:
    """(root, current version): a store over `size` synthetic items, built unless it already exists."""
    from index.build import build_index
    from index.store import IndexStore
    from training.datasets import create_dataset

    root = Path(root)
    store = IndexStore(root)
    current = store.current_version()
    if current is not None:
        manifest = store.manifest(current)
        if manifest["count"] == size and manifest["dim"] == ENCODER["embed_dim"] and manifest["kind"] == kind:
            logger.info("reusing %s (%d items, %s)", root, size, kind)
            return root, current
    checkpoint = checkpoint or encoder_checkpoint(root.parent / "scale_encoder.safetensors")
    ds = create_dataset("synthetic", split="train", size=size, seed=0, image_size=ENCODER["image_size"],
                        resolution=ENCODER["image_size"])
    params = dict(IVF_PQ if params is None and kind == "ivf-pq" else params or {})
    version = build_index(checkpoint, ds, root, kind=kind, params=params, batch_size=1024, progress=True)
    return root, version
