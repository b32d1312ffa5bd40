"""build_index / add_items / rebuild_index with a real (tiny) checkpoint and datasets."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from index.build import BuildOptions, QualityGateError, add_items, build_index, rebuild_index
from index.embed import cache_key, embed_shards, prepare_cache
from index.options import EmbedOptions
from index.store import IndexStore, IndexVersion
from training.checkpoint import checkpoint_sha256, load_checkpoint
from training.datasets import create_dataset
from training.encoder import embed

QUIET = EmbedOptions(progress=False)


def _reference(checkpoint, dataset) -> np.ndarray:
    """Embeddings by the training package's own embed(): an independent path to the same numbers."""
    encoder, _ = load_checkpoint(checkpoint)
    return embed(encoder, dataset.tensors(np.arange(len(dataset))), batch_size=64, progress=False)


@pytest.fixture(scope="module")
def train_ds():
    return create_dataset("synthetic", split="train", size=96, seed=0)


@pytest.fixture(scope="module")
def test_ds():
    return create_dataset("synthetic", split="test", size=40, seed=0)


def test_build_embeds_indexes_and_describes(tmp_path, tiny_checkpoint, train_ds):
    version = build_index(
        tiny_checkpoint,
        train_ds,
        tmp_path,
        BuildOptions(kind="flat", batch_size=32, shard_size=40, progress=False),
    )
    store = IndexStore(tmp_path)
    assert store.current_version() == version and store.versions() == [version]
    loaded = store.load()
    ref = _reference(tiny_checkpoint, train_ds)
    np.testing.assert_allclose(loaded.embeddings, ref, atol=1e-5)
    assert loaded.ids == train_ds.item_ids()
    _, rows = loaded.search(ref[:10], 1)
    np.testing.assert_array_equal(rows[:, 0], np.arange(10))  # every item finds itself
    m = loaded.manifest
    assert m.checkpoint.sha256 == checkpoint_sha256(tiny_checkpoint) and m.checkpoint.step == 7
    assert m.encoder["embed_dim"] == 16 and m.dim == 16
    assert m.dataset == {"spec": train_ds.spec(), "fingerprint": train_ds.fingerprint()}
    assert m.lineage["objective"] == "infonce" and m.lineage["temperature_schedule"] == "fixed"
    assert len(m.lineage["train_config_hash"]) == 64
    assert m.search_temperature == 0.25 and "schedule_options" in m.search_temperature_source
    assert m.skipped == [] and m.skipped_count == 0 and m.sources[0]["count"] == 96
    assert {"embed_s", "build_s", "tune_s", "write_s", "total_s"} <= set(m.timings)
    assert not any(p.name.startswith("embed-") for p in store.staging_dir.iterdir())  # shard cache removed


def test_add_appends_without_reembedding(tmp_path, tiny_checkpoint, train_ds, test_ds):
    v1 = build_index(tiny_checkpoint, train_ds, tmp_path, BuildOptions(kind="hnsw", progress=False))
    store = IndexStore(tmp_path)
    old = store.load()
    v2 = add_items(tmp_path, test_ds, embed=QUIET)
    new = store.load()
    assert store.current_version() == v2 and new.manifest.parent == v1
    assert len(new) == 136 and new.ids == old.ids + test_ds.item_ids()
    np.testing.assert_array_equal(new.embeddings[:96], old.embeddings)  # old rows byte-identical
    np.testing.assert_allclose(new.embeddings[96:], _reference(tiny_checkpoint, test_ds), atol=1e-5)
    _, rows = new.search(new.embeddings[96:], 1)
    assert np.mean(rows[:, 0] == np.arange(96, 136)) >= 0.95  # new items are searchable
    assert new.manifest.added == {"count": 40, "duplicates": 0, "skipped": 0}
    assert [s["spec"]["split"] for s in new.manifest.sources] == ["train", "test"]
    with pytest.raises(ValueError, match="already in"):
        add_items(tmp_path, test_ds, embed=QUIET)
    # partly new: only the unseen items are embedded
    more = create_dataset("synthetic", split="test", size=50, seed=0)
    v3 = add_items(tmp_path, more, embed=QUIET)
    assert store.load(v3).manifest.added == {"count": 10, "duplicates": 40, "skipped": 0}
    assert len(store.load(v3)) == 146


def test_add_refuses_another_checkpoint(tmp_path, tiny_checkpoint, other_checkpoint, train_ds, test_ds):
    build_index(tiny_checkpoint, train_ds, tmp_path, BuildOptions(progress=False))
    with pytest.raises(ValueError, match="rebuild"):
        add_items(tmp_path, test_ds, checkpoint=other_checkpoint, embed=QUIET)


def test_rebuild_reembeds_current_corpus(tmp_path, tiny_checkpoint, other_checkpoint, train_ds, test_ds):
    build_index(
        tiny_checkpoint,
        train_ds,
        tmp_path,
        BuildOptions(kind="ivf-flat", params={"nlist": 2}, progress=False),
    )
    v2 = add_items(tmp_path, test_ds, embed=QUIET)
    v3 = rebuild_index(tmp_path, other_checkpoint, BuildOptions(progress=False))
    store = IndexStore(tmp_path)
    new = store.load()
    assert store.current_version() == v3 and new.manifest.parent == v2
    assert new.kind == "ivf-flat" and new.ids == store.load(v2).ids
    ref = np.concatenate([_reference(other_checkpoint, train_ds), _reference(other_checkpoint, test_ds)])
    np.testing.assert_allclose(new.embeddings, ref, atol=1e-5)
    assert new.manifest.search_temperature == 0.4  # metrics.temperature wins
    assert new.manifest.lineage["objective"] == "weince"


