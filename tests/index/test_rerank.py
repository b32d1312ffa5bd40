"""IVF-PQ served with exact re-ranking from the stored vectors: the re-ranked search against numpy, the joint
(nprobe, k'/k) tuning against brute-force recall, `--kind auto` under a memory budget, and the served recall
through POST /v1/search/vector."""

from __future__ import annotations

import numpy as np
import pytest

from index import faiss_index as fi


def clustered_unit(n: int, d: int, seed: int, clusters: int = 64, spread: float = 1.0) -> np.ndarray:
    """Unit vectors around fixed random centres (as bench/index_kinds.py generates them)."""
    centres = np.random.default_rng(123).normal(size=(clusters, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    rng = np.random.default_rng(seed)
    x = centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, d)) / np.sqrt(d)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def pq():
    data = clustered_unit(5000, 32, seed=0)
    index, params = fi.build("ivf-pq", data, nlist=64, m=4, nbits=8)
    return data, index, params


def _brute_reranked(index, data, q, k, r):
    """Reference: the index's top k*r candidates (FAISS's own search), re-scored with numpy float64, best
    k."""
    _, cand = index.search(q[None, :], k * r)
    cand = cand[0][cand[0] >= 0]
    s = data[cand].astype(np.float64) @ q.astype(np.float64)
    return cand[np.argsort(-s, kind="stable")[:k]]


def test_search_reranked_matches_numpy(pq):
    data, index, _ = pq
    queries = clustered_unit(40, 32, seed=7)
    for r in (1, 3, 16):
        scores, rows = fi.search_reranked(index, data, queries, 10, r)
        for q, srow, row in zip(queries, scores, rows):
            ref = _brute_reranked(index, data, q, 10, r)
            assert row.tolist() == ref.tolist()
            np.testing.assert_allclose(srow, data[ref] @ q, atol=1e-5)


def test_tune_with_reranking_reaches_target_and_reports_true_recall(pq):
    """Without re-ranking these 4-byte codes plateau far below 0.95; with it the tuned pair reaches it, and
    the recall `tune` reports for that pair is the brute-force recall of the re-ranked search."""
    data, index, _ = pq
    rows = fi.tuning_rows(len(data), 400)
    exact = fi.exact_neighbours(data, data[rows], 11)
    plain = fi.tune(index, data[rows], exact, target_recall=0.95, k=10, kind="ivf-pq", self_rows=rows)
    assert not plain.reached and plain.recall < 0.8 and plain.rerank is None
    got = fi.tune(
        index, data[rows], exact, target_recall=0.95, k=10, kind="ivf-pq", self_rows=rows, embeddings=data
    )
    assert got.reached and got.recall >= 0.95 and got.param == "nprobe"
    assert faiss_index_nprobe(index) == got.value
    hits = 0
    for q, row in zip(data[rows], rows):
        served = [c for c in _brute_reranked(index, data, q, 11, got.rerank) if c != row][:10]
        ref = [c for c in np.argsort(-(data.astype(np.float64) @ q), kind="stable") if c != row][:10]
        hits += len(set(served) & set(ref))
    assert got.recall == pytest.approx(hits / (10 * len(rows)), abs=1e-9)
    # the chosen pair is in the history, and no cheaper r at the same nprobe reached the target
    same = [h for h in got.history if h["nprobe"] == got.value]
    assert {"nprobe": got.value, "rerank": got.rerank} in [
        {"nprobe": h["nprobe"], "rerank": h["rerank"]} for h in same
    ]
    assert all(h["recall"] < 0.95 for h in same if h["rerank"] < got.rerank)


def faiss_index_nprobe(index) -> int:
    import faiss

    return int(faiss.extract_index_ivf(index).nprobe)


def test_choose_kind_picks_reranked_pq_when_full_vectors_do_not_fit():
    mib = 1 << 20
    kind, params = fi.choose_kind(200_000, 128, 20 * mib)
    assert kind == "ivf-pq" and params["rerank"] >= 1
    assert fi.index_bytes("ivf-pq", 128, 200_000, params) <= 20 * mib < 200_000 * 128 * 4
    assert fi.choose_kind(200_000, 128, 200 * mib)[0] == "ivf-flat"  # the full vectors fit: no codes


