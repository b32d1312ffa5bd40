"""Searcher vs brute-force numpy: top-k, exact whole-database softmax, hot swap rules."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from index.build import BuildOptions, build_index
from index.store import IndexStore
from search.serving.normaliser import NormaliserConfig
from search.serving.searcher import Searcher, log_normaliser
from training.checkpoint import load_checkpoint, save_checkpoint
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder, embed
from training.transforms import preprocess

TINY = dict(image_size=32, width=32, layers=1, heads=2, patch_size=8, mlp_ratio=2.0)


def _checkpoint(path, seed: int, embed_dim: int = 16, temperature: float = 0.2):
    torch.manual_seed(seed)
    enc = create_encoder(EncoderConfig(embed_dim=embed_dim, **TINY))
    return save_checkpoint(
        path,
        enc,
        step=0,
        train_config={"seed": seed},
        lineage={"objective": "infonce", "temperature": temperature},
    )


@pytest.fixture(scope="module")
def store_setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("searcher")
    ck_a = _checkpoint(base / "a.safetensors", seed=1)
    ck_b = _checkpoint(base / "b.safetensors", seed=2)
    ck_wide = _checkpoint(base / "wide.safetensors", seed=3, embed_dim=24)
    ds = create_dataset("synthetic", split="train", size=96, seed=0)
    root = base / "index"
    v1 = build_index(ck_a, ds, root, BuildOptions(progress=False))
    return dict(base=base, root=root, ck_a=ck_a, ck_b=ck_b, ck_wide=ck_wide, ds=ds, v1=v1)


def _brute(q, emb, tau, k):
    """Dense reference: full similarity matrix, argsort, softmax over all N."""
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    s = q.astype(np.float64) @ emb.astype(np.float64).T  # (Q, N)
    logits = s / tau
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return top, np.take_along_axis(s, top, 1), np.take_along_axis(p, top, 1), p


def test_log_normaliser_blocked_matches_dense_and_survives_tiny_tau(rng):
    q = rng.normal(size=(5, 8)).astype(np.float32)
    e = rng.normal(size=(37, 8)).astype(np.float32)
    taus = np.array([1.0, 0.5, 0.1, 0.01, 1e-4])
    got = log_normaliser(q, e, taus, block=4)  # blocks of 4 rows, last one partial
    s = q.astype(np.float64) @ e.astype(np.float64).T / taus[:, None]
    m = s.max(1)
    ref = m + np.log(np.exp(s - m[:, None]).sum(1))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert np.all(np.isfinite(got))  # tau = 1e-4 overflows a naive exp


def test_search_vectors_matches_brute_force(store_setup, rng):
    searcher = Searcher(store_setup["root"], load=True, block=7)  # odd block: exercises partial blocks
    snap = searcher.snapshot()
    emb = snap.index.embeddings
    q = rng.normal(size=(6, emb.shape[1])).astype(np.float32)
    for tau in (None, 0.05, 1.0):
        ans = searcher.search_vectors(q, k=10, temperature=tau)
        t = snap.temperature if tau is None else tau
        assert t == pytest.approx(0.2) or tau is not None  # manifest search_temperature from the checkpoint
        top, sims, probs, full = _brute(q, emb, t, 10)
        assert ans.version == store_setup["v1"]
        for i, hits in enumerate(ans):
            assert [h.row for h in hits] == top[i].tolist()
            assert [h.id for h in hits] == [snap.index.ids[r] for r in top[i]]
            np.testing.assert_allclose([h.similarity for h in hits], sims[i], atol=1e-5)
            np.testing.assert_allclose([h.probability for h in hits], probs[i], rtol=1e-4)
        assert np.all(np.diff([h.similarity for h in ans[0]]) <= 1e-6)  # best first
        np.testing.assert_allclose(full.sum(1), 1.0)


def test_bounded_normaliser_answers_within_its_bound(store_setup, rng):
    """normaliser="bounded" (k-means lists over a flat index): top-k as exact, p = exp(s/tau - log Z^),
    and every query's bound contains the dense log Z; "auto" stays exact on a small index."""
    assert Searcher(store_setup["root"], load=True).snapshot().normaliser is None  # auto -> exact
    cfg = NormaliserConfig("bounded", head_rows=8, samples=64, top_rows=3, max_se=10.0, max_samples=64)
    searcher = Searcher(store_setup["root"], load=True, normaliser=cfg)
    snap = searcher.snapshot()
    assert snap.normaliser.method == "bounded" and "k-means" in snap.normaliser.stats.source
    emb = snap.index.embeddings
    q = rng.normal(size=(12, emb.shape[1])).astype(np.float32)
    ans = searcher.search_vectors(q, k=5, temperature=0.5)
    top, sims, _, _ = _brute(q, emb, 0.5, 5)
    s = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float64) @ emb.astype(np.float64).T
    log_z = np.log(np.exp(s / 0.5).sum(1))
    for i, hits in enumerate(ans):
        est = ans.normalisers[i]
        assert est.method == "bounded" and est.interval is not None and est.rows < snap.count
        assert est.lower <= log_z[i] <= est.upper
        assert ans.log_normalisers[i] == est.value
        assert [h.row for h in hits] == top[i].tolist()
        for h in hits:
            assert h.probability == pytest.approx(np.exp(h.similarity / 0.5 - est.value), rel=1e-6)


