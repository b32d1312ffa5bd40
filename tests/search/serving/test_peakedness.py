"""Peakedness against numpy: exact entropy when every item is returned, an upper bound otherwise."""

import numpy as np
import pytest

from search.serving.peakedness import peakedness


@pytest.mark.parametrize("tau", [0.05, 0.3, 5.0])
def test_full_distribution_gives_the_exact_effective_number(tau):
    rng = np.random.default_rng(0)
    s = rng.uniform(-1, 1, 500)
    p = np.exp(s / tau - np.logaddexp.reduce(s / tau))
    got = peakedness(p, 500)
    assert got.effective_candidates_at_most == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-9)
    assert got.top1_vs_uniform == pytest.approx(p.max() * 500)
    assert got.near_uniform == (p.max() * 500 < 2)


def test_topk_bound_holds_and_is_tight_when_the_rest_is_uniform():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n, k = 1000, 10
        s = rng.normal(size=n) * rng.uniform(0.1, 5)
        p = np.exp(s - np.logaddexp.reduce(s))
        top = np.sort(p)[::-1][:k]
        got = peakedness(top, n)
        assert got.effective_candidates_at_most >= np.exp(-(p * np.log(p)).sum()) * (1 - 1e-9)
        assert got.topk_mass == pytest.approx(top.sum())
    # the rest exactly uniform: the bound is the entropy itself
    p = np.r_[[0.5, 0.2], np.full(30, 0.3 / 30)]
    assert peakedness(p[:2], 32).effective_candidates_at_most == pytest.approx(np.exp(-(p * np.log(p)).sum()))


def test_uniform_search_is_flagged_in_plain_words():
    got = peakedness(np.full(10, 1 / 468), 468)
    assert got.near_uniform and got.top1_vs_uniform == pytest.approx(1.0) and "near-uniform" in got.hint
    assert got.effective_candidates_at_most == pytest.approx(468)
