"""Synthetic torus renderer: determinism, periodicity, smoothness, identifiability, oracle embedding."""

import numpy as np
import pytest

from training import synthetic
from training.synthetic import M, oracle_embedding, render, sample_latents, wrap_angles

TWO_PI = 2 * np.pi


def _diff(a, b):
    return np.abs(a.astype(np.int16) - b.astype(np.int16))


def test_shapes_and_ranges():
    lat = sample_latents(50, seed=3)
    assert lat.shape == (50, M) and lat.dtype == np.float64
    assert lat.min() >= 0 and lat.max() < TWO_PI
    img = render(lat)
    assert img.shape == (50, 32, 32, 3) and img.dtype == np.uint8
    assert render(lat, resolution=16).shape == (50, 16, 16, 3)


def test_deterministic_and_seeded():
    a, b = sample_latents(20, seed=7), sample_latents(20, seed=7)
    np.testing.assert_array_equal(render(a), render(b))
    c = sample_latents(20, seed=8)
    t = sample_latents(20, seed=7, split="test")
    assert not np.allclose(a, c) and not np.allclose(a, t)
    assert _diff(render(a), render(c)).mean() > 5
    # a larger draw extends the smaller one (size only truncates)
    np.testing.assert_array_equal(sample_latents(40, seed=7)[:20], a)


def test_block_rendering_matches_one_block():
    lat = sample_latents(37, seed=1)
    np.testing.assert_array_equal(render(lat, block=5), render(lat, block=1000))


@pytest.mark.parametrize("axis", range(M))
def test_periodic_in_every_angle(axis):
    lat = sample_latents(16, seed=2)
    shifted = lat.copy()
    shifted[:, axis] += TWO_PI
    neg = lat.copy()
    neg[:, axis] -= 2 * TWO_PI
    # equal up to float32 rounding of cos/sin, which may flip one quantisation level
    assert _diff(render(lat), render(shifted)).max() <= 1
    assert _diff(render(lat), render(neg)).max() <= 1


@pytest.mark.parametrize("axis", range(M))
def test_smooth_in_every_angle(axis):
    lat = sample_latents(16, seed=4)
    base = render(lat).astype(np.float64)
    changes = []
    for delta in (0.005, 0.01, 0.02):
        moved = lat.copy()
        moved[:, axis] += delta
        d = np.abs(render(moved).astype(np.float64) - base)
        # Lipschitz bound from the formulas: the disc centre moves 0.45 * 16 = 7.2 px per radian,
        # the edge ramp has slope <= 0.5 per px and the colour contrast is <= 255 levels:
        # <= 7.2 * 0.5 * 255 ~ 918 levels per radian (gradient, hue: <= 0.3*sqrt2*255, 0.4*255), +1 rounding
        assert d.max() <= 920 * delta + 1, (axis, delta, d.max())
        changes.append(d.mean())
    # and the change grows with delta (not a constant offset, not noise)
    assert changes[0] < changes[1] < changes[2]
    assert changes[2] > 0


@pytest.mark.parametrize("axis", range(M))
def test_each_angle_changes_the_image(axis):
    lat = sample_latents(16, seed=5)
    opposite = lat.copy()
    opposite[:, axis] += np.pi
    d = _diff(render(lat), render(opposite)).reshape(16, -1).mean(axis=1)
    assert d.min() > 3, d


def _circ_err(a, b):
    return np.abs(np.angle(np.exp(1j * (a - b))))


def test_angles_identifiable_by_nearest_neighbour():
    """A nearest-neighbour decoder over a latent grid recovers every angle of held-out images."""
    g = 16
    axes = np.arange(g) * TWO_PI / g
    grid = np.stack(np.meshgrid(axes, axes, axes, indexing="ij"), axis=-1).reshape(-1, M)  # (4096, 3)
    db = render(grid).reshape(len(grid), -1).astype(np.float32)
    lat = sample_latents(40, seed=11, split="test")
    q = render(lat).reshape(40, -1).astype(np.float32)
    # squared distance = |q|^2 - 2 q.d + |d|^2
    dist = (q**2).sum(1)[:, None] - 2 * q @ db.T + (db**2).sum(1)[None, :]
    est = grid[dist.argmin(axis=1)]
    err = _circ_err(est, lat)
    # within one grid step (pi/16 is half a step) for every angle of every image
    assert err.max() < TWO_PI / g, err.max(axis=0)


def test_wrap_angles():
    x = np.array([-1e-18, -0.5, TWO_PI, 7.0, 3.0])
    w = wrap_angles(x)
    assert np.all((w >= 0) & (w < TWO_PI))
    np.testing.assert_allclose(np.cos(w), np.cos(x), atol=1e-12)


def test_oracle_embedding_formula():
    lat = sample_latents(10, seed=6)
    z = oracle_embedding(lat)
    assert z.shape == (10, 2 * M) and z.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-12)
    for n in range(10):
        expected = np.concatenate([[np.cos(t), np.sin(t)] for t in lat[n]]) / np.sqrt(M)
        np.testing.assert_allclose(z[n], expected, atol=1e-15)
    # s = z_x . z_y = (1/m) sum_i cos(theta_i - theta'_i)
    s = z @ z.T
    brute = np.array([[np.mean(np.cos(lat[a] - lat[b])) for b in range(10)] for a in range(10)])
    np.testing.assert_allclose(s, brute, atol=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="shape"):
        render(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="non-finite"):
        render(np.full((1, 3), np.nan))
    with pytest.raises(ValueError, match="valid"):
        sample_latents(3, seed=0, split="valid")
    with pytest.raises(ValueError, match="resolution"):
        render(np.zeros((1, 3)), resolution=2)


def test_default_sizes():
    assert synthetic.DEFAULT_SIZES == {"train": 4096, "test": 512}
