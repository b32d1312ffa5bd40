"""A sharded version served in process equals the unsharded version it was split from and a dense numpy
softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from index.build import BuildOptions, build_index
from index.metadata import Metadata
from index.shards import ShardedVersion, reshard
from index.store import IndexStore
from search.serving.filters import parse_filter
from search.serving.normaliser import NormaliserConfig
from search.serving.searcher import Searcher
from search.serving.sharded import ShardedSnapshot, ShardUnavailable
from training.checkpoint import save_checkpoint
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder

TINY = dict(image_size=32, width=32, layers=1, heads=2, patch_size=8, mlp_ratio=2.0)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """{whole, sharded}: Searchers over one 120-item version with a user field `group` (id n: n % 4) and over
    the 3-shard version resharded from it, in one store."""
    base = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(3)
    enc = create_encoder(EncoderConfig(embed_dim=16, **TINY))
    ck = save_checkpoint(
        base / "a.safetensors",
        enc,
        step=0,
        train_config={"seed": 3},
        lineage={"objective": "infonce", "temperature": 0.2},
    )
    ds = create_dataset("synthetic", split="train", size=120, seed=0)
    ids = ds.item_ids()
    user = Metadata({"group": "int"}, {iid: {"group": n % 4} for n, iid in enumerate(ids)})
    root = base / "index"
    whole = build_index(ck, ds, root, BuildOptions(progress=False, metadata=user))
    sharded = reshard(root, 3)
    return {"root": root, "whole": whole, "sharded": sharded, "ids": ids}


def _loaded(stores, which, **kw):
    s = Searcher(stores["root"], **kw)
    s.load(stores[which])
    return s


def _dense(q, emb, tau, k):
    """Float64 dense reference: every similarity, softmax over all rows, top-k by similarity."""
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    s = q.astype(np.float64) @ emb.astype(np.float64).T
    logits = s / tau
    log_z = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return top, np.exp(np.take_along_axis(logits, top, 1) - log_z[:, None]), log_z


def test_sharded_version_is_one_version_with_its_shards_listed(stores):
    store = IndexStore(stores["root"])
    assert store.current_version() == stores["sharded"]
    m = store.manifest(stores["sharded"])
    assert [e["name"] for e in m.shards] == ["shard-000", "shard-001", "shard-002"]
    assert [e["count"] for e in m.shards] == [40, 40, 40] and [e["offset"] for e in m.shards] == [0, 40, 80]
    assert m.count == 120 and m.parent == stores["whole"]
    assert {n.split("/")[1] for n in m.files} >= {
        "index.faiss",
        "embeddings.npy",
        "ids.json",
        "manifest.json",
        "item_metadata.json",
        "normaliser_stats.npz",
    }
    loaded = store.load(stores["sharded"])
    whole = store.load(stores["whole"])
    assert isinstance(loaded, ShardedVersion) and loaded.ids == whole.ids
    np.testing.assert_array_equal(np.asarray(loaded.embeddings), np.asarray(whole.embeddings))
    assert loaded.embeddings[77].tolist() == whole.embeddings[77].tolist()


@pytest.mark.parametrize("tau,k", [(None, 5), (0.05, 10), (1.0, 200)])
def test_same_ids_and_probabilities_as_unsharded_and_dense_numpy(stores, tau, k):
    whole, sharded = _loaded(stores, "whole"), _loaded(stores, "sharded")
    assert isinstance(sharded.snapshot(), ShardedSnapshot)
    rng = np.random.default_rng(5)
    q = rng.normal(size=(7, 16)).astype(np.float32)
    a, b = whole.search_vectors(q, k, tau), sharded.search_vectors(q, k, tau)
    emb = np.asarray(IndexStore(stores["root"]).load(stores["whole"]).embeddings)
    t = tau if tau is not None else whole.snapshot().temperature
    top, p_dense, log_z = _dense(q, emb, t, min(k, 120))
    np.testing.assert_allclose(
        b.log_normalisers, a.log_normalisers, rtol=0, atol=1e-6
    )  # float32 partial sums in another order
    np.testing.assert_allclose(b.log_normalisers, log_z, atol=1e-5)  # float32 similarities / tau
    assert b.version == stores["sharded"]
    for i in range(q.shape[0]):
        assert [h.id for h in b[i]] == [h.id for h in a[i]]
        assert [h.row for h in b[i]] == top[i].tolist()
        np.testing.assert_allclose(
            [h.probability for h in b[i]], [h.probability for h in a[i]], atol=1e-6, rtol=0
        )
        np.testing.assert_allclose([h.probability for h in b[i]], p_dense[i], rtol=1e-5, atol=1e-9)
    if k >= 120:  # every row returned: the probabilities over the whole version sum to 1
        np.testing.assert_allclose([sum(h.probability for h in hits) for hits in b], 1.0, atol=1e-9)


def test_filters_across_shards_equal_unsharded_and_dense(stores):
    whole, sharded = _loaded(stores, "whole").snapshot(), _loaded(stores, "sharded").snapshot()
    assert sharded.metadata_fields == whole.metadata_fields == {"group": "int"}
    rng = np.random.default_rng(9)
    q = rng.normal(size=(5, 16)).astype(np.float32)
    emb = np.asarray(whole.index.embeddings)
    one_shard = np.zeros(120, bool)
    one_shard[[45, 50, 71]] = True  # rows of shard-001 only: the other shards contribute log Z_s = -inf
    for mask in (sharded.filter_mask(parse_filter({"group": 2}, sharded.metadata_fields)), one_shard):
        np.testing.assert_array_equal(
            mask,
            whole.filter_mask(parse_filter({"group": 2}, whole.metadata_fields))
            if mask is not one_shard
            else one_shard,
        )
        sub = np.flatnonzero(mask)
        k = min(6, sub.size)
        a, b = whole.search(q, k, 0.3, mask=mask), sharded.search(q, k, 0.3, mask=mask)
        top, p_dense, log_z = _dense(q, emb[sub], 0.3, k)
        np.testing.assert_allclose(b.log_normalisers, log_z, atol=1e-5)  # float32 similarities / tau
        for i in range(q.shape[0]):
            assert [h.row for h in b[i]] == sub[top[i]].tolist() == [h.row for h in a[i]]
            np.testing.assert_allclose([h.probability for h in b[i]], p_dense[i], rtol=1e-5, atol=1e-9)
            np.testing.assert_allclose(
                [h.probability for h in b[i]], [h.probability for h in a[i]], atol=1e-6
            )
    assert sharded.search(q[:1], 5, mask=np.zeros(120, bool))[0] == []


def test_bounded_normaliser_merges_shard_bounds_around_the_exact_value(stores):
    sharded = _loaded(stores, "sharded", normaliser=NormaliserConfig(method="bounded"))
    exact = _loaded(stores, "whole")
    q = np.random.default_rng(2).normal(size=(4, 16)).astype(np.float32)
    b, a = sharded.search_vectors(q, 5, 0.1), exact.search_vectors(q, 5, 0.1)
    norm = b.normalisers
    assert np.all(norm.lower <= np.asarray(a.log_normalisers) + 1e-9)
    assert np.all(np.asarray(a.log_normalisers) <= norm.upper + 1e-9)
    assert [[h.id for h in hits] for hits in b] == [[h.id for h in hits] for hits in a]


def test_a_failing_shard_fails_the_query_naming_it(stores):
    sharded = _loaded(stores, "sharded")
    snap = sharded.snapshot()

    def down(*args):
        raise ConnectionError("replica died")

    broken = ShardedSnapshot(
        **{
            **{
                f: getattr(snap, f)
                for f in ("encoder", "checkpoint_sha256", "index", "temperature", "block", "runner")
            },
            "shards": (snap.shards[0], down, snap.shards[2]),
            "names": snap.names,
        }
    )
    with pytest.raises(ShardUnavailable, match="shard-001"):
        broken.search(np.ones((1, 16), np.float32), 5)


def test_image_search_on_a_sharded_version_equals_unsharded(stores):
    ds = create_dataset("synthetic", split="test", size=3, seed=1)
    images = [ds.image(i) for i in range(3)]
    a = _loaded(stores, "whole").search_images(images, 4)
    b = _loaded(stores, "sharded").search_images(images, 4)
    for x, y in zip(a, b):
        assert [h.id for h in x] == [h.id for h in y]
        np.testing.assert_allclose([h.probability for h in x], [h.probability for h in y], atol=1e-6)


def test_sharded_version_ann_search_and_duplicate_neighbours_equal_unsharded(stores):
    """ShardedVersion.search (each shard's FAISS index, merged by score) answers what the unsharded flat index
    answers."""
    store = IndexStore(stores["root"])
    whole, sharded = store.load(stores["whole"]), store.load(stores["sharded"])
    q = np.random.default_rng(4).normal(size=(6, 16)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    (s_a, r_a), (s_b, r_b) = whole.search(q, 12), sharded.search(q, 12)
    np.testing.assert_array_equal(r_b, r_a)
    np.testing.assert_allclose(s_b, s_a, atol=1e-6)
    assert sharded.search(q[:1], 500)[1].shape == (1, 120)
    assert sharded.item_ids(r_b[0]) == whole.item_ids(r_a[0])


def test_auto_on_a_shard_goes_by_size_so_every_process_decides_alike(stores):
    """A timing probe could pick exact in one process and bounded in another (in process, each Ray replica);
    a shard's `auto` skips it and follows the size rule, which every process computes the same."""
    # sizes where `auto` is open (N * D above exact_max_macs, within the probe's factor of it): the whole
    # version probes, each shard does not
    config = NormaliserConfig(method="auto", head_rows=4, samples=4, exact_max_macs=400)
    whole = _loaded(stores, "whole", normaliser=config)
    assert "probe" in whole.snapshot().normaliser_info
    sharded = _loaded(stores, "sharded", normaliser=config)
    version = IndexStore(stores["root"]).load(stores["sharded"], verify=False, gpu=False)
    shards, names = sharded.shard_searchers(version)
    assert len(shards) == 3
    for shard in shards:
        info = shard.snapshot.normaliser_info
        assert "probe" not in info and info["requested"] == "auto"
        assert info["method"] == "bounded"  # 40 rows x 16 > 400: the size rule's answer, in every process
    q = np.random.default_rng(5).normal(size=(3, 16)).astype(np.float32)
    first = sharded.search_vectors(q, 5, 0.1)
    again = _loaded(stores, "sharded", normaliser=config).search_vectors(q, 5, 0.1)
    np.testing.assert_array_equal(first.log_normalisers, again.log_normalisers)
