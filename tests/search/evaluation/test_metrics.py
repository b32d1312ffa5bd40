import numpy as np
import pytest
from search_refs import unit

from search.evaluation.metrics import (
    average_precision_at_k,
    bootstrap_ci,
    hit_rate_at_k,
    knn_accuracy,
    knn_search,
    n_relevant,
    precision_at_k,
    relevance,
    retrieval_metrics,
)

RNG = np.random.default_rng(1)


def _brute_topk(zq, zd, k, exclude=None):
    out = []
    for i in range(len(zq)):
        s = [(float(zq[i] @ zd[j]), j) for j in range(len(zd)) if exclude is None or j != exclude[i]]
        s.sort(key=lambda t: -t[0])
        out.append([j for _, j in s[:k]])
    return np.array(out)


def test_knn_search_matches_brute_force_with_exclusion():
    zd = unit(RNG.normal(size=(97, 6)))
    zq = zd[:20]
    excl = np.arange(20)
    scores, rows = knn_search(zq, zd, 9, block_q=7, block_n=10, exclude=excl)
    np.testing.assert_array_equal(rows, _brute_topk(zq, zd, 9, excl))
    np.testing.assert_allclose(scores, np.take_along_axis(zq @ zd.T, rows, 1), rtol=1e-5)


def test_metrics_match_loops():
    zd, zq = unit(RNG.normal(size=(150, 5))), unit(RNG.normal(size=(30, 5)))
    dl, ql = RNG.integers(0, 4, 150), RNG.integers(0, 4, 30)
    k = 10
    rows = _brute_topk(zq, zd, 50)
    rel = relevance(rows, ql, dl)
    nrel = n_relevant(ql, dl)
    for i in range(30):
        r = [dl[j] == ql[i] for j in rows[i]]
        assert hit_rate_at_k(rel, k)[i] == float(any(r[:k]))
        assert precision_at_k(rel, k)[i] == pytest.approx(sum(r[:k]) / k)
        hits, ap = 0, 0.0
        for pos in range(k):
            if r[pos]:
                hits += 1
                ap += hits / (pos + 1)
        n = sum(dl == ql[i])
        assert average_precision_at_k(rel, k, nrel)[i] == pytest.approx(ap / min(k, n))


def test_predicate_relevance_equals_labels():
    dl, ql = RNG.integers(0, 3, 40), RNG.integers(0, 3, 8)
    rows = RNG.integers(0, 40, (8, 5))
    pred = lambda a, b: np.asarray(a)[:, None] == np.asarray(b)[None, :]
    np.testing.assert_array_equal(relevance(rows, ql, dl, pred), relevance(rows, ql, dl))
    np.testing.assert_array_equal(n_relevant(ql, dl, pred, block=3), n_relevant(ql, dl))
    excl = np.arange(8)
    np.testing.assert_array_equal(n_relevant(ql, dl, pred, exclude=excl), n_relevant(ql, dl, exclude=excl))


def test_knn_accuracy_vs_loops():
    zd, zq = unit(RNG.normal(size=(300, 4))), unit(RNG.normal(size=(25, 4)))
    dl, ql = RNG.integers(0, 5, 300), RNG.integers(0, 5, 25)
    scores, rows = knn_search(zq, zd, 200, block_n=64)
    acc_w = knn_accuracy(scores, rows, dl, ql, 200, weighted=True)
    acc_m = knn_accuracy(scores, rows, dl, ql, 5, weighted=False)
    s_all = zq @ zd.T
    for i in range(25):
        order = np.argsort(-s_all[i])
        votes = {}
        for j in order[:200]:
            votes[dl[j]] = votes.get(dl[j], 0.0) + np.exp(s_all[i, j] / 0.07)
        best = max(sorted(votes), key=lambda c: votes[c])
        assert acc_w[i] == float(best == ql[i])
        cnt = np.bincount(dl[order[:5]], minlength=5)
        assert acc_m[i] == float(int(np.flatnonzero(cnt == cnt.max())[0]) == ql[i])


def test_bootstrap_ci_covers_and_shrinks():
    v = RNG.normal(2.0, 1.0, 400)
    mean, lo, hi = bootstrap_ci(v, n_boot=2000, alpha=0.05, seed=0)
    assert lo < mean < hi and lo < 2.0 < hi
    se = v.std(ddof=1) / np.sqrt(400)
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.15)  # matches the normal-theory width
    assert bootstrap_ci(v, 500, seed=3) == bootstrap_ci(v, 500, seed=3)
    with pytest.raises(ValueError):
        bootstrap_ci([], 10)


def test_retrieval_metrics_bundle():
    zd = unit(RNG.normal(size=(260, 4)))
    dl = RNG.integers(0, 3, 260)
    out = retrieval_metrics(zd[:40], zd, dl[:40], dl, ks=(1, 10), map_k=20, exclude=np.arange(40), n_boot=200)
    rows = _brute_topk(zd[:40], zd, 10, np.arange(40))
    rec10 = np.mean([(dl[rows[i]] == dl[i]).any() for i in range(40)])
    assert out["recall@10"]["mean"] == pytest.approx(rec10)
    assert out["recall@10"]["low"] <= rec10 <= out["recall@10"]["high"]
    assert set(out) >= {"precision@1", "mAP@20", "knn200_weighted", "knn5_majority"}


def test_bad_k():
    z = unit(RNG.normal(size=(5, 3)))
    with pytest.raises(ValueError, match="k=9"):
        knn_search(z, z, 9)


def test_ideal_topk_matches_sorting():
    from search_refs import VonMises

    rng = np.random.default_rng(5)
    qm, dm = rng.uniform(0, 6.28, (9, 2)), rng.uniform(0, 6.28, (70, 2))
    gen = VonMises(2.0)
    from search.evaluation.metrics import ideal_topk

    got = ideal_topk(qm, dm, gen, 6, exclude=np.r_[3, -1, 5, -1, -1, -1, -1, -1, 0], max_elements=150)
    lr = gen.log_ratio(qm, dm)
    for i, ex in enumerate([3, -1, 5, -1, -1, -1, -1, -1, 0]):
        order = [j for j in np.argsort(-lr[i]) if j != ex][:6]
        np.testing.assert_array_equal(got[i], order)


def test_top_k_by_partition_equals_the_stable_argsort():
    """ideal_topk's selection: the first k of a stable descending argsort, ties (many, and -inf)
    kept in column order, also when the tie straddles the cut."""
    from search.evaluation.metrics import top_k_stable

    rng = np.random.default_rng(3)
    for trial in range(300):
        b, n = int(rng.integers(1, 5)), int(rng.integers(1, 120))
        k = int(rng.integers(1, n + 1))
        v = rng.integers(0, int(rng.integers(1, 8)), size=(b, n)).astype(np.float64)
        if trial % 3 == 0:
            v[rng.random(v.shape) < 0.3] = -np.inf
        np.testing.assert_array_equal(top_k_stable(v, k), np.argsort(-v, axis=1, kind="stable")[:, :k])