def test_bounded_serving_uses_the_versions_stored_statistics(store_setup, tmp_path, monkeypatch, caplog):
    """A version written by `index build` carries its list statistics: the Searcher takes them from
    the file (ListStats.build is never called); a version written before that computes them once."""
    import logging
    import shutil

    from index.list_stats import ListStats
    from index.manifest import read_manifest_json, write_manifest
    from index.store import LIST_STATS_FILE

    root = tmp_path / "index"
    shutil.copytree(store_setup["root"], root)
    built = []
    real_build = ListStats.build.__func__

    def counting_build(cls, *args, **kw):
        built.append(args[0].shape)
        return real_build(cls, *args, **kw)

    monkeypatch.setattr(ListStats, "build", classmethod(counting_build))
    searcher = Searcher(root, load=True, normaliser="bounded")
    stats = searcher.snapshot().normaliser.stats
    assert built == []  # loaded, not rebuilt
    fresh = real_build(
        ListStats, np.asarray(searcher.snapshot().index.embeddings), searcher.snapshot().index.index
    )
    for name in ("offsets", "order", "where", "means", "radius", "lam"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(fresh, name))
    vdir = root / "versions" / store_setup["v1"]
    manifest = read_manifest_json(vdir)  # as written before the statistics were stored
    del manifest["files"][LIST_STATS_FILE]
    write_manifest(vdir, manifest)
    with caplog.at_level(logging.INFO, logger="search.serving.normaliser"):
        legacy = Searcher(root, load=True, normaliser="bounded").snapshot().normaliser.stats
    assert built == [(96, 16)] and any(
        "stores no normaliser statistics" in r.getMessage() for r in caplog.records
    )
    np.testing.assert_array_equal(legacy.means, stats.means)
    built.clear()
    assert Searcher(root, load=True, normaliser="exact").snapshot().normaliser is None and built == []


def test_k_larger_than_index_and_per_query_temperatures(store_setup, rng):
    searcher = Searcher(store_setup["root"], load=True)
    n = searcher.snapshot().count
    q = rng.normal(size=(2, searcher.snapshot().dim)).astype(np.float32)
    ans = searcher.search_vectors(q, k=n + 50, temperature=[0.1, None])
    assert len(ans[0]) == n  # clamped to N; probabilities over all items sum to 1
    assert sum(h.probability for h in ans[0]) == pytest.approx(1.0, abs=1e-6)
    assert ans.temperatures == [0.1, pytest.approx(0.2)]
    with pytest.raises(ValueError, match="values; the index dimension is"):
        searcher.search_vectors(q[:, :3], k=3)
    with pytest.raises(ValueError, match="NaN"):
        searcher.search_vectors(np.full_like(q, np.nan), k=3)
    with pytest.raises(ValueError, match="zero norm"):
        searcher.search_vectors(np.zeros_like(q), k=3)
    with pytest.raises(ValueError, match="temperature"):
        searcher.search_vectors(q, k=3, temperature=-1.0)


