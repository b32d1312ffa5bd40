"""The bounded normaliser in two steps (bounded_start without the index's rows, bounded_finish merging them)
and a single query's start overlapped with the index search, against a float64 brute force over every row."""

from __future__ import annotations

import math
import threading

import faiss
import numpy as np
import pytest
from scipy.special import logsumexp

import search.serving.normaliser as nm
from search.serving.normaliser import (
    ListStats,
    Normaliser,
    NormaliserConfig,
    bounded_finish,
    bounded_log_normaliser,
    bounded_start,
)

D = 32
FIELDS = ("value", "lower", "upper", "interval_lower", "interval_upper", "rows", "exact_mask")


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(3)
    centres = _unit(rng.standard_normal((12, D)))
    data = _unit(centres[rng.integers(0, 12, 2400)] + 0.5 * rng.standard_normal((2400, D)) / math.sqrt(D))
    quant = faiss.IndexFlatIP(D)
    ivf = faiss.IndexIVFFlat(quant, D, 64, faiss.METRIC_INNER_PRODUCT)
    ivf.train(data)
    ivf.add(data)
    q = _unit(data[rng.integers(0, len(data), 40)] + 0.2 * rng.standard_normal((40, D)) / math.sqrt(D))
    s = q.astype(np.float64) @ data.astype(np.float64).T
    return {"data": data, "stats": ListStats.build(data, ivf), "q": np.ascontiguousarray(q), "s": s}


def _top(s: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-s, axis=1)[:, :k].astype(np.int64)


def _same(a, b) -> None:
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def test_index_rows_outside_the_head_are_counted_once(setup):
    """The index's top 200 rows carry most of Z; one head list leaves most of them in the tail, where the
    sample (3x the tail's size) draws them again. Each must count once: exactly, and 0 in the sample. The
    rows merged after the start carry >= 25 % of Z in every query, so dropping them or counting them twice
    would miss by >= log 1.25 = 0.22 nats; the estimate is within 0.02 of the float64 value (no fallback)."""
    data, stats, q, s = setup["data"], setup["stats"], setup["q"], setup["s"]
    tau = 0.1
    taus = np.full(len(q), tau)
    cfg = NormaliserConfig("bounded", head_rows=1, samples=8192, max_samples=8192, max_se=1.0, top_rows=200)
    top = _top(s, 200)
    ref = logsumexp(s / tau, axis=1)
    start = bounded_start(q, data, stats, taus, cfg)
    got = bounded_finish(start, top)
    # the merged rows: top rows outside each query's head lists, and their share of Z
    outside = ~start.in_head[np.arange(len(q))[:, None], stats.where[top].astype(np.int64)]
    share = np.exp(logsumexp(np.where(outside, np.take_along_axis(s, top, 1) / tau, -np.inf), axis=1) - ref)
    assert share.min() >= 0.25, share.min()
    # the sample drew them too (so the '0 in the sample' rule is what keeps them from counting twice)
    drawn = np.zeros(len(q), dtype=np.int64)
    for w, row in zip(start.draws.dw, start.draws.rows):
        drawn[start.todo[w]] += row in set(top[start.todo[w]][outside[start.todo[w]]].tolist())
    assert (drawn > 0).all(), drawn
    assert not got.exact_mask.any()
    assert np.all(got.lower <= ref) and np.all(ref <= got.upper)
    assert np.abs(got.value - ref).max() < 0.02, np.abs(got.value - ref).max()
    # the one-call form is the two steps
    _same(got, bounded_log_normaliser(q, data, stats, taus, cfg, top))


def test_a_tail_all_known_is_exact_and_leaves_the_batch_alone(setup):
    """Query 0's index rows are every row: nothing is left to sample, its log Z is the float64 sum (to the
    float32 dots' rounding) and its bound holds; the other queries of the batch (whose draws the start made
    alongside) get what they get alone."""
    data, stats, q, s = setup["data"], setup["stats"], setup["q"][:3], setup["s"][:3]
    taus = np.array([0.1, 0.1, 0.2])
    cfg = NormaliserConfig("bounded", head_rows=100, samples=512, top_rows=len(data))
    top = np.full((3, len(data)), -1, dtype=np.int64)
    top[0] = _top(s[:1], len(data))[0]
    top[1:, :50] = _top(s[1:], 50)
    got = bounded_log_normaliser(q, data, stats, taus, cfg, top)
    ref = logsumexp(s / taus[:, None], axis=1)
    assert abs(got.value[0] - ref[0]) < 1e-4 and got.lower[0] <= ref[0] <= got.upper[0]
    assert np.isnan(got.interval_lower[0]) and got.rows[0] == len(data)
    for i in (1, 2):
        alone = bounded_log_normaliser(q[i : i + 1], data, stats, taus[i : i + 1], cfg, top[i : i + 1])
        for f in FIELDS:  # (the batch's (Q, L) product may round its last bits differently)
            np.testing.assert_allclose(getattr(got, f)[i : i + 1], getattr(alone, f), rtol=1e-7, err_msg=f)
    assert np.abs(got.value - ref).max() < 0.05


def test_overlap_runs_the_start_beside_the_search_with_the_same_answer(setup, monkeypatch):
    data, stats, q, s = setup["data"], setup["stats"], setup["q"], setup["s"]
    taus = np.full(1, 0.1)
    where = []
    real_start = nm.bounded_start

    def spy(*args, **kwargs):
        where.append(("start", threading.current_thread().name))
        return real_start(*args, **kwargs)

    monkeypatch.setattr(nm, "bounded_start", spy)
    both = Normaliser(NormaliserConfig("bounded", head_rows=200, samples=256, overlap=True), "bounded", stats)
    serial = Normaliser(
        NormaliserConfig("bounded", head_rows=200, samples=256, overlap=False), "bounded", stats
    )
    for i in range(8):
        x = q[i : i + 1]

        def search(i=i):
            where.append(("search", threading.current_thread().name))
            return _top(s[i : i + 1], 100)

        a, top_a = both.search_and_normalise(x, data, taus, search)
        b, top_b = serial.search_and_normalise(x, data, taus, search)
        np.testing.assert_array_equal(top_a, top_b)
        _same(a, b)
        assert abs(a.value[0] - logsumexp(s[i] / 0.1)) < 0.01
    me = threading.current_thread().name
    starts = [name for kind, name in where if kind == "start"]
    assert len(starts) == 16 and starts.count(me) == 8, where  # the serial ones on this thread
    assert all(name.startswith("normaliser") for name in starts if name != me), where
    assert all(name == me for kind, name in where if kind == "search")
    # a batch runs one after the other, on the caller's thread
    where.clear()
    both.search_and_normalise(q[:4], data, np.full(4, 0.1), lambda: _top(s[:4], 100))
    assert where == [("start", me)]


def test_a_failed_search_is_raised_after_the_start_finishes(setup):
    data, stats, q = setup["data"], setup["stats"], setup["q"]
    norm = Normaliser(NormaliserConfig("bounded", head_rows=200, samples=256, overlap=True), "bounded", stats)

    def search():
        raise RuntimeError("index gone")

    with pytest.raises(RuntimeError, match="index gone"):
        norm.search_and_normalise(q[:1], data, np.full(1, 0.1), search)
    assert norm._helper().submit(lambda: 7).result() == 7  # the helper is free again
