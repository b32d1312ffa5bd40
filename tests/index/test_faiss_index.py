"""index/faiss_index.py against brute-force numpy on random unit vectors."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
from index_refs import brute_force, unit_vectors

from index import faiss_index as fi


def _recall(found: np.ndarray, exact: np.ndarray) -> float:
    k = exact.shape[1]
    return float(np.mean([len(set(f[f >= 0]) & set(e)) / k for f, e in zip(found, exact)]))


def test_flat_is_exact():
    db, q = unit_vectors(600, 16, 0), unit_vectors(25, 16, 1)
    index, params = fi.build("flat", db)
    assert params == {} and index.ntotal == 600
    scores, rows = fi.search(index, q, 10)
    ref_s, ref_rows = brute_force(db, q, 10)
    np.testing.assert_array_equal(rows, ref_rows)
    np.testing.assert_allclose(scores, ref_s, atol=1e-5)
    np.testing.assert_array_equal(fi.exact_neighbours(db, q, 10), ref_rows)


@pytest.mark.parametrize(
    "kind, params, floor",
    [
        ("ivf-flat", {"nlist": 16}, 0.95),
        ("hnsw", {"M": 16}, 0.95),
        ("ivf-pq", {"nlist": 16, "m": 8, "nbits": 4}, 0.3),
    ],
)
def test_approximate_kinds_recall_and_scores(kind, params, floor):
    db, q = unit_vectors(2000, 16, 2), unit_vectors(40, 16, 3)
    index, p = fi.build(kind, db, **params)
    assert fi.kind_of(index) == kind and index.ntotal == 2000
    _, exact = brute_force(db, q, 10)
    result = fi.tune(index, q, exact, target_recall=0.95, k=10)
    scores, rows = fi.search(index, q, 10)
    recall = _recall(rows, exact)
    assert recall == pytest.approx(result.recall)  # tune reports what search does
    assert recall >= floor, f"{kind} recall@10 {recall}"
    if kind == "ivf-pq":
        # PQ scores are inner products with the *decoded* vectors, not the originals
        ivf = faiss.extract_index_ivf(index)
        ivf.make_direct_map()
        stored = index.reconstruct_batch(rows.ravel()).reshape(*rows.shape, -1)
        assert np.max(np.abs(stored - db[rows])) > 1e-3  # lossy codes...
    else:
        stored = db[rows]
    true = np.einsum("qd,qkd->qk", q, stored)  # ...but the scores are exact on them
    np.testing.assert_allclose(scores, true, atol=1e-4)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # sorted best first


def test_ivf_all_probes_is_exact():
    db, q = unit_vectors(1000, 8, 4), unit_vectors(10, 8, 5)
    index, params = fi.build("ivf-flat", db, nlist=10, nprobe=10)
    _, rows = fi.search(index, q, 5)
    np.testing.assert_array_equal(rows, brute_force(db, q, 5)[1])


def test_tune_reaches_target_with_smallest_doubling():
    db, q = unit_vectors(3000, 16, 6), unit_vectors(50, 16, 7)
    index, _ = fi.build("ivf-flat", db, nlist=64, nprobe=1)
    _, exact = brute_force(db, q, 10)
    result = fi.tune(index, q, exact, target_recall=0.9)
    assert result.param == "nprobe" and result.reached and result.recall >= 0.9
    assert faiss.extract_index_ivf(index).nprobe == result.value
    # independent re-measure at the chosen value, and minimality: half of it misses the target
    assert _recall(fi.search(index, q, 10)[1], exact) == pytest.approx(result.recall)
    if result.value > 1:
        fi.set_search_params(index, "ivf-flat", {"nprobe": result.value // 2})
        assert _recall(fi.search(index, q, 10)[1], exact) < 0.9
    assert [h["nprobe"] for h in result.history] == [2**i for i in range(len(result.history))]


def test_search_caps_k_and_drops_missing_results():
    db, q = unit_vectors(200, 8, 8), unit_vectors(6, 8, 9)
    flat, _ = fi.build("flat", db)
    scores, rows = fi.search(flat, q, 1000)
    assert rows.shape == (6, 200) and np.all(rows >= 0)
    # IVF probing one of 20 lists sees ~10 items: columns nobody filled are dropped
    ivf, _ = fi.build("ivf-flat", db, nlist=20, nprobe=1)
    scores, rows = fi.search(ivf, q, 100)
    assert rows.shape[1] < 100 and np.any(rows[:, -1] >= 0)
    valid = rows >= 0
    assert np.all(np.isneginf(scores[~valid]))
    np.testing.assert_allclose(
        scores[valid], np.einsum("qd,qkd->qk", q, db[np.where(valid, rows, 0)])[valid], atol=1e-5
    )
    for r in rows:  # no duplicate rows in a result list
        assert len(set(r[r >= 0])) == int(np.sum(r >= 0))


@pytest.mark.parametrize("bad_k", [0, -3, 2.5])
def test_search_rejects_bad_input(bad_k):
    index, _ = fi.build("flat", unit_vectors(10, 4, 0))
    with pytest.raises(ValueError, match="k must be"):
        fi.search(index, unit_vectors(2, 4, 1), bad_k)
    with pytest.raises(ValueError, match="dimension 5"):
        fi.search(index, unit_vectors(2, 5, 1), 3)
    with pytest.raises(ValueError, match="unknown index kind 'lsh'"):
        fi.build("lsh", unit_vectors(10, 4, 0))
    with pytest.raises(ValueError, match="unknown parameters"):
        fi.build("flat", unit_vectors(10, 4, 0), nlist=3)
    with pytest.raises(ValueError, match="must divide"):
        fi.build("ivf-pq", unit_vectors(100, 6, 0), nlist=2, m=4)


def test_choose_kind_rules():
    assert fi.choose_kind(500, 128, memory_budget_bytes=1)[0] == "flat"  # tiny: always exact
    assert fi.choose_kind(50_000, 128, 1 << 30) == ("flat", {})  # small and fits
    kind, params = fi.choose_kind(1_000_000, 128, 8 << 30)  # mid, fits -> IVF-Flat
    assert kind == "ivf-flat" and params["nlist"] == 4000  # 4 sqrt(1e6)
    budget = 100 << 20  # 100 MiB for 1e6 x 128
    kind, params = fi.choose_kind(1_000_000, 128, budget)
    assert kind == "ivf-pq" and 128 % params["m"] == 0
    assert fi.index_bytes("ivf-pq", 128, 1_000_000, params) <= budget
    # the next larger divisor of 128 would not fit: m is as large as the budget allows
    bigger = [m for m in range(params["m"] + 1, 129) if 128 % m == 0]
    if bigger:
        assert fi.index_bytes("ivf-pq", 128, 1_000_000, {**params, "m": bigger[0]}) > budget
    assert fi.default_nlist(100) == 2  # >= 39 points per list
    with pytest.raises(ValueError, match="too small"):
        fi.choose_kind(1_000_000, 128, 1 << 20)
    with pytest.raises(ValueError, match="count"):
        fi.choose_kind(0, 128)


def test_normalise_and_exact_reference():
    with pytest.raises(ValueError, match="zero vectors"):
        fi.normalise(np.zeros((2, 3)))
    x = fi.normalise(np.random.default_rng(0).standard_normal((5, 3)))
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1, atol=1e-6)
    assert fi.recall_at_k(np.array([[1, 2, -1]]), np.array([[2, 1, 3]]), 3) == pytest.approx(2 / 3)


def test_tune_stops_at_a_recall_plateau():
    # 2 bytes of 4-bit PQ per vector: recall saturates far below the target; probing every
    # list would only cost time, so tune keeps the cheapest value on the plateau.
    db, q = unit_vectors(3000, 16, 6), unit_vectors(50, 16, 7)
    index, _ = fi.build("ivf-pq", db, nlist=64, m=2, nbits=4)
    _, exact = brute_force(db, q, 10)
    result = fi.tune(index, q, exact, target_recall=0.95)
    assert not result.reached and result.value < 64
    last, prev = result.history[-1], result.history[-2]
    assert last["recall"] - prev["recall"] < 0.002 and result.value == prev["nprobe"]
    assert faiss.extract_index_ivf(index).nprobe == result.value
    assert _recall(fi.search(index, q, 10)[1], exact) == pytest.approx(result.recall)


def test_gpu_choice_and_cpu_fallback(monkeypatch):
    monkeypatch.setattr(fi, "gpu_count", lambda: 0)
    assert not fi.use_gpu("flat") and not fi.use_gpu("ivf-pq")
    monkeypatch.setattr(fi, "gpu_count", lambda: 2)
    assert fi.use_gpu("flat") and fi.use_gpu("ivf-flat") and fi.use_gpu("ivf-pq")
    assert not fi.use_gpu("hnsw")  # FAISS has no GPU HNSW
    # On this CPU-only machine the GPU calls fail (faiss-cpu has no GPU classes, faiss-gpu finds no
    # device); the build must still produce the same index.
    db, q = unit_vectors(500, 8, 0), unit_vectors(5, 8, 1)
    index, _ = fi.build("ivf-flat", db, nlist=4, nprobe=4)
    assert fi.kind_of(index) == "ivf-flat" and index.ntotal == 500
    np.testing.assert_array_equal(fi.search(index, q, 5)[1], brute_force(db, q, 5)[1])


def test_tune_with_stored_rows_excludes_the_self_match():
    db = unit_vectors(2000, 16, 10)
    index, _ = fi.build("ivf-flat", db, nlist=32, nprobe=1)
    rows = np.arange(0, 2000, 40)
    _, exact = brute_force(db, db[rows], 11)
    assert np.all(exact[:, 0] == rows)  # each query's best match is itself
    result = fi.tune(index, db[rows], exact, target_recall=0.9, self_rows=rows)
    # independent recount at the chosen nprobe, neighbours other than self only
    _, found = fi.search(index, db[rows], 11)
    hits = [len(set(f[f != r][:10]) & set(e[1:])) / 10 for f, e, r in zip(found, exact, rows)]
    assert result.recall == pytest.approx(np.mean(hits)) and result.recall >= 0.9


def test_search_checks_finiteness_without_false_alarms():
    """NaN / inf queries are refused; huge finite ones (whose squares overflow) are not."""
    index, _ = fi.build("flat", unit_vectors(50, 4, 0))
    for bad in (np.nan, np.inf, -np.inf):
        q = unit_vectors(3, 4, 1)
        q[1, 2] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            fi.search(index, q, 3)
    huge = unit_vectors(2, 4, 1) * np.float32(1e30)
    _, rows = fi.search(index, huge, 3)
    _, expected = fi.search(index, huge / np.float32(1e30), 3)
    np.testing.assert_array_equal(rows, expected)


@pytest.mark.parametrize("kind", fi.KINDS)
@pytest.mark.parametrize("n_queries", [1, 30])
def test_every_kind_marks_non_finite_queries_in_their_results(kind, n_queries):
    """search() checks input finiteness only when a result row is incomplete or its best score is
    not finite: this pins the FAISS behaviour that makes that sufficient, kind by kind."""
    db = unit_vectors(3000, 16, 2)
    params = {"nlist": 30, "nprobe": 4} if kind.startswith("ivf") else ({"M": 8} if kind == "hnsw" else {})
    index, _ = fi.build(kind, db, **params)
    for bad in (np.nan, np.inf, -np.inf):
        q = unit_vectors(n_queries, 16, 3)
        q[-1, 5] = bad
        scores = np.empty((n_queries, 5), np.float32)
        rows = np.empty((n_queries, 5), np.int64)
        index.search_c(n_queries, faiss.swig_ptr(q), 5, faiss.swig_ptr(scores), faiss.swig_ptr(rows), None)
        assert rows[-1, -1] < 0 or not np.isfinite(scores[-1, 0]), (kind, bad)
        with pytest.raises(ValueError, match="NaN or inf"):
            fi.search(index, q, 5)


def test_small_training_sets_are_explained_in_the_log_not_warned_on_stderr(capfd, caplog):
    """FAISS's k-means prints "WARNING clustering N points to K centroids" (C stderr) below 39 points a
    centroid; a small collection is expected, so builds say it once in the log instead, and the
    normaliser statistics' k-means partition (any partition serves it) says nothing."""
    import logging

    from index.list_stats import ListStats

    db = unit_vectors(300, 16, 0)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="index.faiss_index"):
        for kind, params in (("ivf-flat", {"nlist": 16}), ("ivf-pq", {"nlist": 8, "m": 4, "nbits": 8})):
            index, _ = fi.build(kind, db, **params)
            assert index.ntotal == 300
        ListStats.build(db[:40])
    assert "WARNING clustering" not in capfd.readouterr().err
    said = [r.getMessage() for r in caplog.records if "FAISS suggests" in r.getMessage()]
    assert any(
        "coarse quantizer trained on 300 points for 16 centroids (FAISS suggests 624)" in m for m in said
    ), said
    assert any("PQ codebooks trained on 300 points for 256 centroids" in m for m in said), said


@pytest.mark.parametrize("kind, params", [("flat", {}), ("hnsw", {"M": 16, "efConstruction": 40})])
def test_mapped_index_answers_as_the_copied_one(tmp_path, kind, params):
    """`read_index(mmap=True)` (what `serve --workers N` shares) maps the flat codes from the file instead
    of copying them: the same rows and scores as the copy, and as brute force for the flat kind."""
    db, q = unit_vectors(800, 16, 4), unit_vectors(30, 16, 5)
    index, _ = fi.build(kind, db, **params)
    path = tmp_path / "index.faiss"
    faiss.write_index(index, str(path))
    copied, mapped = fi.read_index(path), fi.read_index(path, mmap=True)
    for idx in (copied, mapped):
        if kind == "hnsw":
            faiss.downcast_index(idx).hnsw.efSearch = 64
    s_c, r_c = fi.search(copied, q, 10)
    s_m, r_m = fi.search(mapped, q, 10)
    np.testing.assert_array_equal(r_m, r_c)
    np.testing.assert_array_equal(s_m, s_c)
    if kind == "flat":
        np.testing.assert_array_equal(r_m, brute_force(db, q, 10)[1])
