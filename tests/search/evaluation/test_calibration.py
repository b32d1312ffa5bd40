import numpy as np
import pytest
from search_refs import Labels, VonMises, oracle, unit

from search.evaluation.calibration import calibrate_temperature
from search.evaluation.gap import softmax_gap_dense

RNG = np.random.default_rng(2)


def test_oracle_calibrates_to_one_over_m_kappa():
    m, kappa = 3, 4.0
    qlat, dlat = RNG.uniform(0, 2 * np.pi, (40, m)), RNG.uniform(0, 2 * np.pi, (300, m))
    res = calibrate_temperature(
        oracle(qlat), oracle(dlat), qlat, dlat, VonMises(kappa), train_temperature=0.5
    )
    assert res.temperature == pytest.approx(1 / (m * kappa), rel=0.01)
    assert abs(res.gap_at_calibrated["kl"]) < 1e-4
    assert res.gap_at_train["kl"] > 0.05
    tau, gap = res
    assert tau == res.temperature and gap == res.gap_at_calibrated["kl"]
    # the curve's minimum is (close to) tau*, and the dense reference agrees at a curve point
    i = int(np.argmin(res.curve_cross_entropy))
    assert abs(np.log(res.curve_tau[i] / res.temperature)) < 0.2
    ref = softmax_gap_dense(oracle(qlat), oracle(dlat), qlat, dlat, VonMises(kappa), res.curve_tau[0])
    assert res.curve_kl[0] == pytest.approx(ref.kl.mean(), rel=1e-5)


def test_calibrated_beats_every_grid_point_labels():
    dl, ql = RNG.integers(0, 4, 200), RNG.integers(0, 4, 30)
    centres = unit(RNG.normal(size=(4, 8)))
    zd, zq = (
        unit(centres[dl] + 0.5 * RNG.normal(size=(200, 8))),
        unit(centres[ql] + 0.5 * RNG.normal(size=(30, 8))),
    )
    res = calibrate_temperature(zq, zd, ql, dl, Labels(), train_temperature=0.07)
    best = softmax_gap_dense(zq, zd, ql, dl, Labels(), res.temperature).cross_entropy.mean()
    for t in np.exp(np.linspace(np.log(1e-3), np.log(10), 60)):
        assert best <= softmax_gap_dense(zq, zd, ql, dl, Labels(), t).cross_entropy.mean() + 1e-7


def test_bad_bounds():
    z = unit(RNG.normal(size=(3, 2)))
    with pytest.raises(ValueError, match="bounds"):
        calibrate_temperature(z, z, np.zeros(3, int), np.zeros(3, int), Labels(), bounds=(1.0, 0.1))
