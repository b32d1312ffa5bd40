"""The bounded normaliser's list statistics stored in the index version (index/list_stats.py,
index.build.write_version, IndexVersion.list_stats): equal to a fresh computation, checksummed,
refused when damaged or foreign, absent (None) in versions written before they were stored."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
from index_refs import unit_vectors

from index.build import write_version
from index.list_stats import ListStats
from index.manifest import IndexCorruptError, describe_files, file_sha256, read_manifest_json, write_manifest
from index.store import LIST_STATS_FILE, IndexStore

FIELDS = ("offsets", "order", "where", "means", "radius", "lam")


def _commit(store: IndexStore, n: int, d: int = 16, seed: int = 0, kind: str = "ivf-flat", **kw) -> str:
    emb = unit_vectors(n, d, seed)
    params = {"nlist": 16} if kind.startswith("ivf") else {}
    version, staging = write_version(
        store, emb, [f"r{seed}-{i}" for i in range(n)], kind=kind, params=params, target_recall=0.5, **kw
    )
    store.commit(staging, version)
    return version


@pytest.mark.parametrize("kind", ["ivf-flat", "flat"])
def test_stored_statistics_equal_a_fresh_computation(tmp_path, kind):
    store = IndexStore(tmp_path)
    version = _commit(store, 2000, kind=kind)
    loaded = store.load(version)
    m = loaded.manifest
    path = loaded.path / LIST_STATS_FILE
    assert m.files[LIST_STATS_FILE] == {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    stored = loaded.list_stats()
    # recomputed here from the stored rows and the stored index: the IVF's 16 lists, or k-means
    # with ~sqrt(2000) = 45 lists for a flat index (seeded)
    fresh = ListStats.build(np.asarray(loaded.embeddings), faiss.read_index(str(loaded.path / "index.faiss")))
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(stored, field), getattr(fresh, field))
    assert stored.source == fresh.source
    assert stored.lists == m.normaliser_stats["lists"] == (16 if kind == "ivf-flat" else 45)
    assert ("IVF" in stored.source) == (kind == "ivf-flat")
    assert m.normaliser_stats["partition"] == stored.source and "list_stats_s" in m.timings
    assert sorted(stored.order.tolist()) == list(range(2000))


def test_a_damaged_statistics_file_is_refused(tmp_path):
    store = IndexStore(tmp_path)
    version = _commit(store, 600)
    path = store.path(version) / LIST_STATS_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IndexCorruptError, match=LIST_STATS_FILE):  # the checksum, at load
        store.load(version)
    unverified = store.load(version, verify=False)
    with pytest.raises(IndexCorruptError, match=LIST_STATS_FILE):  # the zip member's CRC, at use
        unverified.list_stats()
    path.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(IndexCorruptError, match="cannot read"):
        store.load(version, verify=False).list_stats()


def test_statistics_of_another_version_are_refused_even_with_a_matching_checksum(tmp_path):
    store = IndexStore(tmp_path)
    small, big = _commit(store, 600, seed=1), _commit(store, 700, seed=2)
    target = store.path(small)
    (target / LIST_STATS_FILE).write_bytes((store.path(big) / LIST_STATS_FILE).read_bytes())
    manifest = read_manifest_json(target)
    manifest["files"].update(describe_files(target, [LIST_STATS_FILE]))  # as if written so
    write_manifest(target, manifest)
    with pytest.raises(
        IndexCorruptError, match="does not describe this version: 700 rows, the version has 600"
    ):
        store.load(small).list_stats()


def test_versions_written_before_the_statistics_have_none(tmp_path):
    store = IndexStore(tmp_path)
    version = _commit(store, 300)
    target = store.path(version)
    manifest = read_manifest_json(target)
    del manifest["files"][LIST_STATS_FILE], manifest["normaliser_stats"]
    write_manifest(target, manifest)
    (target / LIST_STATS_FILE).unlink()
    assert store.load(version).list_stats() is None
    one = _commit(store, 1, seed=3, kind="flat")  # one row: nothing to partition
    assert LIST_STATS_FILE not in store.manifest(one).files and store.load(one).list_stats() is None