def test_search_images_uses_the_checkpoint_encoder(store_setup):
    ds = store_setup["ds"]
    searcher = Searcher(store_setup["root"], load=True)
    images = [ds.image(i) for i in (0, 5, 17)]
    ans = searcher.search_images(images, k=3)
    enc, _ = load_checkpoint(store_setup["ck_a"])
    z = embed(enc, preprocess(images, enc.image_size), progress=False)
    ref = searcher.search_vectors(z, k=3)
    assert [[h.id for h in hits] for hits in ans] == [[h.id for h in hits] for hits in ref]
    # an indexed image finds itself first, at similarity ~1
    assert [hits[0].id for hits in ans] == [ds.item_id(i) for i in (0, 5, 17)]
    assert all(hits[0].similarity == pytest.approx(1.0, abs=1e-4) for hits in ans)


def test_reload_swaps_encoder_with_version_and_refuses_bad_ones(store_setup):
    root, ds = store_setup["root"], store_setup["ds"]
    searcher = Searcher(root, load=True)
    old = searcher.snapshot()
    assert searcher.reload().changed is False  # same current version: no-op
    # a version built with another checkpoint brings its own encoder, atomically
    v2 = build_index(
        store_setup["ck_b"],
        create_dataset("synthetic", split="train", size=40, seed=0),
        root,
        BuildOptions(progress=False),
    )
    res = searcher.reload()
    assert (res.previous, res.version, res.changed, res.encoder_reloaded) == (
        store_setup["v1"],
        v2,
        True,
        True,
    )
    new = searcher.snapshot()
    assert new.count == 40 and new.encoder is not old.encoder
    # the old snapshot still answers on its own version (in-flight queries)
    img = [ds.image(3)]
    assert old.search(old.encode(img), 1).version == store_setup["v1"]
    assert old.search(old.encode(img), 1)[0][0].id == ds.item_id(3)

    # a different embedding width with its own checkpoint is fine too
    v3 = build_index(store_setup["ck_wide"], ds, root, BuildOptions(progress=False))
    assert searcher.reload().version == v3 and searcher.snapshot().dim == 24

    # the store holds its own copy of the weights: overwriting the training checkpoint changes nothing
    store = IndexStore(root)
    store.activate(v2)
    sha_b = store.manifest(v2).checkpoint.sha256
    _checkpoint(store_setup["ck_b"], seed=99)  # overwrite ck_b with different weights
    assert searcher.reload().version == v2
    assert [h.id for h in searcher.search_images(img, 1)[0]] == [
        h.id for h in new.search(new.encode(img), 1)[0]
    ]
    # refused: the store's model damaged (and its source changed) -> the old version keeps serving
    store.activate(v3)
    searcher.reload()
    store.activate(v2)
    model = store.models.path(sha_b)
    model.write_bytes(model.read_bytes()[:-7] + b"damaged")
    with pytest.raises(ValueError, match="damaged"):
        searcher.reload()
    assert searcher.version == v3
    # refused: version does not exist
    with pytest.raises((FileNotFoundError, ValueError)):
        searcher.reload("20990101T000000000Z-deadbeef")
    assert searcher.version == v3
    store.activate(v3)


