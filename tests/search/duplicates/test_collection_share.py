"""The collection's share of items with a duplicate: EM against data drawn with a known share, the re-weighed
bias against Bayes' rule by hand, and p(none) from the verified-score cache against a direct sum."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import norm

from search.duplicates.calibration import DuplicateCalibration, collection_share
from search.duplicates.groups import VerifiedScores


def _calibration(positives: int, negative_weights: list[float], tau=0.5, bias=3.0, max_probability=0.999):
    return DuplicateCalibration(temperature=tau, bias=bias, threshold=0.9, target_precision=0.99, ece=0.0,
                                held_out=positives + len(negative_weights), positives=[0.9] * positives,
                                negatives=[0.1] * len(negative_weights), negative_weights=negative_weights,
                                max_probability=max_probability)


@pytest.mark.parametrize("true_share", [0.01, 0.2, 0.7])
@pytest.mark.parametrize("design_share", [0.5, 0.3])
def test_em_recovers_the_share_it_was_drawn_with(true_share, design_share):
    """Items have a duplicate with probability `true_share`; each gives evidence x ~ N(+1.5, 1) if it has one,
    N(-1.5, 1) if not (overlapping), and p(none | x) is the exact posterior under the calibration's
    `design_share`. EM must find `true_share` from those posteriors alone."""
    rng = np.random.default_rng(int(true_share * 1000) + int(design_share * 10))
    n = 40_000
    has = rng.random(n) < true_share
    x = np.where(has, rng.normal(1.5, 1.0, n), rng.normal(-1.5, 1.0, n))
    f1, f0 = norm.pdf(x, 1.5, 1.0), norm.pdf(x, -1.5, 1.0)
    p_none = (1 - design_share) * f0 / ((1 - design_share) * f0 + design_share * f1)
    got = collection_share(p_none, design_share)
    # the sampling error of a share estimated from n items whose classes overlap: a few binomial SEs
    assert abs(got - has.mean()) < 4 * np.sqrt(true_share * (1 - true_share) / n) + 2e-3
    # a fixed point: the mean posterior re-weighed to the estimate is the estimate
    a, c = got / design_share, (1 - got) / (1 - design_share)
    assert np.mean((1 - p_none) * a / ((1 - p_none) * a + p_none * c)) == pytest.approx(got, abs=1e-8)


def test_em_on_a_collection_without_duplicates_goes_to_the_floor_and_needs_items():
    assert collection_share(np.ones(100), 0.5) < 1e-5
    with pytest.raises(ValueError, match="at least one"):
        collection_share(np.array([]), 0.5)


def test_with_share_is_bayes_rule_on_every_candidate_and_on_none():
    calib = _calibration(300, [0.5] * 200 + [2.0] * 100)      # pi0 = 300 / (300 + 300) = 0.5
    assert calib.design_share == pytest.approx(0.5)
    assert _calibration(100, [1.0] * 300).design_share == pytest.approx(0.25)
    energies = np.array([4.0, 3.2, 1.0])

    def softmax(c):
        logits = np.r_[c.bias, energies] / c.temperature
        return np.exp(logits - logsumexp(logits))

    p = softmax(calib)
    for share in (0.02, 0.2, 0.8):
        shifted = calib.with_share(share)
        assert shifted.temperature == calib.temperature and shifted.geometry_weights == calib.geometry_weights
        by_hand = np.r_[p[0] * (1 - share) / 0.5, p[1:] * share / 0.5]
        np.testing.assert_allclose(softmax(shifted), by_hand / by_hand.sum(), rtol=1e-10)
        # the most sure it can be, re-weighed the same way
        best = calib.bias + calib.temperature * np.log(calib.max_probability / (1 - calib.max_probability))  # its s
        assert shifted.max_probability == pytest.approx(1 / (1 + np.exp(-(best - shifted.bias) / shifted.temperature)))
    assert calib.with_share(0.5).bias == pytest.approx(calib.bias)


def test_none_probabilities_from_the_cache_equal_the_softmax_of_each_row():
    calib = _calibration(10, [1.0] * 10, tau=0.7, bias=2.5)
    cache = VerifiedScores(4, 3)
    cache.put(0, np.array([1, 2]), np.array([0.99, 0.95]), np.array([5.0, 3.0]))
    cache.put(1, np.array([0]), np.array([0.99]), np.array([5.0]))
    cache.put(2, np.array([], dtype=np.int64), np.array([]), np.array([]))     # no verified candidate: p(none) = 1
    # row 3 never scored: left out
    got = cache.none_probabilities(calib)
    expect = [np.exp(2.5 / 0.7 - logsumexp(np.r_[2.5, e] / 0.7)) for e in ([5.0, 3.0], [5.0], [])]
    np.testing.assert_allclose(got, expect, rtol=1e-12)