def test_unreadable_images_are_skipped_and_listed(tmp_path, tiny_checkpoint):
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(folder / f"ok{i}.png")
    (folder / "garbage.png").write_bytes(b"not an image at all")
    full = (folder / "ok0.png").read_bytes()
    (folder / "truncated.png").write_bytes(full[: len(full) // 2])
    ds = create_dataset("folder", split="all", root=str(folder))
    assert len(ds) == 6 and len(ds.skipped) == 2  # refused at decode time, once, with a reason
    version = build_index(
        tiny_checkpoint, ds, tmp_path / "idx", BuildOptions(batch_size=4, shard_size=3, progress=False)
    )
    m = IndexStore(tmp_path / "idx").manifest(version)
    assert m.count == 6 and m.skipped_count == 2 and m.sources[0]["skipped"] == 2
    assert sorted((s["id"], s["reason"]) for s in m.skipped) == [
        ("garbage.png", "not_an_image"),
        ("truncated.png", "corrupt_image"),
    ]
    assert all(s["error"] for s in m.skipped)
    assert sorted(IndexStore(tmp_path / "idx").load().ids) == [f"ok{i}.png" for i in range(6)]


def test_resume_reuses_finished_shards(tmp_path, tiny_checkpoint, train_ds):
    # Simulate an interrupted run: only the even shards (rank 0 of 2) are on disk.
    store = IndexStore(tmp_path)
    store.ensure()
    idx = np.arange(len(train_ds))
    key = cache_key(checkpoint_sha256(tiny_checkpoint), train_ds.fingerprint(), idx, 16)
    encoder, _ = load_checkpoint(tiny_checkpoint)
    prepare_cache(store.staging_dir / f"embed-{key}", key, idx, 16)
    assert (
        embed_shards(
            encoder,
            train_ds,
            store.staging_dir / f"embed-{key}",
            idx,
            shard_size=16,
            rank=0,
            world_size=2,
            progress=False,
        )
        == 3
    )
    version = build_index(tiny_checkpoint, train_ds, tmp_path, BuildOptions(shard_size=16, progress=False))
    loaded = store.load(version)
    assert loaded.manifest.sources[0]["resumed_shards"] == 3
    np.testing.assert_allclose(loaded.embeddings, _reference(tiny_checkpoint, train_ds), atol=1e-5)


def test_quality_gate(tmp_path, tiny_checkpoint, other_checkpoint, train_ds):
    seen = []

    def evaluator(candidate, serving):
        seen.append((candidate, serving))
        assert isinstance(candidate, IndexVersion) and isinstance(serving, IndexVersion)
        return {"metric": "recall@10", "candidate": 0.50, "serving": 0.60}

    v1 = build_index(tiny_checkpoint, train_ds, tmp_path, BuildOptions(evaluator=evaluator, progress=False))
    assert seen == []  # nothing serving yet: no comparison
    with pytest.raises(QualityGateError, match="refused") as info:
        build_index(
            other_checkpoint,
            train_ds,
            tmp_path,
            BuildOptions(evaluator=evaluator, margin=0.05, progress=False),
        )
    store = IndexStore(tmp_path)
    v2 = info.value.version
    assert seen[0][1].version == v1 and seen[0][0].version == v2
    assert store.current_version() == v1 and v2 in store.versions()
    gate = store.manifest(v2).quality_gate.to_json()
    assert gate["passed"] is False and gate["serving_version"] == v1 and gate["metric"] == "recall@10"
    v3 = build_index(
        other_checkpoint, train_ds, tmp_path, BuildOptions(evaluator=evaluator, margin=0.2, progress=False)
    )
    assert store.current_version() == v3 and store.manifest(v3).quality_gate.passed is True
    v4 = build_index(
        tiny_checkpoint, train_ds, tmp_path, BuildOptions(evaluator=evaluator, force=True, progress=False)
    )
    assert store.current_version() == v4 and store.manifest(v4).quality_gate.forced is True


def test_build_rejects_bad_input(tmp_path, tiny_checkpoint, train_ds):
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        build_index(tmp_path / "missing.safetensors", train_ds, tmp_path)
    with pytest.raises(ValueError, match="unknown index kind 'annoy'"):
        build_index(tiny_checkpoint, train_ds, tmp_path, BuildOptions(kind="annoy"))
    with pytest.raises(ValueError, match="image_size"):
        build_index(
            tiny_checkpoint,
            create_dataset("synthetic", size=4, image_size=16),
            tmp_path,
            BuildOptions(progress=False),
        )
    with pytest.raises(FileNotFoundError, match="no current"):
        rebuild_index(tmp_path / "empty", tiny_checkpoint)


def test_failure_while_writing_leaves_current_intact(tmp_path, tiny_checkpoint, train_ds, monkeypatch):
    v1 = build_index(tiny_checkpoint, train_ds, tmp_path, BuildOptions(progress=False))
    import index.build as build_mod

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(build_mod, "write_manifest", crash)
    with pytest.raises(OSError, match="disk full"):
        build_index(tiny_checkpoint, train_ds, tmp_path, BuildOptions(kind="hnsw", progress=False))
    store = IndexStore(tmp_path)
    assert store.versions() == [v1] and store.current_version() == v1
    assert len(store.load(verify=True)) == 96