def test_inflight_queries_finish_on_their_snapshot(store_setup, rng):
    """Queries racing with swaps always get answers consistent with the version they report."""
    root = store_setup["root"]
    store = IndexStore(root)
    searcher = Searcher(root, load=True)
    ref = {}
    for v in store.versions():
        try:
            searcher.reload(v)
        except ValueError:
            continue  # the version whose checkpoint was overwritten above
        snap = searcher.snapshot()
        ref[v] = snap
    assert len(ref) >= 2
    errors, seen, done = [], set(), []
    stop = threading.Event()

    def client(seed):
        r = np.random.default_rng(seed)
        while not stop.is_set():
            snap_dims = {v: s.dim for v, s in ref.items()}
            dim = searcher.snapshot().dim
            q = r.normal(size=(1, dim)).astype(np.float32)
            try:
                ans = searcher.search_vectors(q, k=3)
            except ValueError:  # dimension changed between reading dim and searching
                continue
            s = ref[ans.version]
            if q.shape[1] != snap_dims[ans.version]:
                errors.append("dim")
                continue
            exp = s.search(q, 3)
            seen.add(ans.version)
            if [h.id for h in ans[0]] != [h.id for h in exp[0]]:
                errors.append(ans.version)
            done.append(1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for i in range(12):
        searcher.reload(list(ref)[i % len(ref)])
        start, waited = len(done), 0
        while len(done) < start + 4 and waited < 2000:  # let queries run on this version
            threading.Event().wait(0.001)
            waited += 1
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert seen == set(ref)


def test_from_parts_and_not_ready(store_setup, rng):
    from search.serving.searcher import NotReadyError

    version = IndexStore(store_setup["root"]).load(store_setup["v1"])
    enc, _ = load_checkpoint(store_setup["ck_a"])
    searcher = Searcher.from_parts(enc, version)
    q = rng.normal(size=(2, 16)).astype(np.float32)
    top, sims, probs, _ = _brute(q, version.embeddings, 0.2, 4)
    ans = searcher.search_vectors(q, 4)
    assert [[h.row for h in hits] for hits in ans] == top.tolist()
    np.testing.assert_allclose([[h.probability for h in hits] for hits in ans], probs, rtol=1e-4)
    with pytest.raises(ValueError, match="dimension"):
        Searcher.from_parts(create_encoder(EncoderConfig(embed_dim=8, **TINY)), version)
    empty = Searcher(store_setup["base"] / "no_index")
    assert not empty.ready and empty.version is None
    with pytest.raises(NotReadyError):
        empty.search_vectors(q, 3)


def test_page_release_setting_reaches_both_normalisers(store_setup, rng, monkeypatch):
    """NormaliserConfig.release_pages (serve --mapped-pages release | keep | auto) is what the exact scan and
    the bounded estimate are called with; the answers do not depend on it (tests/search/test_page_release.py
    checks the pages themselves)."""
    import search.serving.normaliser as normaliser_module
    import search.serving.searcher as searcher_module

    seen = []
    real_exact, real_bounded = searcher_module.ExactScanner, normaliser_module.bounded_log_normaliser

    def exact_spy(*args, **kwargs):  # the exact path's one-pass scan (made once per snapshot)
        seen.append(("exact", kwargs.get("release")))
        return real_exact(*args, **kwargs)

    def bounded_spy(*args, **kwargs):
        seen.append(("bounded", kwargs.get("release")))
        return real_bounded(*args, **kwargs)

    monkeypatch.setattr(searcher_module, "ExactScanner", exact_spy)
    monkeypatch.setattr(normaliser_module, "bounded_log_normaliser", bounded_spy)
    answers = {}
    for method in ("exact", "bounded"):
        for release in (True, False, None):
            cfg = NormaliserConfig(
                method, release_pages=release, head_rows=8, samples=64, max_se=10.0, max_samples=64
            )
            searcher = Searcher(store_setup["root"], load=True, normaliser=cfg)
            q = np.random.default_rng(7).normal(size=(3, searcher.snapshot().dim)).astype(np.float32)
            ans = searcher.search_vectors(q, k=5, temperature=0.5)
            answers[method, release] = (
                ans.log_normalisers,
                [[(h.row, h.probability) for h in hits] for hits in ans],
            )
    # None (auto): the exact scan releases, the bounded estimate's scattered reads stay mapped
    assert seen == [
        ("exact", True),
        ("exact", False),
        ("exact", True),
        ("bounded", True),
        ("bounded", False),
        ("bounded", False),
    ]
    assert answers["exact", True] == answers["exact", False] == answers["exact", None]
    assert answers["bounded", True] == answers["bounded", False] == answers["bounded", None]


@pytest.mark.parametrize("kind, params", [("flat", {}), ("ivf-flat", {"nlist": 4}), ("hnsw", {"M": 8})])
def test_filtered_search_equals_brute_force_over_the_subset(store_setup, tmp_path, rng, kind, params):
    """p(j | x, F) = exp(s_j/tau) / sum_{l in F} exp(s_l/tau), the top-k taken within F, for a user
    field filter (stored with the version) and an arbitrary 10 % subset."""
    from index.metadata import Metadata
    from search.serving.filters import parse_filter

    root = tmp_path / kind
    ids = store_setup["ds"].item_ids()
    user = Metadata({"group": "int"}, {iid: {"group": n % 3} for n, iid in enumerate(ids)})
    build_index(
        store_setup["ck_a"],
        store_setup["ds"],
        root,
        BuildOptions(kind=kind, params=params, progress=False, force=True, metadata=user),
    )
    s = Searcher(root, load=True)
    snap = s.snapshot()
    assert snap.metadata_fields == {"group": "int"}
    flt = parse_filter({"group": 1}, snap.metadata_fields)
    class_mask = snap.filter_mask(flt)
    np.testing.assert_array_equal(class_mask, [ids.index(i) % 3 == 1 for i in snap.index.ids])
    assert snap.filter_mask(flt) is class_mask  # cached
    random_mask = np.zeros(snap.count, bool)
    random_mask[rng.choice(snap.count, size=10, replace=False)] = True
    emb = np.asarray(snap.index.embeddings)
    q = rng.normal(size=(6, snap.dim)).astype(np.float32)
    for mask in (class_mask, random_mask):
        sub = np.flatnonzero(mask)
        k = min(5, sub.size)
        answer = snap.search(q, k, 0.3, mask=mask)
        top, sims, p_top, _ = _brute(q, emb[sub], 0.3, k)
        for i in range(q.shape[0]):
            assert [h.row for h in answer[i]] == sub[top[i]].tolist()
            np.testing.assert_allclose([h.probability for h in answer[i]], p_top[i], rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose([h.similarity for h in answer[i]], sims[i], atol=1e-5)
    empty = np.zeros(snap.count, bool)
    assert snap.search(q[:1], 5, mask=empty)[0] == []


def test_pq_candidates_are_reranked_by_exact_similarity(store_setup, tmp_path, rng):
    """An IVF-PQ version answers with its candidates ordered by exact similarity (rerank x k of them, the
    factor the build tuned with nprobe), so its top-k is at least as close to brute force as the PQ code
    order, and always sorted."""
    from index import faiss_index as fi

    root = tmp_path / "pq"
    build_index(
        store_setup["ck_a"],
        store_setup["ds"],
        root,
        BuildOptions(kind="ivf-pq", params={"nlist": 4, "m": 4}, progress=False, force=True),
    )
    snap = Searcher(root, load=True).snapshot()
    assert snap.rerank == snap.manifest.params["rerank"] == snap.manifest.recall.rerank >= 1
    emb = np.asarray(snap.index.embeddings)
    q = rng.normal(size=(40, snap.dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    answer = snap.search(q, 5, 0.3)
    exact = np.argsort(-(q @ emb.T), axis=1, kind="stable")[:, :5]
    _, pq_rows = fi.search(snap.index.index, q, 5)
    served = np.array([[h.row for h in hits] for hits in answer])
    for hits in answer:
        sims = [h.similarity for h in hits]
        assert sims == sorted(sims, reverse=True)
    assert fi.recall_at_k(served, exact, 5) >= fi.recall_at_k(pq_rows, exact, 5)
