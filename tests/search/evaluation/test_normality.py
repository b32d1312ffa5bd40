"""Normality tests: statistics against direct formulas, and each test's level on simulated Gaussian data
at the demo report's size (n = 512 queries, 64-d features of rank 62) within a binomial interval."""

import math

import numpy as np
import pytest
from scipy import special, stats

from search.evaluation.normality import (
    coordinate_normality,
    gaussianity,
    mardia,
    mardia_null,
    norm_concentration,
    plot_qq,
    projection_normality,
    univariate_normality,
)

RNG = np.random.default_rng(4)
N, D = 1500, 6
REPORT_N, REPORT_D = 512, 64  # the demo report: 512 held-out queries, embed_dim 64


def level_interval(trials: int, alpha: float, conf: float = 0.999) -> tuple[float, float]:
    """Central `conf` binomial interval of the rejection rate of a level-alpha test over `trials` runs."""
    lo, hi = stats.binom.interval(conf, trials, alpha)
    return lo / trials, hi / trials


def report_like_gaussian(rng, n=REPORT_N, d=REPORT_D, lost=2):
    """Gaussian features with a random mean and covariance whose last `lost` directions are degenerate
    (as after a LayerNorm): rank d - lost, the shape of the demo model's features."""
    a = rng.normal(size=(d - lost, d))
    return rng.normal(size=(n, d - lost)) @ a + rng.normal(size=d)


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
    assert g["n"] == N and g["alpha"] == 0.05 and g["expected_fraction_not_rejected"] == 0.95
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
    r = mardia(x, n_null=0)
    assert r["skewness"] == pytest.approx(np.mean(g**3), rel=1e-9)
    assert r["kurtosis"] == pytest.approx(np.mean(np.diag(g) ** 2), rel=1e-9)
    n, d = x.shape
    assert r["kurtosis_expected"] == pytest.approx(d * (d + 2) * (n - 1) / (n + 1))
    # a degenerate direction (e.g. features after LayerNorm) is dropped: affine invariance
    deg = mardia(np.c_[x, x[:, :1] - 2 * x[:, 1:2]], n_null=0)
    assert deg["rank"] == D and deg["skewness"] == pytest.approx(r["skewness"], rel=1e-8)
    assert deg["kurtosis"] == pytest.approx(r["kurtosis"], rel=1e-8)
    with pytest.raises(ValueError, match="rank"):
        mardia(np.ones((20, 3)))


def test_mardia_null_is_the_statistic_on_gaussian_samples():
    """The simulated null equals mardia() on the same standard normal draws (independent whitening by
    eigh)."""
    import torch

    b1, b2 = mardia_null(40, 3, 5, seed=11)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn((5, 40, 3), generator=gen, dtype=torch.float64).numpy()
    for i in range(5):
        r = mardia(x[i], n_null=0)
        assert (r["skewness"], r["kurtosis"]) == (
            pytest.approx(b1[i], rel=1e-9),
            pytest.approx(b2[i], rel=1e-9),
        )


def test_univariate_tests_hold_level_at_report_size():
    """K^2 and Anderson-Darling on 2,000 independent Gaussian columns of n = 512: 5 % rejected."""
    cols = np.random.default_rng(1).normal(size=(REPORT_N, 2000)) * 3.0 + 1.0
    u = univariate_normality(cols)
    lo, hi = level_interval(2000, 0.05)
    assert lo <= 1 - u["k2_fraction_not_rejected"] <= hi
    assert lo <= 1 - u["ad_fraction_not_rejected"] <= hi


def test_mardia_kurtosis_finite_sample_form_holds_level_at_report_size():
    """200 Gaussian samples of the demo's shape (n 512, rank 62): the finite-sample kurtosis z holds 5 %;
    the large-sample centring d(d+2) that the report used before rejects about half of them."""
    rng = np.random.default_rng(2)
    rej, rej_large_sample = [], []
    for _ in range(200):
        r = mardia(report_like_gaussian(rng), n_null=0)
        rej.append(r["kurtosis_pvalue_normal"] <= 0.05)
        d = r["rank"]
        z_old = (r["kurtosis"] - d * (d + 2)) / math.sqrt(8 * d * (d + 2) / REPORT_N)
        rej_large_sample.append(abs(z_old) > stats.norm.ppf(0.975))
    assert r["rank"] == REPORT_D - 2
    lo, hi = level_interval(200, 0.05)
    assert lo <= np.mean(rej) <= hi
    assert np.mean(rej_large_sample) > 0.3


def _mc_levels(n, d, trials, n_null, seed):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(trials):
        r = mardia(report_like_gaussian(rng, n, d, lost=1), n_null=n_null, seed=10_000 + t)
        out.append((r["skewness_pvalue"] <= 0.05, r["kurtosis_pvalue"] <= 0.05))
    return np.mean(out, axis=0)


def test_mardia_simulated_null_holds_level_small():
    """Monte-Carlo Mardia (B = 39: 0.05 x 40 and 0.025 x 40 are integers) on 400 Gaussian samples (64, rank
    7)."""
    skew, kurt = _mc_levels(64, 8, 400, 39, seed=3)
    lo, hi = level_interval(400, 0.05)
    assert lo <= skew <= hi and lo <= kurt <= hi


@pytest.mark.slow
def test_mardia_simulated_null_holds_level_at_report_size():
    """The same at the demo's shape (n 512, rank 62), where the chi2 skewness form is off (variance 25 %
    low)."""
    skew, kurt = _mc_levels(REPORT_N, REPORT_D - 1, 200, 39, seed=5)
    lo, hi = level_interval(200, 0.05)
    assert lo <= skew <= hi and lo <= kurt <= hi


def test_mardia_rejects_non_gaussian_at_report_size():
    rng = np.random.default_rng(6)
    heavy = rng.standard_t(5, size=(REPORT_N, 62)) @ rng.normal(size=(62, 62))
    r = mardia(heavy, n_null=39)
    assert r["kurtosis_pvalue"] <= 0.05 and r["kurtosis_z"] > 5 and r["rejected"]
    skewed = rng.exponential(size=(REPORT_N, 62))
    r = mardia(skewed, n_null=39)
    assert r["skewness_pvalue"] <= 0.05 and r["skewness_z"] > 5
    flat = rng.uniform(size=(REPORT_N, 62))
    assert mardia(flat, n_null=39)["kurtosis_z"] < -5


def test_bundle_and_plot(samples):
    out = gaussianity(samples["gauss"], n_projections=8, n_null=19)
    assert out["mardia"]["skewness_pvalue"] > 0.001 and out["coordinates"]["n_tests"] == D
    assert out["n"] == N and out["d"] == D and out["projections"]["n_projections"] == 8
    assert out["mardia"]["n_null"] == 19 and "simulated" in out["mardia"]["calibration"]
    png = plot_qq({"a": samples["gauss"][:, 0], "b": samples["t2"][:, 0]})
    assert png[:4] == b"\x89PNG"
