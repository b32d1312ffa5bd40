"""The bounded normaliser's lone-query shortcuts (issue #50): a query alone (one faiss call for its dots,
its draws numbered without the batch's bookkeeping, one reduction for its maxima) reads the same rows as
in a batch and gets its answer (to the float32 rounding of <x, mu_l>: a matrix-vector product alone, a
matrix-matrix one in a batch), within 0.01 nats of the float64 logsumexp over every row; and the helpers
that replaced np.unique, nan_to_num and the masked Bennett bound against independent computations
(splitmix64 in Python integers, a per-(query, list) loop)."""

from __future__ import annotations

import math

import faiss
import numpy as np
import pytest
from scipy.special import logsumexp

import search.serving.normaliser as nm
from search.serving.normaliser import ListStats, NormaliserConfig, bounded_log_normaliser

D = 64
FIELDS = ("value", "lower", "upper", "interval_lower", "interval_upper", "rows", "exact_mask")


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(11)
    centres = rng.standard_normal((150, D))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def clustered(n):
        x = centres[rng.integers(0, len(centres), n)] + rng.standard_normal((n, D)) * (0.6 / math.sqrt(D))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    data, q = clustered(15000), clustered(40)
    index = faiss.IndexFlatIP(D)
    index.add(data)
    return dict(data=data, q=q, stats=ListStats.build(data, None), top=index.search(q, 100)[1])


def _close(a, b, err_msg=""):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=err_msg)


@pytest.mark.parametrize("tau", [0.05, 0.1])
def test_a_lone_query_gets_its_answer_in_a_batch(setup, tau):
    """Each of 40 queries alone against batches of 5 and of all 40: the same rows read and the same exact
    fallbacks (the same head lists and draws), values within 1e-5 nats (BLAS rounds the list centres' dots
    differently for one query); within 0.01 nats of the float64 logsumexp, inside the deterministic bound."""
    data, q, stats, top = setup["data"], setup["q"], setup["stats"], setup["top"]
    cfg = NormaliserConfig("bounded")
    alone = [
        bounded_log_normaliser(q[i : i + 1], data, stats, np.full(1, tau), cfg, top[i : i + 1])
        for i in range(len(q))
    ]
    whole = bounded_log_normaliser(q, data, stats, np.full(len(q), tau), cfg, top)
    fives = [
        bounded_log_normaliser(q[i : i + 5], data, stats, np.full(5, tau), cfg, top[i : i + 5])
        for i in range(0, len(q), 5)
    ]
    for name in FIELDS:
        single = np.concatenate([getattr(a, name) for a in alone])
        check = np.testing.assert_array_equal if name in ("rows", "exact_mask") else _close
        check(single, getattr(whole, name), err_msg=name)
        check(single, np.concatenate([getattr(f, name) for f in fives]), err_msg=name)
    ref = logsumexp((q.astype(np.float64) @ data.astype(np.float64).T) / tau, axis=1)
    value = np.concatenate([a.value for a in alone])
    assert np.abs(value - ref).max() <= 0.01
    assert np.all(
        (np.concatenate([a.lower for a in alone]) <= ref) & (ref <= np.concatenate([a.upper for a in alone]))
    )
    assert not np.concatenate(
        [a.exact_mask for a in alone]
    ).all()  # the sample answered, not only the fallback


