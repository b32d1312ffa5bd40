"""search/serving/normaliser.py against independent computations: float64 dense logsumexp over every row,
per-list moments by plain numpy, the Bennett inequality on explicit laws, and coverage counts."""

from __future__ import annotations

import math

import faiss
import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import binom

from search.serving.normaliser import (
    ListStats,
    Normaliser,
    NormaliserConfig,
    bennett_log_bound,
    bounded_log_normaliser,
    choose_method,
    log_normaliser,
)

D = 32


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _clustered(n: int, rng, clusters: int = 40, spread: float = 0.8) -> np.ndarray:
    """Unit rows around `clusters` centres with cluster sizes varying 1:20 and varying spreads."""
    centres = _unit(rng.standard_normal((clusters, D)))
    sizes = rng.uniform(1, 20, clusters)
    which = rng.choice(clusters, size=n, p=sizes / sizes.sum())
    scale = rng.uniform(0.3, 1.5, clusters)[which, None] * spread
    return _unit(centres[which] + scale * rng.standard_normal((n, D)) / math.sqrt(D))


def _dense_log_z(q: np.ndarray, e: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """The reference: float64 similarities of every row, scipy logsumexp."""
    s = q.astype(np.float64) @ e.astype(np.float64).T  # (Q, N)
    return logsumexp(s / taus[:, None], axis=1)


def _ivf(data: np.ndarray, nlist: int, pq: bool = False) -> faiss.Index:
    quant = faiss.IndexFlatIP(D)
    index = (
        faiss.IndexIVFPQ(quant, D, nlist, 8, 6, faiss.METRIC_INNER_PRODUCT)
        if pq
        else faiss.IndexIVFFlat(quant, D, nlist, faiss.METRIC_INNER_PRODUCT)
    )
    index.train(data)
    index.add(data)
    return index


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(5)
    return _clustered(12000, rng)


@pytest.fixture(scope="module")
def stats_ivf(data):
    return ListStats.build(data, _ivf(data, 64))


def _queries(data: np.ndarray, rng, n: int) -> np.ndarray:
    """A mix: stored rows, rows plus noise, uniform directions, negated rows (the far side)."""
    k = n // 4
    rows = data[rng.integers(0, len(data), k)]
    noisy = _unit(data[rng.integers(0, len(data), k)] + 0.3 * rng.standard_normal((k, D)) / math.sqrt(D))
    uniform = _unit(rng.standard_normal((k, D)))
    far = -data[rng.integers(0, len(data), n - 3 * k)]
    return np.ascontiguousarray(np.concatenate([rows, noisy, uniform, far]), dtype=np.float32)


# ----------------------------------------------------------------------------- the inequality


def test_bennett_bound_holds_on_explicit_laws_and_is_attained(rng):
    for _ in range(2000):
        m = int(rng.integers(2, 60))
        t = rng.standard_normal(m) * rng.uniform(0.01, 5) + rng.standard_exponential(m) * rng.uniform(0, 3)
        t -= t.mean()  # mean exactly 0
        b = t.max() * rng.uniform(1.0, 1.5)  # any b >= max t
        v = np.mean(t * t) * rng.uniform(1.0, 2.0)  # any v >= mean t^2
        bound = bennett_log_bound(b, v)
        assert math.log(np.mean(np.exp(t))) <= bound + 1e-12
        assert bound >= 0.0  # Jensen: mean exp(t) >= 1
    # the two-point law on {-v/b, b} attains it; v = b^2 gives cosh(b)
    for b, v in [(0.3, 0.02), (2.0, 1.0), (8.0, 3.0), (40.0, 100.0)]:
        pb = v / (b * b + v)
        attained = math.log((1 - pb) * math.exp(-v / b) + pb * math.exp(b))
        assert bennett_log_bound(b, v) == pytest.approx(attained, rel=1e-12)
    assert bennett_log_bound(3.0, 9.0) == pytest.approx(math.log(math.cosh(3.0)), rel=1e-12)
    assert bennett_log_bound(0.0, 0.0) == 0.0 and bennett_log_bound(5.0, 0.0) == 0.0
    assert np.isfinite(bennett_log_bound(5000.0, 1e6))  # b = R / tau at tau = 1e-4 stays finite


# ----------------------------------------------------------------------------- list statistics


@pytest.mark.parametrize("pq", [False, True])
def test_ivf_list_statistics_match_numpy_per_list(data, pq):
    index = _ivf(data, 32, pq=pq)
    stats = ListStats.build(data, index, chunk_rows=1000)  # several chunks of whole lists
    assert "IVF" in stats.source and stats.lists == 32
    _, assign = index.quantizer.search(data, 1)  # the IVF's own assignment of every row
    assert sorted(stats.order.tolist()) == list(range(len(data)))
    for l in range(stats.lists):
        rows = np.sort(stats.order[stats.offsets[l] : stats.offsets[l + 1]])
        np.testing.assert_array_equal(rows, np.flatnonzero(assign[:, 0] == l))
        if len(rows) == 0:
            continue
        y = data[rows].astype(np.float64)
        mu = y.mean(0)
        np.testing.assert_allclose(stats.means[l], mu, atol=1e-6)
        r = np.sqrt(((y - mu) ** 2).sum(1)).max()
        lam = np.linalg.svd(y - mu, compute_uv=False)[0] ** 2 / len(y) if len(y) > 1 else 0.0
        assert r <= stats.radius[l] <= r * (1 + 1e-6) + 1e-9
        assert lam <= stats.lam[l] <= lam * (1 + 1e-6) + 1e-9


def test_kmeans_partition_for_a_flat_index_and_save_load(data, tmp_path):
    flat = faiss.IndexFlatIP(D)
    flat.add(data)
    stats = ListStats.build(data, flat, lists=50)
    assert "k-means" in stats.source and stats.lists == 50
    assert sorted(stats.order.tolist()) == list(range(len(data)))
    stats.save(tmp_path / "s.npz")
    back = ListStats.load(tmp_path / "s.npz")
    for name in ("offsets", "order", "means", "radius", "lam"):
        np.testing.assert_array_equal(getattr(back, name), getattr(stats, name))
    assert back.source == stats.source


# ----------------------------------------------------------------------------- the deterministic bound


@pytest.mark.parametrize("partition", ["ivf-flat", "ivf-pq", "kmeans"])
def test_deterministic_bound_always_contains_exact(data, partition, rng):
    index = {
        "ivf-flat": lambda: _ivf(data, 64),
        "ivf-pq": lambda: _ivf(data, 64, pq=True),
        "kmeans": lambda: None,
    }[partition]()
    stats = ListStats.build(data, index, lists=80)
    q = _queries(data, rng, 200)
    checked = 0
    for tau in (0.005, 0.02, 0.05, 0.1, 0.3, 1.0, 3.0):
        taus = np.full(len(q), tau)
        ref = _dense_log_z(q, data, taus)
        f32 = log_normaliser(q, data, taus)  # what `exact` serves (float32 products)
        for head, samples in ((0, 64), (300, 256), (3000, 64)):
            got = bounded_log_normaliser(q, data, stats, taus, NormaliserConfig("bounded", head, samples))
            assert np.all(got.lower <= ref) and np.all(ref <= got.upper), (tau, head)
            assert np.all(got.lower <= f32) and np.all(f32 <= got.upper), (tau, head)
            assert np.all(got.lower <= got.value) and np.all(got.value <= got.upper)
            sampled = ~np.isnan(got.interval_lower)
            assert np.all(got.interval_lower[sampled] >= got.lower[sampled] - 1e-12)
            assert np.all(got.interval_upper[sampled] <= got.upper[sampled] + 1e-12)
            checked += len(q)
    assert checked == 200 * 7 * 3


def test_scanning_every_list_is_exact_and_tight(data, stats_ivf, rng):
    q = _queries(data, rng, 40)
    taus = rng.uniform(0.02, 1.0, len(q))
    got = bounded_log_normaliser(q, data, stats_ivf, taus, NormaliserConfig("bounded", head_rows=len(data)))
    ref = _dense_log_z(q, data, taus)
    np.testing.assert_allclose(got.value, ref, rtol=0, atol=1e-5)
    assert np.all(np.isnan(got.interval_lower))  # nothing sampled
    assert np.all(got.upper - got.lower < 2e-3 / taus)  # only the float32 rounding slack remains
    assert np.all(got.rows == len(data))


# ----------------------------------------------------------------------------- the sampled interval


def _top_rows(data: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    """What a high-recall ANN index returns: here the exact top-k by brute force."""
    flat = faiss.IndexFlatIP(D)
    flat.add(data)
    return flat.search(q, k)[1]


@pytest.mark.parametrize("control", [False, True])
def test_sampled_interval_covers_at_its_stated_level(data, stats_ivf, control):
    """1,500 queries; coverage of the 90 % interval (over the sampled ones) within the 99.9 %
    binomial range of 0.9 for the plain estimate; the exact fallback stays rare. With the control
    variate (the default) the interval covers a little less (measured 0.87-0.89 here: the variance
    left is the rare heavy rows', which a sample underestimates): at least level - 0.05, and never
    above the range."""
    rng = np.random.default_rng(11)
    q = _queries(data, rng, 1500)
    taus = rng.uniform(0.1, 0.5, len(q))
    level = 0.9
    cfg = NormaliserConfig(
        "bounded",
        200,
        1024,
        level=level,
        top_rows=20,
        max_se=0.05,
        target_se=0.0125,
        max_samples=32768,
        control_variate=control,
    )
    got = bounded_log_normaliser(q, data, stats_ivf, taus, cfg, _top_rows(data, q, 20))
    ref = _dense_log_z(q, data, taus)
    sampled = ~got.exact_mask
    assert sampled.sum() >= 1000 and np.all(np.isnan(got.interval_lower) == ~sampled)
    covered = ((got.interval_lower <= ref) & (ref <= got.interval_upper))[sampled]
    lo, hi = binom.ppf([0.0005, 0.9995], len(covered), level)
    if control:
        assert (level - 0.05) * len(covered) <= covered.sum() <= hi, covered.mean()
    else:
        assert lo <= covered.sum() <= hi, covered.mean()
    # the interval is informative (inside the deterministic bound, rarely clipped by it), so its
    # coverage is not the bound's
    inner = ((got.interval_upper - got.interval_lower) < 0.5 * (got.upper - got.lower))[sampled]
    clipped = ((got.interval_lower <= got.lower + 1e-12) | (got.interval_upper >= got.upper - 1e-12))[sampled]
    assert inner.mean() > 0.9 and clipped.mean() < 0.05, (inner.mean(), clipped.mean())


def test_estimate_and_top10_probabilities_vs_exact(data, stats_ivf, rng):
    q = _queries(data, rng, 300)
    taus = np.full(len(q), 0.1)
    got = bounded_log_normaliser(
        q, data, stats_ivf, taus, NormaliserConfig("bounded", 1000, 2048), _top_rows(data, q, 100)
    )
    ref = _dense_log_z(q, data, taus)
    err = np.abs(got.value - ref)
    assert np.median(err) < 0.01 and err.max() < 0.1
    s = q.astype(np.float64) @ data.astype(np.float64).T
    top = np.argsort(-s, axis=1)[:, :10]
    st = np.take_along_axis(s, top, 1) / taus[:, None]
    p_exact = np.exp(st - ref[:, None])
    p_est = np.exp(st - got.value[:, None])
    assert np.all(np.exp(st - got.upper[:, None]) <= p_exact) and np.all(
        p_exact <= np.exp(st - got.lower[:, None])
    )
    np.testing.assert_allclose(p_est, p_exact, rtol=0.1)
    assert np.median(np.abs(p_est / p_exact - 1)) < 0.01


def test_two_stage_sample_reaches_its_target_se(data, stats_ivf):
    """A pilot whose se(log Z) exceeds target_se is replaced by a larger fresh sample: the intervals
    shrink to ~2 z target_se, the error with them, and the fresh sample still covers."""
    rng = np.random.default_rng(3)
    q = _queries(data, rng, 400)
    taus = np.full(len(q), 0.1)
    ref = _dense_log_z(q, data, taus)
    top = _top_rows(data, q, 20)
    one = NormaliserConfig("bounded", 200, 256, top_rows=20, max_se=1.0, max_samples=256)
    two = NormaliserConfig("bounded", 200, 256, top_rows=20, max_se=1.0, target_se=0.005)
    a = bounded_log_normaliser(q, data, stats_ivf, taus, one, top)
    b = bounded_log_normaliser(q, data, stats_ivf, taus, two, top)
    width_a = np.median(a.interval_upper - a.interval_lower)
    width_b = np.median(b.interval_upper - b.interval_lower)
    assert width_a > 4 * 1.96 * 0.005 and width_b < 2.6 * 1.96 * 0.005  # pilot too wide; fresh ~ target
    assert np.median(np.abs(b.value - ref)) < 0.5 * np.median(np.abs(a.value - ref))
    assert b.rows.mean() > a.rows.mean() + 1000
    covered = (b.interval_lower <= ref) & (ref <= b.interval_upper)
    assert binom.ppf(0.0005, len(q), 0.95) <= covered.sum()


def test_noisy_sample_falls_back_to_exact(data, stats_ivf, rng):
    """Uniform directions at tau = 0.02 over diffuse lists: a few rows carry Z and the sample's
    standard error is large, so those queries are answered exactly (and say so)."""
    q = _unit(rng.standard_normal((60, D))).astype(np.float32)
    taus = np.full(len(q), 0.02)
    got = bounded_log_normaliser(q, data, stats_ivf, taus, NormaliserConfig("bounded", 200, 256))
    ref = _dense_log_z(q, data, taus)
    assert 0 < got.exact_mask.sum() < len(q)
    exact = got.exact_mask
    np.testing.assert_allclose(got.value[exact], ref[exact], rtol=0, atol=1e-5)
    assert np.all(got.rows[exact] >= len(data))
    assert {got[int(i)].method for i in np.flatnonzero(exact)} == {"exact"}
    assert {got[int(i)].method for i in np.flatnonzero(~exact)} == {"bounded"}
    assert got[int(np.flatnonzero(exact)[0])].interval is None
    assert np.all((got.lower <= ref) & (ref <= got.upper))


def test_same_query_same_answer_and_reads_few_rows(data, stats_ivf, rng):
    q = _queries(data, rng, 8)
    taus = np.full(len(q), 0.1)
    cfg = NormaliserConfig("bounded", 300, 500, max_se=1.0, max_samples=500)  # one stage, never falls back
    a = bounded_log_normaliser(q, data, stats_ivf, taus, cfg)
    b = bounded_log_normaliser(q[::-1].copy(), data, stats_ivf, taus, cfg)
    np.testing.assert_array_equal(a.value, b.value[::-1])  # seeded by the query, not by batch position
    assert np.all(a.rows < 0.2 * len(data))


# ----------------------------------------------------------------------------- settings


def test_choose_method_and_config_validation(data):
    assert choose_method(10**6, 128, NormaliserConfig()) == "exact"
    assert choose_method(10**6 + 1, 128, NormaliserConfig()) == "bounded"
    assert choose_method(10, 2, NormaliserConfig("bounded")) == "bounded"
    assert choose_method(10**9, 128, NormaliserConfig("exact")) == "exact"
    assert Normaliser.for_version(data, None, "auto").method == "exact"
    small_budget = NormaliserConfig("auto", exact_max_macs=1000)
    norm = Normaliser.for_version(data, None, small_budget)
    assert norm.method == "bounded" and norm.describe()["requested"] == "auto"
    for bad in (dict(method="approx"), dict(samples=1), dict(head_rows=-1), dict(level=1.0)):
        with pytest.raises(ValueError):
            NormaliserConfig(**bad)


def test_auto_times_both_methods_where_the_size_leaves_it_open(data, stats_ivf):
    """Within AUTO_PROBE_FACTOR x exact_max_macs, a version with stored list statistics gets whichever
    method a timing at load finds cheaper; its answers are those of the method chosen."""
    n, d = data.shape
    cfg = NormaliserConfig("auto", exact_max_macs=n * d // 2)  # the size rule alone would say bounded
    norm = Normaliser.for_version(data, None, cfg, stored=lambda: stats_ivf)
    probe = norm.describe()["probe"]
    assert probe["queries"] == 8 and probe["exact_ms"] > 0 and probe["bounded_ms"] > 0
    exact_cost = probe["exact_ms"] + probe["exact_ms_1"]  # a batch of 8 and a query alone, per query
    assert (
        norm.method
        == probe["chosen"]
        == ("exact" if exact_cost <= probe["bounded_ms"] + probe["bounded_ms_1"] else "bounded")
    )
    assert (norm.stats is stats_ivf) == (norm.method == "bounded")
    q = data[:5]
    taus = np.full(5, 0.1)
    got = norm(q, data, taus)
    exact = log_normaliser(q, data, taus)
    assert np.all(got.lower - 1e-9 <= exact) and np.all(exact <= got.upper + 1e-9)
    # outside the window, or without stored statistics or the probe, the size rule decides untimed
    for config, stored, method in [
        (NormaliserConfig("auto", exact_max_macs=n * d // 100), lambda: stats_ivf, "bounded"),
        (NormaliserConfig("auto", probe=False), lambda: stats_ivf, "exact"),
        (NormaliserConfig("auto", head_rows=n, exact_max_macs=n * d // 2), lambda: stats_ivf, "bounded"),
        (NormaliserConfig("auto"), None, "exact"),
    ]:
        norm = Normaliser.for_version(data, None, config, stored=stored)
        assert norm.method == method and norm.probe is None and "probe" not in norm.describe()
