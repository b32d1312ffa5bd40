"""IndexStore / IndexVersion / manifest: round trips, checksums, activation history, retention."""

from __future__ import annotations

import json

import faiss
import numpy as np
import pytest
from index_refs import brute_force, unit_vectors

from index.build import write_version
from index.manifest import IndexCorruptError, file_sha256
from index.store import (
    EMBEDDINGS_FILE,
    IDS_FILE,
    INDEX_FILE,
    LIST_STATS_FILE,
    IndexStore,
    IndexVersion,
    check_version_name,
)


def _commit(store: IndexStore, n=300, d=8, seed=0, kind="flat", activate=True, **kw) -> str:
    emb = unit_vectors(n, d, seed)
    ids = [f"item-{seed}-{i}" for i in range(n)]
    version, staging = write_version(store, emb, ids, kind=kind, **kw)
    store.commit(staging, version)
    if activate:
        store.activate(version)
    return version


@pytest.mark.parametrize("kind", ["flat", "ivf-flat", "ivf-pq", "hnsw"])
def test_round_trip_search_matches_brute_force(tmp_path, kind):
    store = IndexStore(tmp_path)
    emb, q = unit_vectors(1200, 16, 0), unit_vectors(30, 16, 1)
    ids = [f"img/{i:05d}.png" for i in range(len(emb))]
    params = {"nlist": 8, "m": 8, "nbits": 4} if kind == "ivf-pq" else {}
    # PQ codes of 8 x 4 bits are lossy: its target is what it can reach (the activation rule checks it)
    version, staging = write_version(
        store, emb, ids, kind=kind, params=params, target_recall=0.3 if kind == "ivf-pq" else 0.95
    )
    assert store.versions() == []  # nothing visible before commit
    store.commit(staging, version)
    store.activate(version)
    loaded = store.load()
    assert loaded.version == version and len(loaded) == 1200 and loaded.kind == kind
    np.testing.assert_array_equal(loaded.embeddings, emb)
    # memory-mapped and read-only: no second resident copy of the N x D matrix
    assert isinstance(loaded.embeddings, np.memmap) and not loaded.embeddings.flags.writeable
    assert loaded.ids == ids
    scores, rows = loaded.search(q, 10)
    ref_s, ref_rows = brute_force(emb, q, 10)
    if kind == "flat":
        np.testing.assert_array_equal(rows, ref_rows)
        np.testing.assert_allclose(scores, ref_s, atol=1e-5)
    recall = np.mean([len(set(r) & set(e)) / 10 for r, e in zip(rows, ref_rows)])
    assert recall >= (0.3 if kind == "ivf-pq" else 0.9), recall
    # the tuned knob survives the write/read cycle
    m = loaded.manifest
    if kind in ("ivf-flat", "ivf-pq"):
        assert faiss.extract_index_ivf(loaded.index).nprobe == m.params["nprobe"] == m.recall.value
    if kind == "hnsw":
        assert faiss.downcast_index(loaded.index).hnsw.efSearch == m.params["efSearch"]
    assert loaded.item_ids(rows[0]) == [ids[r] for r in rows[0]]
    assert loaded.item_ids(np.array([[3, -1]])) == [[ids[3]]]


def test_manifest_contents(tmp_path):
    store = IndexStore(tmp_path)
    version = _commit(store, n=100, d=8, fields={"search_temperature": 0.07})
    m = store.manifest(version)
    assert m.version == version and m.count == 100 and m.dim == 8
    assert m.metric == "inner_product" and m.normalised is True and m.kind == "flat"
    assert m.faiss_version == faiss.__version__ and m.search_temperature == 0.07
    assert set(m.files) == {INDEX_FILE, EMBEDDINGS_FILE, IDS_FILE, LIST_STATS_FILE}
    for name, info in m.files.items():  # recorded checksums are the real ones
        path = store.path(version) / name
        assert info["sha256"] == file_sha256(path) and info["bytes"] == path.stat().st_size
    assert m.recall.recall == 1.0 and {"build_s", "tune_s", "write_s"} <= set(m.timings)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_corruption_is_refused_and_previous_stays_loadable(tmp_path, damage):
    store = IndexStore(tmp_path)
    good = _commit(store, seed=1)
    bad = _commit(store, seed=2, activate=False)
    target = store.path(bad) / (EMBEDDINGS_FILE if damage != "truncate" else INDEX_FILE)
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "delete":
        target.unlink()
    else:
        (store.path(bad) / "manifest.json").write_text("{not json")
    with pytest.raises(IndexCorruptError, match=str(store.path(bad))):
        store.load(bad)
    assert isinstance(IndexCorruptError("x"), ValueError)
    assert store.current_version() == good
    assert len(store.load()) == 300


def test_shape_mismatch_is_detected_without_checksums(tmp_path):
    store = IndexStore(tmp_path)
    version = _commit(store, n=50)
    (store.path(version) / IDS_FILE).write_text(json.dumps(["only-one"]))
    with pytest.raises(IndexCorruptError, match="ids"):
        store.load(version, verify=False)


