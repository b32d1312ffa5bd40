"""Temperature schedules: closed-form values, registry coverage, learnable gradient, validation."""

import math

import numpy as np
import pytest
import torch

from training.schedules import SCHEDULES, TemperatureSchedule, create_schedule


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_builds_with_defaults_and_is_positive(name):
    sched = create_schedule(name)
    assert isinstance(sched, TemperatureSchedule)
    for step in (0, 1, 10, 1000, 10**6):
        tau = float(torch.as_tensor(sched.temperature(step)).detach())
        assert tau > 0 and math.isfinite(tau), (name, step, tau)
    # state_dict round trip into a fresh instance of the same schedule
    other = create_schedule(name, **{k: v for k, v in sched.options.items()})
    other.load_state_dict(sched.state_dict())
    assert float(torch.as_tensor(other.temperature(7)).detach()) == pytest.approx(
        float(torch.as_tensor(sched.temperature(7)).detach())
    )
    assert create_schedule(**sched.describe()).describe() == sched.describe()


def test_fixed():
    assert create_schedule("fixed", tau=0.2).temperature(12345) == 0.2


def test_log_matches_formula_and_paper_form():
    s = create_schedule("log", tau_0=0.5, t_0=10.0, c=2.0, tau_min=0.0)
    for t in (0, 3, 100, 10**5):
        assert s.temperature(t) == pytest.approx(1.0 / (2.0 + math.log(1 + t / 10.0) / 2.0))
    # paper form: 1/T_t = log(t + t_0) / c
    p = create_schedule("log", tau_0=None, t_0=5.0, c=3.0, tau_min=0.0)
    for t in (0, 1, 50, 5000):
        assert p.temperature(t) == pytest.approx(3.0 / math.log(t + 5.0))
    # clipping
    q = create_schedule("log", tau_0=1.0, t_0=1.0, c=1.0, tau_min=0.3, tau_max=0.8)
    assert q.temperature(0) == 0.8 and q.temperature(10**9) == 0.3
    # monotone non-increasing
    vals = [s.temperature(t) for t in range(0, 2000, 50)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_exp_matches_formula():
    s = create_schedule("exp", tau_0=0.8, gamma=0.99, tau_min=0.0)
    for t in (0, 1, 17, 500):
        assert s.temperature(t) == pytest.approx(0.8 * 0.99**t)
    with pytest.warns(RuntimeWarning, match="no longer anneals"):
        assert create_schedule("exp", tau_0=0.8, gamma=0.99, tau_min=0.05).temperature(10**4) == 0.05


def test_cosine_matches_kukleva():
    s = create_schedule("cosine", period=100)
    assert s.temperature(0) == pytest.approx(1.0)
    assert s.temperature(50) == pytest.approx(0.1)
    assert s.temperature(25) == pytest.approx(0.55)
    assert s.temperature(100) == pytest.approx(1.0)
    # epochs: steps_per_epoch=10 -> e = step // 10
    e = create_schedule("cosine", period=100, steps_per_epoch=10)
    assert e.temperature(509) == pytest.approx(s.temperature(50))


def test_learnable_has_gradient_and_clamp():
    s = create_schedule("learnable", tau=0.07)
    assert s.learnable and not create_schedule("fixed").learnable
    tau = s.temperature(0)
    assert isinstance(tau, torch.Tensor) and tau.dim() == 0
    assert float(tau.detach()) == pytest.approx(0.07, rel=1e-6)
    (1.0 / tau).backward()  # d(1/tau)/d logit_scale = exp(logit_scale) = 1/tau
    assert float(s.logit_scale.grad) == pytest.approx(1 / 0.07, rel=1e-5)
    with torch.no_grad():
        s.logit_scale.fill_(10.0)  # 1/tau = e^10 > 100 -> clamped to tau_min
    assert float(s.temperature(0).detach()) == pytest.approx(0.01, rel=1e-6)


@pytest.mark.parametrize(
    "name,opts",
    [
        ("nope", {}),
        ("fixed", {"tau": 0}),
        ("fixed", {"tau": -1}),
        ("exp", {"gamma": 1.5}),
        ("log", {"c": 0}),
        ("log", {"tau_0": None, "t_0": 1.0}),
        ("cosine", {"tau_min": 2.0, "tau_max": 1.0}),
        ("fixed", {"bogus": 1}),
        ("learnable", {"tau": 5.0}),
    ],
)
def test_bad_options_raise_value_error(name, opts):
    with pytest.raises(ValueError):
        create_schedule(name, **opts)


def test_negative_step_raises():
    with pytest.raises(ValueError, match="step"):
        create_schedule("fixed").temperature(-1)


def test_default_log_schedule_is_the_papers_and_keeps_annealing_for_a_million_steps():
    """Defaults: 1/T_t = log(t + t_0) / c with t_0 = 2, c = 1 and no floor, so T strictly decreases
    at every checked step up to 10^6 and equals the closed form."""
    s = create_schedule("log")
    steps = np.unique(
        np.concatenate([np.arange(0, 2000), np.geomspace(2000, 10**6, 400).astype(int), [10**5]])
    )
    temps = np.array([s.temperature(int(t)) for t in steps])
    np.testing.assert_allclose(temps, 1.0 / np.log(steps + 2.0), rtol=1e-12)
    assert np.all(np.diff(temps) < 0)
    assert temps[-1] < temps[steps.tolist().index(10**5)]


def test_a_floor_that_ends_annealing_warns_once_with_the_step():
    s = create_schedule("log", tau_0=1.0, t_0=1.0, c=1.0, tau_min=0.3)
    with pytest.warns(RuntimeWarning, match=r"takes over at step \d+"):
        for t in range(0, 50):
            s.temperature(t)
    # the step named is the first one where the unclipped value falls below the floor
    first = next(t for t in range(50) if 1.0 / (1.0 + math.log1p(t)) < 0.3)
    fresh = create_schedule("log", tau_0=1.0, t_0=1.0, c=1.0, tau_min=0.3)
    with pytest.warns(RuntimeWarning, match=f"at step {first};"):
        for t in range(50):
            fresh.temperature(t)
