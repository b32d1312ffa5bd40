import numpy as np
import pytest
from search_refs import Labels, VonMises, oracle

from search.evaluation.k_law import KLawResult, LatentSampler, PoolSampler, k_law, k_law_summary, plot_k_law

KS = (1, 4, 16, 64, 256, 1024)


@pytest.fixture(scope="module")
def oracle_law():
    m, kappa = 3, 1.0
    return k_law(LatentSampler(m, kappa, 1 / (m * kappa)), ks=KS, n_queries=2000, seed=0)


def test_k_times_difference_bounded_and_difference_shrinks(oracle_law):
    r = oracle_law
    kd = np.abs(r.k_times_diff)
    # bounded: no growth over the grid beyond noise (k x diff ~ const, here about 0.3)
    assert kd[-1] < 2 * kd[2] + 4 * r.k_times_diff_se[-1]
    assert np.all(kd < 1.0)
    # the difference itself shrinks ~ 1/k: three decades of k -> at least 30x smaller
    assert abs(r.diff[-1]) < abs(r.diff[1]) / 30
    # it is resolved: the sign is stable and well beyond 2 se at large k
    assert np.all(np.abs(r.diff[2:]) > 2 * r.diff_se[2:])


def test_symmetry_identity_holds(oracle_law):
    """Plain MC risk == E[R H(q,p)] over marginal databases == E[H(q,p)] over databases with the positive."""
    r = oracle_law
    for other, se in ((r.risk_symmetric, r.risk_symmetric_se), (r.ce_with_positive, r.ce_with_positive_se)):
        z = np.abs(r.risk - other) / np.sqrt(r.risk_se**2 + se**2)
        assert np.all(z < 4.5), z


def test_k1_closed_form_for_oracle():
    """k=1 with the oracle embedding at tau=1/(m kappa): p = q on 2 items, so H(q,p) = H(q) and the
    risk is E_{y0~p(y|x), y1~p(y)}[log(1 + r1/r0)], estimated here by brute-force quadrature over m=1."""
    kappa = 2.0
    r = k_law(LatentSampler(1, kappa, 1 / kappa), ks=(1,), n_queries=40000, seed=1)
    t = np.linspace(0, 2 * np.pi, 721)[:-1]
    dens = np.exp(kappa * np.cos(t))
    dens /= dens.sum()  # p(dtheta0) on the grid; r(dtheta) = 2 pi p(dtheta) on the uniform grid
    rr = dens * len(t)
    risk = np.sum(dens[:, None] / len(t) * np.log1p(rr[None, :] / rr[:, None]))
    assert r.risk[0] == pytest.approx(risk, abs=4 * r.risk_se[0])


def test_pool_sampler_consistent():
    rng = np.random.default_rng(3)
    qlat, dlat = rng.uniform(0, 2 * np.pi, (60, 2)), rng.uniform(0, 2 * np.pi, (800, 2))
    s = PoolSampler(oracle(qlat), qlat, oracle(dlat), dlat, VonMises(1.0), 0.5)
    np.testing.assert_allclose(np.exp(s.log_r).mean(1), 1.0, rtol=1e-10)  # E_pool r~ = 1
    r = k_law(s, ks=(2, 32), n_queries=3000, seed=0)
    z = np.abs(r.risk - r.risk_symmetric) / np.sqrt(r.risk_se**2 + r.risk_symmetric_se**2)
    assert np.all(z < 4.5)
    lab = k_law(
        PoolSampler(oracle(qlat), np.arange(60) % 3, oracle(dlat), np.arange(800) % 3, Labels(), 0.5),
        ks=(1, 64),
        n_queries=500,
    )
    assert lab.undefined_fraction[0] > 0.3 and lab.undefined_fraction[1] == 0.0


def test_table_estimator_adds_up_and_matches_plain_risk(oracle_law):
    """The one estimator of the table and plot: risk_est = E H + gap exactly, at least as precise as either of
    the plain difference and the control variate, consistent with the plain MC risk."""
    r = oracle_law
    np.testing.assert_allclose(r.risk_est, r.ce_marginal + r.diff, rtol=1e-10, atol=1e-12)
    assert np.all(r.diff_se <= 1.001 * np.minimum(r.diff_plain_se, r.diff_cv_se))
    assert np.all((r.diff_weight >= 0) & (r.diff_weight <= 1))
    z = np.abs(r.risk - r.risk_est) / np.sqrt(r.risk_se**2 + r.risk_est_se**2)
    assert np.all(z < 4.5), z
    d = r.to_dict()
    assert "control variate" in d["estimator"] and d["summary"]["text"]


def test_summary_says_what_the_curve_shows(oracle_law):
    flat = k_law_summary(oracle_law)
    assert flat["flat"] and "flat at" in flat["text"] and flat["from_k"] == 64
    ks = np.array([1, 4, 16, 64, 256, 1024])
    grow = np.array([-0.5, -2.0, -6.0, -10.0, -14.0, -18.0])  # still growing, small se
    fake = KLawResult(
        ks=ks,
        risk=ks * 0.0,
        risk_se=ks * 0.0,
        risk_symmetric=ks * 0.0,
        risk_symmetric_se=ks * 0.0,
        ce_marginal=ks * 0.0,
        ce_marginal_se=ks * 0.0,
        ce_with_positive=ks * 0.0,
        ce_with_positive_se=ks * 0.0,
        diff=grow / ks,
        diff_se=0.3 / ks,
    )
    s = k_law_summary(fake)
    assert not s["flat"] and "not flat" in s["text"] and "-18" in s["text"]


def test_plot_and_bad_input(oracle_law):
    png = plot_k_law(oracle_law)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="ks"):
        k_law(LatentSampler(2, 1.0, 0.5), ks=(0, 2))
