"""The one-pass exact scan: log Z and the top-k of a batch against float64 brute force and the old path."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from search.serving.exact_scan import ExactScanner
from search.serving.normaliser import log_normaliser


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    """Clustered unit rows (neighbours come in groups) and queries near some of them."""
    rng = np.random.default_rng(3)
    centres = _unit(rng.standard_normal((40, 48)))
    emb = _unit(centres[rng.integers(0, 40, 3000)] + 0.4 / np.sqrt(48) * rng.standard_normal((3000, 48)))
    queries = _unit(emb[rng.integers(0, 3000, 12)] + 0.5 / np.sqrt(48) * rng.standard_normal((12, 48)))
    return emb, queries


def _brute(emb: np.ndarray, queries: np.ndarray, taus: np.ndarray, k: int):
    """float64 log Z and similarities, sorted best first."""
    s = queries.astype(np.float64) @ emb.astype(np.float64).T
    logits = s / taus[:, None]
    m = logits.max(axis=1)
    log_z = m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
    return log_z, s, np.argsort(-s, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("block", [256, 1000, 8192])
def test_log_z_and_top_k_match_brute_force(data, block):
    emb, queries = data
    taus = np.array([0.02, 0.05, 0.1, 0.3, 1.0, 5.0] * 2)  # low tau: logits up to 50, no overflow
    result = ExactScanner(emb, block=block)(queries, taus, 25)
    log_z, s, order = _brute(emb, queries, taus, 25)
    np.testing.assert_allclose(result.log_z, log_z, rtol=0, atol=1e-6 / taus.min() * 0.1 + 1e-6)
    assert result.rows.shape == (12, 25) and result.rows.dtype == np.int64
    # the rows found have exactly the k best similarities (near-ties may swap rows, never values)
    got = np.take_along_axis(s, result.rows, axis=1)
    np.testing.assert_allclose(got, np.take_along_axis(s, order, axis=1), rtol=0, atol=1e-6)
    assert (np.diff(got, axis=1) <= 1e-6).all()  # best first
    assert (result.rows == order).mean() > 0.95  # and, away from near-ties, the same rows


def test_matches_the_per_query_path(data):
    """The old path: log_normaliser per query and FAISS's flat search per query."""
    emb, queries = data
    taus = np.full(len(queries), 0.1)
    batch = ExactScanner(emb, block=700)(queries, taus, 10)
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(emb)
    for i in range(len(queries)):
        one = ExactScanner(emb)(queries[i : i + 1], taus[i : i + 1], 10)
        old = log_normaliser(queries[i : i + 1], emb, taus[i : i + 1])
        _, rows = index.search(queries[i : i + 1], 10)
        assert abs(batch.log_z[i] - old[0]) < 1e-6 and abs(one.log_z[0] - old[0]) < 1e-6
        assert batch.rows[i].tolist() == one.rows[0].tolist() == rows[0].tolist()


def test_ties_prefer_the_lower_row_and_k_is_clipped():
    rng = np.random.default_rng(0)
    base = _unit(rng.standard_normal((5, 16)))
    emb = np.concatenate([base, base, base])  # rows r, r + 5, r + 10 are equal
    result = ExactScanner(emb, block=4)(base[:2], np.array([0.1, 0.1]), 100)
    assert result.rows.shape == (2, 15)
    assert result.rows[0, :3].tolist() == [0, 5, 10] and result.rows[1, :3].tolist() == [1, 6, 11]
    log_z, _, _ = _brute(emb, base[:2], np.array([0.1, 0.1]), 1)
    np.testing.assert_allclose(result.log_z, log_z, atol=1e-6)


def test_memory_mapped_rows_read_only(tmp_path, data):
    emb, queries = data
    np.save(tmp_path / "e.npy", emb)
    mapped = np.load(tmp_path / "e.npy", mmap_mode="r")
    taus = np.full(3, 0.1)
    for release in (False, True):
        got = ExactScanner(mapped, release=release, block=512)(queries[:3], taus, 5)
        ref = ExactScanner(emb)(queries[:3], taus, 5)
        assert got.rows.tolist() == ref.rows.tolist()
        np.testing.assert_allclose(
            got.log_z, ref.log_z, rtol=0, atol=1e-8
        )  # float32 products: same to ~1 ulp


def test_two_or_three_queries_are_padded_without_changing_answers(data):
    emb, queries = data
    taus = np.array([0.05, 0.2, 1.0])
    for n in (2, 3):
        got = ExactScanner(emb, block=700)(queries[:n], taus[:n], 7)
        assert got.log_z.shape == (n,) and got.rows.shape == (n, 7)
        for i in range(n):
            one = ExactScanner(emb, block=700)(queries[i : i + 1], taus[i : i + 1], 7)
            assert got.rows[i].tolist() == one.rows[0].tolist()
            assert abs(got.log_z[i] - one.log_z[0]) < 3e-6  # float32 products of another shape: ~1 ulp / tau
