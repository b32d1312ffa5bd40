"""Filtered search inside FAISS against brute force over the subset (ids, recall, probabilities)."""

import numpy as np
import pytest

from index import faiss_index as fi
from search.serving.subset import filtered_search, subset_log_normaliser


def _clustered(n=6000, d=32, clusters=40, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    x = centres[rng.integers(clusters, size=n)] + 0.35 * rng.normal(size=(n, d))
    return fi.normalise(x.astype(np.float32)), rng


def _brute(x, q, mask, k, tau):
    s = q.astype(np.float64) @ x[mask].astype(np.float64).T
    rows = np.flatnonzero(mask)
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    log_z = np.log(np.exp(s / tau).sum(axis=1))  # dense reference, no running max (tau not tiny here)
    p = np.exp(np.take_along_axis(s, order, axis=1) / tau - log_z[:, None])
    return rows[order], p


@pytest.mark.parametrize("exact_max", [0, None], ids=["faiss-selector", "subset-scan"])
@pytest.mark.parametrize("kind", ["flat", "ivf-flat", "hnsw"])
@pytest.mark.parametrize("selectivity", [0.01, 0.1, 0.5])
def test_filtered_search_matches_brute_force_over_subset(kind, selectivity, exact_max):
    x, rng = _clustered()
    mask = rng.random(x.shape[0]) < selectivity
    q = fi.normalise(
        x[rng.choice(x.shape[0], 30, replace=False)]
        + 0.05 * rng.normal(size=(30, x.shape[1])).astype(np.float32)
    )
    index, _ = fi.build(kind, x, seed=0)
    p, rows = filtered_search(index, x, q, 10, mask, temperature=0.05, exact_max=exact_max)
    ref_rows, ref_p = _brute(x, q, mask, 10, 0.05)
    assert mask[rows[rows >= 0]].all()  # only subset rows come back
    assert fi.recall_at_k(rows, ref_rows, 10) >= 0.99
    # probabilities of the returned rows equal the dense reference over the subset
    s = np.einsum("qd,qkd->qk", q.astype(np.float64), x[rows].astype(np.float64))
    dense = np.exp(
        s / 0.05
        - np.log(np.exp((q.astype(np.float64) @ x[mask].astype(np.float64).T) / 0.05).sum(1))[:, None]
    )
    np.testing.assert_allclose(p, dense, atol=1e-6, rtol=1e-5)
    if kind == "flat" or exact_max is None:  # exact search: the same rows in the same order
        np.testing.assert_array_equal(rows, ref_rows)
        np.testing.assert_allclose(p, ref_p, atol=1e-6, rtol=1e-5)


def test_subset_normaliser_streams_blocks_and_handles_empty():
    x, rng = _clustered(n=1000)
    q = x[:3]
    mask = rng.random(1000) < 0.3
    tau = np.array([0.02, 0.1, 1.0])
    got = subset_log_normaliser(q, x, tau, mask, block=37)
    s = (q @ x[mask].T).astype(np.float64) / tau[:, None]  # float32 dots, as served
    m = s.max(1)
    np.testing.assert_allclose(got, m + np.log(np.exp(s - m[:, None]).sum(1)), rtol=1e-9, atol=1e-9)
    assert np.all(np.isneginf(subset_log_normaliser(q, x, tau, np.zeros(1000, bool))))


def test_mask_of_wrong_length_is_refused():
    x, _ = _clustered(n=500)
    index, _ = fi.build("flat", x)
    with pytest.raises(ValueError, match="one entry per stored row"):
        fi.search_subset(index, x[:1], 5, np.ones(499, bool))