def test_activate_rollback_history(tmp_path):
    store = IndexStore(tmp_path)
    assert store.current_version() is None and store.versions() == []
    with pytest.raises(FileNotFoundError, match="no current"):
        store.load()
    a, b, c = (_commit(store, n=20, seed=s, activate=False) for s in range(3))
    assert store.versions() == sorted([a, b, c]) == [a, b, c]  # names sort by creation time
    store.activate(a)
    store.activate(b)
    store.activate(c)
    assert store.current_version() == c
    assert store.rollback() == b and store.current_version() == b
    assert store.load().ids[0] == "item-1-0"
    assert store.rollback() == a
    with pytest.raises(ValueError, match="no earlier"):
        store.rollback()
    assert store.current_version() == a
    store.activate(c)
    assert store.rollback() == a
    assert [e["action"] for e in store.history()["log"]] == ["activate"] * 3 + ["rollback"] * 2 + [
        "activate",
        "rollback",
    ]
    with pytest.raises(ValueError, match="unknown index version 'nope'"):
        store.activate("nope")
    for bad in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(ValueError, match="invalid version name"):
            check_version_name(bad)
    assert not (tmp_path / "current.tmp").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_retention_never_deletes_current_and_rollback_skips_deleted(tmp_path):
    store = IndexStore(tmp_path)
    names = [_commit(store, n=10, seed=s, activate=False) for s in range(5)]
    store.activate(names[1])
    store.activate(names[0])
    removed = store.prune(2)
    assert sorted(removed) == names[1:3]
    assert store.versions() == [names[0], names[3], names[4]]
    assert store.current_version() == names[0]
    with pytest.raises(ValueError, match="no earlier"):  # names[1] was deleted: nothing to go back to
        store.rollback()
    with pytest.raises(ValueError, match="keep"):
        store.prune(0)


def test_update_manifest_fields_only_before_activation(tmp_path):
    store = IndexStore(tmp_path)
    v = _commit(store, n=10, activate=False)
    m = store.update_manifest_fields(v, search_temperature=0.05, calibration={"gap": 0.1})
    assert m.search_temperature == 0.05 and store.load(v).manifest.calibration == {"gap": 0.1}
    with pytest.raises(ValueError, match="count"):
        store.update_manifest_fields(v, count=3)
    store.activate(v)
    with pytest.raises(ValueError, match="immutable"):
        store.update_manifest_fields(v, search_temperature=0.5)


def test_write_version_rejects_bad_input(tmp_path):
    store = IndexStore(tmp_path)
    emb = unit_vectors(10, 4, 0)
    with pytest.raises(ValueError, match="unit rows"):
        write_version(store, emb * 2, [str(i) for i in range(10)])
    with pytest.raises(ValueError, match="not unique"):
        write_version(store, emb, ["a"] * 10)
    with pytest.raises(ValueError, match="9 ids"):
        write_version(store, emb, [str(i) for i in range(9)])
    version, staging = write_version(
        store, emb, [str(i) for i in range(10)], kind="auto", memory_budget=1 << 30
    )
    assert IndexVersion.load(staging).kind == "flat"
    with pytest.raises(FileNotFoundError):
        IndexVersion.load(tmp_path / "missing")


def test_clean_staging_removes_only_stale_version_dirs(tmp_path):
    import os

    store = IndexStore(tmp_path)
    store.ensure()
    old_version = store.staging_path("20200101T000000000Z-00000000")
    fresh = store.staging_path("20990101T000000000Z-11111111")
    cache = store.staging_dir / "embed-abc"
    cache.mkdir()
    for p in (old_version, cache):
        os.utime(p, (0, 0))
    assert store.clean_staging(max_age_s=60) == [old_version.name]
    assert fresh.is_dir() and cache.is_dir() and not old_version.exists()


def test_gc_removes_trash_and_pointer_temp_files_left_by_kills(tmp_path):
    """A prune killed after its rename leaves `.trash-<version>/`; a kill during the pointer write leaves
    `.current.*.tmp`: gc removes both once older than its age, keeps fresh ones and the lock file."""
    import os

    store = IndexStore(tmp_path)
    store.ensure()
    trash = tmp_path / ".trash-20200101T000000000Z-00000000"
    (trash / "sub").mkdir(parents=True)
    (trash / "sub" / "index.faiss").write_bytes(b"x" * 100)
    tmp_pointer = tmp_path / ".current.k2j3h4.tmp"
    tmp_pointer.write_text("20200101T000000000Z-00000000")
    fresh = tmp_path / ".history.json.zz.tmp"
    fresh.write_text("{}")
    for p in (trash, tmp_pointer):
        os.utime(p, (0, 0))
    removed = store.clean_staging(max_age_s=60)
    assert sorted(removed) == sorted([trash.name, tmp_pointer.name])
    assert (
        not trash.exists() and not tmp_pointer.exists() and fresh.exists() and (tmp_path / ".lock").exists()
    )
    assert fresh.name in store.clean_staging(max_age_s=0) and not fresh.exists()


def test_gc_removes_model_temp_files_left_by_a_killed_model_write(tmp_path, tiny_checkpoint, capsys):
    """A build or import killed while copying its encoder into models/ leaves models/.incoming-*: `index gc`
    removes it once older than --max-age-s (0: now), keeps a younger one (a write may be in flight) and
    never touches a stored model."""
    import os

    from index.cli import main

    store = IndexStore(tmp_path)
    store.ensure()
    sha = store.models.add_file(tiny_checkpoint)
    data = tiny_checkpoint.read_bytes()
    left = []
    for _ in range(2):  # what ModelStore.add_file has written when the kill comes: half the checkpoint
        tmp = store.models._tmp()
        tmp.write_bytes(data[: len(data) // 2])
        left.append(tmp)
    os.utime(left[0], (0, 0))
    capsys.readouterr()
    assert main(["gc", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"removed 1 stale staging entry: models/{left[0].name}"
    assert not left[0].exists() and left[1].exists()
    assert main(["gc", "--root", str(tmp_path), "--max-age-s", "0"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 1 stale staging entry: models/{left[1].name}"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f"{sha}.safetensors"]
    assert store.models.has(sha)
