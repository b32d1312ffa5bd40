"""The calibration's stratified "none" sample: weighted fits and figures equal the same fits on the queries
repeated weight times, and the sample's weighted means estimate the collection's without bias."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy.special import logsumexp

from search.duplicates.calibration import (expected_calibration_error, fit, fit_with_geometry, precision_curve,
                                           query_scores, scored_candidates, threshold_for_precision)
from search.duplicates.job import HARD_FRACTION, hard_negative_sample, nearest_other_cosine
from tests.search.duplicates.test_duplicates import _planted, _Version


def _geometry_queries(n: int, rng) -> list:
    """Verified-stage queries (5 candidates with evidence and geometry) whose answer is drawn from the model."""
    a, c, u = 1.0 / 0.5, 3.0 / 0.5, np.array([20.0, 10.0, 1.0])
    queries = []
    for _ in range(n):
        e = rng.uniform(1.0, 5.0, 5)
        g = np.abs(rng.normal(0.0, [0.05, 0.05, 0.5], (5, 3)))
        logits = np.r_[c, a * e - g @ u]
        answer = int(rng.choice(6, p=np.exp(logits - logsumexp(logits)))) - 1
        rows = np.arange(5) + 100
        queries.append(scored_candidates(e, rows, int(rows[answer]) if answer >= 0 else -1, g))
    return queries


def _weighted_and_repeated(queries, rng):
    """The queries with integer weights 1..3, and the same list with each query repeated that many times."""
    weights = rng.integers(1, 4, len(queries))
    weighted = [replace(q, weight=float(w)) for q, w in zip(queries, weights)]
    repeated = [q for q, w in zip(queries, weights) for _ in range(int(w))]
    return weighted, repeated


def test_weighted_geometry_fit_equals_the_fit_on_repeated_queries():
    rng = np.random.default_rng(3)
    queries = _geometry_queries(400, rng)
    weighted, repeated = _weighted_and_repeated(queries, rng)
    tau_w, b_w, w_w = fit_with_geometry(weighted)
    tau_r, b_r, w_r = fit_with_geometry(repeated)
    assert tau_w == pytest.approx(tau_r, rel=1e-4) and b_w == pytest.approx(b_r, rel=1e-4, abs=1e-4)
    np.testing.assert_allclose(w_w, w_r, rtol=1e-3, atol=1e-3)
    assert fit_with_geometry(queries)[0] != pytest.approx(tau_w, rel=1e-4)   # the weights did change the fit


def test_weighted_encoder_fit_equals_the_fit_on_repeated_queries():
    rng = np.random.default_rng(4)
    queries = []
    for _ in range(300):
        s = np.clip(rng.normal(0.5, 0.15, 200), -1, 1)
        s[int(rng.integers(200))] = rng.uniform(0.85, 1.0)
        logits = np.r_[0.9 / 0.03, s / 0.03]
        answer = int(rng.choice(201, p=np.exp(logits - logsumexp(logits)))) - 1
        queries.append(query_scores(s, source=answer))
    weighted, repeated = _weighted_and_repeated(queries, rng)
    (tau_w, b_w), (tau_r, b_r) = fit(weighted), fit(repeated)
    assert tau_w == pytest.approx(tau_r, rel=1e-3) and b_w == pytest.approx(b_r, abs=1e-4)


def test_weighted_ece_threshold_and_precision_equal_the_repeated_figures():
    rng = np.random.default_rng(5)
    conf = rng.uniform(0.3, 1.0, 200)
    correct = rng.random(200) < conf ** 2
    w = rng.integers(1, 4, 200)
    rep_conf, rep_correct = np.repeat(conf, w), np.repeat(correct, w)
    ece_w, table_w = expected_calibration_error(conf, correct, weights=w)
    ece_r, table_r = expected_calibration_error(rep_conf, rep_correct)
    assert ece_w == pytest.approx(ece_r, rel=1e-12)
    assert [b["observed"] for b in table_w] == pytest.approx([b["observed"] for b in table_r], rel=1e-12)
    assert threshold_for_precision(conf, correct, 0.9, w) == threshold_for_precision(rep_conf, rep_correct, 0.9)
    # and the threshold is the lowest p whose kept queries reach the target, by brute force over every p
    reach = [t for t in conf if np.average(correct[conf >= t], weights=w[conf >= t]) >= 0.9]
    assert threshold_for_precision(conf, correct, 0.9, w) == max(0.9, min(reach))
    assert [r["precision"] for r in precision_curve(conf, correct, weights=w)] == pytest.approx(
        [r["precision"] for r in precision_curve(rep_conf, rep_correct)], rel=1e-12)


def test_nearest_other_cosine_is_the_brute_force_one():
    x = _planted(n=300)
    version = _Version(x)
    rows = np.arange(300)
    s = x.astype(np.float64) @ x.astype(np.float64).T
    np.fill_diagonal(s, -np.inf)
    np.testing.assert_allclose(nearest_other_cosine(version, rows, block=64), s.max(axis=1), atol=1e-5)


@pytest.mark.parametrize("m", [40, 10])     # the pool is the whole collection (m = 40) or a uniform half (10)
def test_hard_negative_sample_takes_the_look_alikes_and_is_unbiased(m):
    x = _planted(n=400)
    version = _Version(x)
    n = x.shape[0]
    near = np.zeros(n)
    near[:9] = 1.0                        # the planted copies: the items with a close look-alike
    hardness = nearest_other_cosine(version, np.arange(n))
    estimates, uniform = [], []
    for seed in range(300):
        rng = np.random.default_rng(seed)
        rows, weights = hard_negative_sample(version, m, rng)
        assert rows.size == m and len(set(rows.tolist())) == m and weights.mean() == pytest.approx(1.0)
        if m == 40:      # hard stratum = top 10 % of 400 = 40 rows; 20 of them drawn; all 9 planted are in it
            assert set(np.flatnonzero(hardness >= np.sort(hardness)[-int(HARD_FRACTION * n)])) >= set(range(9))
        estimates.append(np.average(near[rows], weights=weights))
        uniform.append(near[rng.choice(n, m, replace=False)].mean())
    truth = near.mean()
    # Horvitz-Thompson: the weighted mean is unbiased (4 standard errors of the mean of 300 draws)
    assert abs(np.mean(estimates) - truth) < 4 * np.std(estimates) / np.sqrt(len(estimates)) + 1e-12
    assert np.std(estimates) < np.std(uniform)          # and less variable than a uniform sample of the same size
