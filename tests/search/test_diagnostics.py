import math

import numpy as np
import pytest
from scipy import special, stats

from search.diagnostics import (
    coordinate_normality, gaussianity, gpd_tail, mardia, norm_concentration, plot_qq, plot_tail,
    projection_normality, tail_diagnostics, weibull_gumbel,
)

RNG = np.random.default_rng(4)
N, D = 1500, 6


@pytest.fixture(scope="module")
def samples():
    return {
        "gauss": RNG.normal(size=(N, D)),
        "uniform": RNG.uniform(-1, 1, size=(N, D)),
        "t2": RNG.standard_t(2, size=(N, D)),
    }


def test_norm_cv_matches_chi_closed_form():
    d = 32
    x = RNG.normal(size=(20000, d))
    mu = math.sqrt(2) * math.exp(special.gammaln((d + 1) / 2) - special.gammaln(d / 2))  # E chi_d
    cv = math.sqrt(d - mu * mu) / mu
    assert norm_concentration(x)["norm_cv"] == pytest.approx(cv, rel=0.03)


def test_normality_separates_gaussian_uniform_heavy(samples):
    g = coordinate_normality(samples["gauss"])
    assert g["k2_fraction_not_rejected"] >= 4 / 6 and g["ad_fraction_not_rejected"] >= 4 / 6
    for name in ("uniform", "t2"):
        r = coordinate_normality(samples[name])
        assert r["k2_fraction_not_rejected"] == 0.0 and r["ad_fraction_not_rejected"] == 0.0, name
    assert projection_normality(samples["gauss"], 20)["k2_fraction_not_rejected"] >= 0.8
    assert projection_normality(samples["t2"], 20)["k2_fraction_not_rejected"] <= 0.1


def test_mardia_against_direct_formula(samples):
    x = samples["uniform"][:200]
    xc = x - x.mean(0)
    s_inv = np.linalg.inv(xc.T @ xc / len(x))
    g = xc @ s_inv @ xc.T
    r = mardia(x, block=37)
    assert r["skewness"] == pytest.approx(np.mean(g ** 3), rel=1e-9)
    assert r["kurtosis"] == pytest.approx(np.mean(np.diag(g) ** 2), rel=1e-9)
    assert mardia(samples["gauss"])["kurtosis_pvalue"] > 0.01
    assert mardia(samples["uniform"])["kurtosis_z"] < -10  # platykurtic
    assert mardia(samples["t2"])["kurtosis_z"] > 10        # heavy tails
    # a degenerate direction (e.g. features after LayerNorm) is dropped: affine invariance
    deg = mardia(np.c_[x, x[:, :1] - 2 * x[:, 1:2]])
    assert deg["rank"] == D and deg["skewness"] == pytest.approx(r["skewness"], rel=1e-8)
    assert deg["kurtosis"] == pytest.approx(r["kurtosis"], rel=1e-8)
    with pytest.raises(ValueError, match="rank"):
        mardia(np.ones((20, 3)))


@pytest.mark.parametrize("xi", [-0.4, 0.3])
def test_gpd_recovers_known_shape(xi):
    v = stats.genpareto.rvs(xi, scale=0.5, size=1500, random_state=7)
    r = gpd_tail(v, threshold=0.0, n_boot=60)
    assert r["xi_low"] < xi < r["xi_high"]
    assert r["finite_endpoint"] == (xi < 0)
    if xi < 0:
        assert r["endpoint"] == pytest.approx(0.5 / 0.4, rel=0.1)


def test_weibull_vs_gumbel_on_power_law_shortfalls():
    rng = np.random.default_rng(0)
    d = rng.uniform(size=(200, 200)) ** (1 / 3)  # F(delta) = delta^3 near 0: Weibull, beta = 3
    w = weibull_gumbel(np.sort(d, axis=1)[:, :32])
    assert 2.5 < w["beta_median"] < 3.5 and w["daic_median"] > 5
    s = rng.normal(0, 0.1, size=(200, 2000))  # Gaussian similarities far below the cap: Gumbel domain
    g = weibull_gumbel(1 - (-np.sort(-s, axis=1)[:, :32]))
    assert g["daic_median"] < 0 < w["daic_median"] and g["fraction_weibull"] < w["fraction_weibull"]


def test_bundle_and_plots(samples):
    out = gaussianity(samples["gauss"], n_projections=8)
    assert out["mardia"]["skewness_pvalue"] > 0.001 and out["coordinates"]["n_tests"] == D
    z = RNG.normal(size=(300, 8))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    t = tail_diagnostics(z[:40], z[40:], top_m=16, n_boot=20)
    # on the sphere S^7 the similarity has endpoint 1: a bounded tail, xi < 0 at the point estimate
    assert t["gpd"]["xi"] < 0 and t["gpd"]["endpoint"] <= 1.2
    for png in (plot_qq({"a": samples["gauss"][:, 0], "b": samples["t2"][:, 0]}), plot_tail(t)):
        assert png[:4] == b"\x89PNG"
