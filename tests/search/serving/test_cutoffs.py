"""cut_and_page against a brute-force rule applied hit by hit (seeded random cases)."""

import numpy as np
import pytest

from search.serving.cutoffs import cut_and_page


def brute(p, k, offset, min_probability, mass):
    kept, total = [], 0.0
    for i, v in enumerate(p):
        if min_probability is not None and v < min_probability:
            break
        if mass is not None and total >= mass * (1 - 1e-12):
            break
        kept.append(i)
        total += v
    return kept[offset : offset + k], len(kept)


@pytest.mark.parametrize("seed", range(200))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    s = rng.normal(size=int(rng.integers(n, 200))) * rng.uniform(0.2, 6)
    full = np.sort(np.exp(s - np.logaddexp.reduce(s)))[::-1]
    p = full[:n]
    k, offset = int(rng.integers(1, 20)), int(rng.integers(0, 10))
    mp = None if rng.random() < 0.3 else float(rng.choice(full))
    mass = None if rng.random() < 0.3 else float(rng.uniform(0.05, 1.0))
    page = cut_and_page(p, k, offset, mp, mass)
    want, n_passed = brute(p, k, offset, mp, mass)
    assert list(range(page.start, page.stop)) == want and page.n_passed == n_passed
    # more may pass only when every fetched hit passed and no mass target was reached
    reached = mass is not None and p.sum() >= mass * (1 - 1e-12)
    assert page.more_may_pass == (n_passed == n and not reached)


def test_mass_one_keeps_everything_and_bad_input_is_refused():
    p = np.array([0.5, 0.3, 0.2])
    assert cut_and_page(p, 10, mass=1.0, fetched_all=True).n_passed == 3
    assert cut_and_page(p, 10, mass=0.5).n_passed == 1  # the first hit alone reaches 0.5
    with pytest.raises(ValueError):
        cut_and_page(p[::-1], 3)
