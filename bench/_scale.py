"""A 10^6-item index store for the at-scale benchmarks (bench/serve_memory.py, bench/eval_scale.py).

The database is the synthetic dataset (exact latent generator, so `softsearch eval` has its ideal
search) rendered at 16 x 16 and embedded by a small ViT tower (d = 128) trained here for 300 InfoNCE
steps on the same rendering (an untrained tower maps every image to nearly the same point, where the
calibrated temperature collapses to ~3e-4 and the gap's underflow guard redoes most rows), in an IVF-PQ index
(nlist 1024, 32 bytes per vector) built by `index.build.build_index` like any other version. The
store is reused when `root` already holds a current version of that shape (building takes a few
minutes on 2 cores). 32-byte PQ codes of these embeddings reach a recall@10 below the 0.95 target,
so a refused version is activated with `force` (recorded in the store's history as such): these
stores measure time and memory, not search quality.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("bench.scale")

MILLION = 1_000_000
ENCODER = dict(image_size=16, width=32, layers=1, heads=2, patch_size=4, embed_dim=128)
IVF_PQ = {"nlist": 1024}


def encoder_checkpoint(path: Path, steps: int = 300) -> Path:
    """The tower every at-scale store uses: configs/synthetic.toml's InfoNCE run with ENCODER, on the
    16-pixel rendering, `steps` steps (about a minute on 2 cores); reused when `path` exists."""
    import shutil

    from training.config import load_train_config
    from training.trainer import train

    if path.is_file():
        return path
    out = path.parent / (path.stem + "_run")
    sets = [
        f'out_dir="{out}"',
        f"steps={steps}",
        "warmup_steps=30",
        "checkpoint_every=100000",
        "progress=false",
        'device="cpu"',
        "dataset_options={resolution=16}",
    ]
    sets += [f"encoder.{k}={v}" for k, v in ENCODER.items()]
    checkpoint = train(
        load_train_config(Path(__file__).resolve().parents[1] / "configs" / "synthetic.toml", sets)
    )
    shutil.copyfile(checkpoint, path)
    return path


def synthetic_store(
    root: Path, size: int, kind: str = "ivf-pq", params: dict | None = None, checkpoint: Path | None = None
) -> tuple[Path, str]:
    """(root, current version): a store over `size` synthetic items, built unless it already exists."""
    from index.build import BuildOptions, build_index
    from index.store import IndexStore
    from training.datasets import create_dataset

    root = Path(root)
    store = IndexStore(root)
    current = store.current_version()
    if current is not None:
        manifest = store.manifest(current)
        if manifest.count == size and manifest.dim == ENCODER["embed_dim"] and manifest.kind == kind:
            logger.info("reusing %s (%d items, %s)", root, size, kind)
            return root, _servable(store, current)
    checkpoint = checkpoint or encoder_checkpoint(root.parent / "scale_encoder.safetensors")
    ds = create_dataset(
        "synthetic",
        split="train",
        size=size,
        seed=0,
        image_size=ENCODER["image_size"],
        resolution=ENCODER["image_size"],
    )
    params = dict(IVF_PQ if params is None and kind == "ivf-pq" else params or {})
    version = build_index(
        checkpoint,
        ds,
        root,
        BuildOptions(kind=kind, params=params, batch_size=1024, progress=True, force=True),
    )
    return root, _servable(store, version)


def _servable(store, version: str) -> str:
    """`version`, made current by a forced activation when the activation rule refuses it (see above)."""
    from index.gate import ActivationRefused

    try:
        store.serving_check(version)
    except ActivationRefused as err:
        logger.warning("activating %s with force for this benchmark: %s", version, err)
        store.activate(version, force=True, path="bench/_scale.py")
    return version
