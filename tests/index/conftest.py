"""Fixtures for the index tests: a tiny saved encoder checkpoint and random unit vectors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# index_refs.py sits beside this file; importlib mode does not put it on sys.path.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

TINY_ENCODER = dict(width=32, layers=1, heads=2, embed_dim=16, patch_size=8)


def _random_checkpoint(directory, seed: int, step: int, tau: float, lineage: dict, metrics: dict):
    """A randomly initialised TINY_ENCODER ViT (seeded) saved as a real checkpoint in `directory`."""
    import torch

    from training.checkpoint import save_checkpoint
    from training.encoder import EncoderConfig, create_encoder

    torch.manual_seed(seed)
    encoder = create_encoder(EncoderConfig(**TINY_ENCODER))
    path = directory / "checkpoint.safetensors"
    save_checkpoint(
        path,
        encoder,
        step=step,
        train_config={"schedule": "fixed", "schedule_options": {"temperature": tau}},
        lineage=lineage,
        metrics=metrics,
    )
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A randomly initialised 1-layer ViT (16-dim embeddings) saved as a real checkpoint."""
    return _random_checkpoint(
        tmp_path_factory.mktemp("ckpt"),
        seed=0,
        step=7,
        tau=0.25,
        lineage={"objective": "infonce", "temperature_schedule": "fixed"},
        metrics={},
    )


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory):
    """A second, differently initialised checkpoint of the same architecture (for rebuild)."""
    return _random_checkpoint(
        tmp_path_factory.mktemp("ckpt2"),
        seed=1,
        step=9,
        tau=0.5,
        lineage={"objective": "weince", "temperature_schedule": "fixed"},
        metrics={"temperature": 0.4},
    )


@pytest.fixture(autouse=True)
def _single_faiss_thread():
    """FAISS's OpenMP threads spin under the shared 2-core load; one thread is faster here."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)