def test_auto_build_under_budget_serves_target_recall(tmp_path):
    """`index build --embeddings --kind auto --memory-budget` on vectors whose flat index does not fit: IVF-PQ
    with a tuned re-rank factor; index.faiss within the budget; the recall@10 the SERVER answers on
    held-out query vectors (POST /v1/search/vector) equals the re-ranked search's and is checked against
    numpy exact search."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.client import SoftsearchClient
    from api.config import Settings
    from index.cli import main as index_main
    from index.store import INDEX_FILE, IndexStore

    data = clustered_unit(5000, 32, seed=0)
    np.save(tmp_path / "v.npy", data)
    budget = 200_000
    root = tmp_path / "store"
    assert (
        index_main(
            [
                "build",
                "--root",
                str(root),
                "--no-progress",
                "--embeddings",
                str(tmp_path / "v.npy"),
                "--kind",
                "auto",
                "--memory-budget",
                str(budget),
            ]
        )
        == 0
    )
    store = IndexStore(root)
    v = store.load()
    m = v.manifest
    assert m.kind == "ivf-pq" and m.params["rerank"] == m.recall.rerank >= 1
    assert (v.path / INDEX_FILE).stat().st_size <= budget < data.nbytes
    assert m.quality_gate.passed and m.quality_gate.recall.served >= 0.95
    queries = clustered_unit(100, 32, seed=9)
    exact = np.argsort(-(queries.astype(np.float64) @ data.T.astype(np.float64)), axis=1, kind="stable")[
        :, :10
    ]
    _, reranked = fi.search_reranked(v.index, v.embeddings, queries, 10, m.params["rerank"])
    with TestClient(create_app(Settings(index_root=root))) as http:
        client = SoftsearchClient(http=http)
        served = np.array([[h.row for h in client.search_vector(q.tolist(), k=10).results] for q in queries])
    # the exact normaliser's one pass over the mapped rows also yields the exact top-k
    # (search/serving/exact_scan.py), so the served hits are the exact ones (scores to float32 ties), at least
    # as good as the re-ranked PQ search
    scores64 = queries.astype(np.float64) @ data.T.astype(np.float64)
    np.testing.assert_allclose(
        np.take_along_axis(scores64, served, 1), np.take_along_axis(scores64, exact, 1), atol=1e-5
    )
    assert fi.recall_at_k(served, exact, 10) >= fi.recall_at_k(reranked, exact, 10) >= 0.9


def test_rerank_factor_reads_the_manifest_and_defaults_for_pq():
    assert fi.rerank_factor("ivf-pq", {"nprobe": 4, "rerank": 7}) == 7
    assert fi.rerank_factor("ivf-pq", {"nprobe": 4}) == fi.RERANK_PQ  # versions built before it was tuned
    assert fi.rerank_factor("ivf-flat", {"nprobe": 4}) == 1 and fi.rerank_factor("flat", None) == 1
    with pytest.raises(ValueError, match="rerank=0"):
        fi.default_params("ivf-pq", 32, 5000, rerank=0)


def test_tune_caps_candidates_at_a_share_of_the_collection():
    """On 300 rows k*r stays <= 300 / RERANK_SHARE: re-ranking everything would be exact search in
    disguise."""
    data = clustered_unit(300, 16, seed=2)
    index, _ = fi.build("ivf-pq", data, nlist=4, m=1, nbits=4)
    rows = fi.tuning_rows(300, 100)
    exact = fi.exact_neighbours(data, data[rows], 11)
    got = fi.tune(
        index, data[rows], exact, target_recall=0.99, k=10, kind="ivf-pq", self_rows=rows, embeddings=data
    )
    assert max(h["rerank"] for h in got.history) * 11 <= 300 // fi.RERANK_SHARE
    assert not got.reached and got.rerank * 11 <= 300 // fi.RERANK_SHARE