def test_uniforms_are_splitmix64_in_python_integers():
    """The in-place splitmix64 finaliser against the same steps in Python's unbounded integers mod 2^64."""
    mask = (1 << 64) - 1
    seeds = np.array([0, 1, 2**63 + 5, 0xDEADBEEFCAFEF00D, mask], dtype=np.uint64)
    counter = np.array([0, 7, 2**40 + 3, 5 * 2**40, 12345], dtype=np.int64)
    got = nm._uniforms(seeds, counter)
    for s, c, u in zip(seeds.tolist(), counter.tolist(), got.tolist()):
        z = (s + (c + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        assert u == (z >> 11) / 2**53


def test_known_rows_taken_out_per_query_and_list_as_a_loop_does():
    """`_without_known` (one bincount over the (Q, L) grid) against a loop over each (query, list) pair
    holding known rows: the rest's Jensen bound and log(U_l - H_l) from that pair's rows alone."""
    rng = np.random.default_rng(3)
    n_q, n_lists, n = 3, 12, 600
    where = rng.integers(0, n_lists, n).astype(np.int32)
    order = np.argsort(where, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(where, minlength=n_lists))]).astype(np.int64)
    stats = ListStats(
        offsets, order, where, np.zeros((n_lists, 4), np.float32), np.ones(n_lists), np.ones(n_lists), "test"
    )
    kq = np.repeat(np.arange(n_q), 40)
    kr = rng.integers(0, n, len(kq))
    s_known = rng.normal(0.5, 0.1, len(kq))
    centre = rng.normal(0.4, 0.05, (n_q, n_lists))
    taus = np.array([0.05, 0.1, 0.2])
    slack = np.full(n_q, 1e-5)
    lo = rng.normal(size=(n_q, n_lists))
    hi = np.where(np.arange(n_q)[:, None] == 0, 5.0, 40.0) + lo  # query 0: H_l above U_l, nothing left
    got_lo, got_hi = lo.copy(), hi.copy()
    nm._without_known(got_lo, got_hi, kq, kr, s_known, stats, centre, taus, slack)
    counts = np.diff(offsets)
    touched = np.zeros((n_q, n_lists), bool)
    for qi in range(n_q):
        for li in range(n_lists):
            sel = (kq == qi) & (where[kr] == li)
            if not sel.any():
                continue
            touched[qi, li] = True
            h, size = sel.sum(), counts[li]
            sig = s_known[sel]
            log_hl = logsumexp(sig / taus[qi])
            rest = size - h
            if rest <= 0:
                assert got_lo[qi, li] == -np.inf and got_hi[qi, li] == -np.inf
                continue
            want_lo = (
                math.log(rest)
                + (size * centre[qi, li] - sig.sum()) / rest / taus[qi]
                - slack[qi] * ((size + h) / rest - 1)
            )
            gap = (
                hi[qi, li] + math.log1p(-math.exp(log_hl - hi[qi, li])) if log_hl < hi[qi, li] else -math.inf
            )
            want_hi = max(gap, want_lo)
            assert got_lo[qi, li] == pytest.approx(want_lo, rel=1e-12, abs=1e-12)
            assert got_hi[qi, li] == pytest.approx(want_hi, rel=1e-12, abs=1e-12)
    assert touched.sum() >= n_q * 8
    np.testing.assert_array_equal(got_lo[~touched], lo[~touched])
    np.testing.assert_array_equal(got_hi[~touched], hi[~touched])


def test_bennett_bound_the_same_with_and_without_the_mask():
    """The unmasked path (every b, v > 0) gives the masked path's values, and both the closed form in
    Python floats."""
    rng = np.random.default_rng(5)
    b = rng.uniform(0.1, 30, (4, 50))
    v = rng.uniform(0.0, 1.0, (4, 50)) * b * b
    full = nm.bennett_log_bound(b, v)
    b2 = b.copy()
    b2[0, 0] = 0.0  # one list without spread: the masked path for all
    masked = nm.bennett_log_bound(b2, v)
    np.testing.assert_array_equal(full.reshape(-1)[1:], masked.reshape(-1)[1:])
    assert masked[0, 0] == 0.0
    for bi, vi, got in zip(b.reshape(-1)[:20], v.reshape(-1)[:20], full.reshape(-1)[:20]):
        want = math.log((bi * bi * math.exp(-vi / bi) + vi * math.exp(bi)) / (bi * bi + vi))
        assert got == pytest.approx(max(want, 0.0), rel=1e-12, abs=1e-12)


def test_per_list_tables_are_made_once_and_read_only(setup):
    stats = setup["stats"]
    t = nm._tables(stats)
    assert nm._tables(stats) is t
    np.testing.assert_array_equal(t.counts, np.diff(stats.offsets))
    np.testing.assert_array_equal(t.log_n[t.nonempty], np.log(t.counts[t.nonempty]))
    assert t.min_size == int(t.counts[t.counts > 0].min())
    with pytest.raises(ValueError):
        t.counts[0] = 1
