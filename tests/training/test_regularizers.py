"""The vanishing Gaussianity regulariser (docs/theory.md §4) against numpy and its closed-form minimiser."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import load_train_config
from training.regularizers import RIDGE, gaussian_regularizer, vanishing_weight
from training.trainer import train

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def test_matches_numpy():
    h = np.random.default_rng(0).normal(size=(64, 5)) * [1, 2, 3, 0.5, 1] + 0.3
    ref = (h**2).sum(1).mean() - np.linalg.slogdet(np.cov(h, rowvar=False) + RIDGE * np.eye(5))[1]
    assert float(gaussian_regularizer(torch.tensor(h))) == pytest.approx(ref, rel=1e-10)


def test_minimiser_is_white_and_centred():
    """Minimising R over an affine map of fixed samples: mean 0 and the (biased) covariance = I.

    E|h|^2 = |mean|^2 + tr C_biased and Cov (unbiased) = B/(B-1) C_biased, so with C_biased = s I
    R = |mean|^2 + D s - D log s - D log(B/(B-1)), minimised at mean 0, s = 1."""
    torch.manual_seed(0)
    x = (
        torch.randn(512, 3, dtype=torch.float64)
        @ torch.tensor([[2.0, 0.5, 0], [0, 1.0, 0.3], [0, 0, 0.2]], dtype=torch.float64)
        + 1.5
    )
    a = torch.eye(3, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([a, b], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = gaussian_regularizer(x @ a + b, ridge=0.0)
        loss.backward()
        return loss

    opt.step(closure)
    h = (x @ a + b).detach().numpy()
    np.testing.assert_allclose(h.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(np.cov(h, rowvar=False, bias=True), np.eye(3), atol=1e-4)
    assert float(gaussian_regularizer(torch.tensor(h), ridge=0.0)) == pytest.approx(
        3.0 - 3.0 * np.log(512 / 511), rel=1e-6
    )


def test_weight_vanishes():
    w = [vanishing_weight(t, 0.1, 100) for t in (0, 100, 1000, 10**6)]
    assert (
        w[0] == 0.1 and w[1] == pytest.approx(0.05) and all(a > b for a, b in zip(w, w[1:])) and w[-1] < 1e-5
    )
    with pytest.raises(ValueError):
        vanishing_weight(0, -1.0, 100)
    with pytest.raises(ValueError):
        gaussian_regularizer(torch.zeros(1, 4))


def test_trainer_logs_and_applies_it(tmp_path):
    common = ["steps=6", "log_every=1", "checkpoint_every=100"]
    train(load_train_config(TINY, common + [f'out_dir="{tmp_path / "plain"}"']))
    train(
        load_train_config(
            TINY, common + ["gaussian_reg=0.05", "gaussian_reg_decay=2", f'out_dir="{tmp_path / "reg"}"']
        )
    )
    plain = [json.loads(l) for l in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    reg = [json.loads(l) for l in (tmp_path / "reg" / "metrics.jsonl").read_text().splitlines()]
    assert "gaussian_reg" not in plain[0]
    assert [r["gaussian_reg_weight"] for r in reg] == pytest.approx([0.05 / (1 + t / 2) for t in range(6)])
    # Same seed and data: the first step's loss differs by exactly alpha_0 * R(h).
    assert reg[0]["loss"] - plain[0]["loss"] == pytest.approx(
        0.05 * reg[0]["gaussian_reg"], rel=1e-4, abs=1e-6
    )
    with pytest.raises(ValueError, match="gaussian_reg"):
        load_train_config(TINY, ["gaussian_reg=-1"]).validate()
