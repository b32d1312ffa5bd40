"""Losses: NT-Xent layout, InfoNCE vs brute force and hand-built cross entropy, registry."""

import math

import pytest
import torch
import torch.nn.functional as F

from training.losses import (
    LOSSES,
    ContrastiveLoss,
    InfoNCELoss,
    available_losses,
    contrastive_similarities,
    create_loss,
)


def _unit(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)


def brute_force_infonce(z_a, z_b, tau):
    """Per-anchor loop straight from the definition: -log exp(s_ap/tau) / sum_{c != a} exp(s_ac/tau)."""
    z = torch.cat([z_a, z_b])
    n = z_a.shape[0]
    total = 0.0
    for a in range(2 * n):
        p = a + n if a < n else a - n
        denom = sum(math.exp(float(z[a] @ z[c]) / tau) for c in range(2 * n) if c != a)
        total += -math.log(math.exp(float(z[a] @ z[p]) / tau) / denom)
    return total / (2 * n)


@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0])
def test_infonce_matches_brute_force(tau):
    z_a, z_b = _unit(5, 4, 0), _unit(5, 4, 1)
    out = InfoNCELoss()(z_a, z_b, tau)
    assert abs(float(out.loss) - brute_force_infonce(z_a, z_b, tau)) < 1e-6


def test_infonce_matches_cross_entropy_on_hand_built_logits():
    z_a, z_b = _unit(3, 4, 2), _unit(3, 4, 3)
    tau = 0.2
    z = torch.cat([z_a, z_b])  # rows 0..2 view a, 3..5 view b
    logits = (z @ z.T) / tau
    logits.fill_diagonal_(float("-inf"))
    target = torch.tensor([3, 4, 5, 0, 1, 2])
    ref = F.cross_entropy(logits, target)
    assert torch.allclose(InfoNCELoss()(z_a, z_b, tau).loss, ref, atol=1e-12)


def test_identical_embeddings_give_log_candidates():
    # all similarities equal -> uniform over the 2N - 1 candidates
    z = F.normalize(torch.ones(4, 3, dtype=torch.float64), dim=1)
    out = InfoNCELoss()(z, z.clone(), 0.3)
    assert abs(float(out.loss) - math.log(7)) < 1e-9
    assert out.stats["pos_sim_mean"] == pytest.approx(1.0)


def test_similarities_layout_and_offsets():
    big_n, n, d = 6, 2, 3
    z_a, z_b = _unit(big_n, d, 4), _unit(big_n, d, 5)
    z_all = torch.cat([z_a, z_b])
    full_sim, full_pos, full_self = contrastive_similarities(z_all, z_all, 0)
    assert torch.equal(full_self, torch.arange(2 * big_n))
    assert torch.equal(full_pos, torch.cat([torch.arange(big_n, 2 * big_n), torch.arange(big_n)]))
    for rank in range(big_n // n):
        off = rank * n
        z_local = torch.cat([z_a[off : off + n], z_b[off : off + n]])
        sim, pos, self_idx = contrastive_similarities(z_local, z_all, off)
        rows = torch.cat([torch.arange(off, off + n), torch.arange(big_n + off, big_n + off + n)])
        assert torch.equal(sim, full_sim[rows])
        assert torch.equal(pos, full_pos[rows]) and torch.equal(self_idx, full_self[rows])
    with pytest.raises(ValueError, match="local_offset"):
        contrastive_similarities(torch.cat([z_a[:n], z_b[:n]]), z_all, big_n)
    with pytest.raises(ValueError, match="even"):
        contrastive_similarities(z_all[:3], z_all, 0)


def test_split_means_equal_full_loss_infonce():
    """Mean over rank-wise local losses == loss on the full batch (what DDP relies on)."""
    big_n, n = 6, 3
    z_a, z_b = _unit(big_n, 4, 6), _unit(big_n, 4, 7)
    z_all = torch.cat([z_a, z_b])
    loss = InfoNCELoss()
    parts = []
    for off in (0, n):
        z_local = torch.cat([z_a[off : off + n], z_b[off : off + n]])
        parts.append(loss.loss_from_similarities(*contrastive_similarities(z_local, z_all, off), 0.2).loss)
    assert torch.allclose(sum(parts) / 2, loss(z_a, z_b, 0.2).loss, atol=1e-12)


def test_temperature_tensor_gets_gradient():
    tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    z_a, z_b = _unit(4, 3, 8), _unit(4, 3, 9)
    InfoNCELoss()(z_a, z_b, tau).loss.backward()
    # finite-difference check of d loss / d tau
    eps = 1e-6
    fd = (brute_force_infonce(z_a, z_b, 0.3 + eps) - brute_force_infonce(z_a, z_b, 0.3 - eps)) / (2 * eps)
    assert abs(float(tau.grad) - fd) < 1e-5


def test_registry_and_errors():
    assert "infonce" in available_losses()
    assert isinstance(create_loss("infonce"), InfoNCELoss)
    with pytest.raises(ValueError, match="nope"):
        create_loss("nope")
    with pytest.raises(ValueError, match="infonce"):
        create_loss("infonce", bogus=1)
    with pytest.raises(ValueError, match="equal shapes"):
        InfoNCELoss()(torch.zeros(2, 3), torch.zeros(3, 3), 0.1)


@pytest.mark.parametrize("name", available_losses())
def test_every_registered_loss_is_finite_and_differentiable(name):
    z_a = _unit(6, 4, 10).float().requires_grad_(True)
    z_b = _unit(6, 4, 11).float()
    loss = create_loss(name)
    assert isinstance(loss, ContrastiveLoss) and LOSSES[name] is type(loss)
    out = loss(z_a, z_b, 0.2)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(z_a.grad).all() and z_a.grad.abs().sum() > 0
    assert all(isinstance(v, float) for v in out.stats.values())
