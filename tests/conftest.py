"""Shared pytest fixtures: tiny seeded datasets (kept small: six suites share two CPU cores)."""

from __future__ import annotations

import numpy as np
import pytest

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
