"""Langevin noise: zero temperature is the plain optimizer step, noise variance 2 eta T,
sphere constraint, and the stationary laws of SGLD (Gaussian, von Mises-Fisher) in closed form."""

import math

import pytest
import torch

from training.langevin import LangevinNoise, tangent_project
from training.schedules import create_schedule


def _step(seed, noise, lr=0.1):
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x = torch.randn(8, 5)
    model(x).pow(2).sum().backward()
    opt.step()
    if noise is not None:
        noise.apply(model.parameters(), lr, step=10**6)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("sched", [None, 0.0, create_schedule("exp", tau_0=1.0, gamma=0.5, tau_min=0.0)])
def test_zero_temperature_is_exactly_the_optimizer_step(sched):
    ref = _step(0, None)
    got = _step(0, LangevinNoise(sched))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_euclidean_noise_variance_is_2_eta_T():
    p = torch.zeros(400_000)
    gen = torch.Generator().manual_seed(1)
    lr, temp = 0.03, 0.7
    noise = LangevinNoise(create_schedule("fixed", tau=temp), generator=gen)
    assert noise.apply([p], lr, step=3) == pytest.approx(temp)
    assert float(p.mean()) == pytest.approx(0.0, abs=0.005)
    assert float(p.var()) == pytest.approx(2 * lr * temp, rel=0.01)


def test_riemannian_rows_stay_unit_and_noise_is_tangent():
    gen = torch.Generator().manual_seed(2)
    x = torch.nn.functional.normalize(torch.randn(2000, 16, generator=gen), dim=1)
    x0 = x.clone()
    lr, temp = 1e-6, 1.0  # tiny step: displacement ~ tangent noise, std sqrt(2 eta T) per tangent dim
    noise = LangevinNoise(temp, riemannian_params=[x], generator=gen)
    noise.apply([x], lr, step=0)
    assert torch.allclose(x.norm(dim=1), torch.ones(2000), atol=1e-6)
    d = x - x0
    # radial component is second order (|d|^2 / 2), tangential part has (D - 1) 2 eta T variance
    assert float((d * x0).sum(1).abs().max()) < 1e-4
    msd = float(d.pow(2).sum(1).mean())
    assert msd == pytest.approx(15 * 2 * lr * temp, rel=0.03)
    for _ in range(50):  # large steps still keep the constraint
        noise.apply([x], 0.5, step=0)
    assert torch.allclose(x.norm(dim=1), torch.ones(2000), atol=1e-5)


def test_tangent_projection_is_orthogonal():
    x = torch.nn.functional.normalize(torch.randn(10, 4), dim=1)
    v = tangent_project(x, torch.randn(10, 4))
    assert float((v * x).sum(1).abs().max()) < 1e-6


def test_sgld_on_quadratic_reaches_the_gibbs_variance():
    # E = theta^2 / 2 per coordinate; SGLD with SGD: theta <- (1 - eta) theta + sqrt(2 eta T) xi.
    # Stationary variance of this AR(1): 2 eta T / (1 - (1 - eta)^2) = T / (1 - eta / 2).
    gen = torch.Generator().manual_seed(3)
    theta = torch.nn.Parameter(torch.zeros(20_000))
    lr, temp = 0.05, 0.4
    opt = torch.optim.SGD([theta], lr=lr)
    noise = LangevinNoise(create_schedule("fixed", tau=temp), generator=gen)
    for t in range(300):
        opt.zero_grad()
        (0.5 * theta.pow(2)).sum().backward()
        opt.step()
        noise.apply_to_optimizer(opt, t)
    assert float(theta.detach().var()) == pytest.approx(temp / (1 - lr / 2), rel=0.04)


def test_riemannian_langevin_samples_von_mises_fisher_on_s2():
    # E(x) = -a mu.x on S^2 at temperature T: stationary density ~ exp(k mu.x), k = a / T,
    # whose mean cosine is coth(k) - 1/k (d = 3).
    gen = torch.Generator().manual_seed(4)
    mu = torch.tensor([0.0, 0.0, 1.0])
    x = torch.nn.functional.normalize(torch.randn(4000, 3, generator=gen), dim=1)
    a, temp, lr = 1.0, 0.5, 0.01
    noise = LangevinNoise(temp, riemannian_params=[x], generator=gen)
    for t in range(800):
        grad = tangent_project(x, -a * mu.expand_as(x))  # Riemannian gradient of E
        x.copy_(torch.nn.functional.normalize(x - lr * grad, dim=1))
        noise.apply([x], lr, t)
    k = a / temp
    expected = 1 / math.tanh(k) - 1 / k
    assert float((x @ mu).mean()) == pytest.approx(expected, abs=0.02)


def test_bad_inputs():
    with pytest.raises(ValueError, match="noise_schedule"):
        LangevinNoise("hot")
    with pytest.raises(ValueError):
        LangevinNoise(-1.0)
    with pytest.raises(ValueError, match="lr"):
        LangevinNoise(1.0).apply([torch.zeros(3)], -0.1, 0)
