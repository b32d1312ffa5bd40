"""The streamed build (index/stream.py) against the in-RAM build, numpy brute force and ListStats.build."""

from __future__ import annotations

import shutil
import tracemalloc

import faiss
import numpy as np
import pytest

from index import faiss_index, stream
from index.build import BuildOptions, add_vectors, build_from_vectors
from index.list_stats import ListStats
from index.paging import PagedRows, drop_index_pages, read_rows
from index.store import IVFDATA_FILE, LIST_STATS_FILE, IndexStore
from index.vectors import open_vectors, unit_rows


def _clustered(n: int, d: int, seed: int = 0, clusters: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d))
    return (centres[rng.integers(0, clusters, n)] + 0.4 * rng.standard_normal((n, d))).astype(np.float32)


def _shards(tmp_path, x: np.ndarray, sizes) -> open_vectors:
    """A directory source of uneven shards (float32 and float64 alternating)."""
    d = tmp_path / "shards"
    d.mkdir()
    start = 0
    for i, size in enumerate(sizes):
        np.save(d / f"part-{i:02d}.npy", x[start : start + size].astype(np.float64 if i % 2 else np.float32))
        start += size
    assert start == len(x)
    return open_vectors(d)


def _lists(index) -> list[np.ndarray]:
    ivf = faiss.extract_index_ivf(index)
    inv = ivf.invlists
    return [faiss.rev_swig_ptr(inv.get_ids(l), inv.list_size(l)).copy() for l in range(ivf.nlist)]


def _codes(index) -> list[bytes]:
    ivf = faiss.extract_index_ivf(index)
    inv = ivf.invlists
    return [
        bytes(faiss.rev_swig_ptr(inv.get_codes(l), inv.list_size(l) * ivf.code_size))
        for l in range(ivf.nlist)
    ]


@pytest.mark.parametrize("kind", ["ivf-flat", "ivf-pq"])
def test_streamed_lists_equal_the_in_ram_build(tmp_path, kind):
    """Same rows, same trained quantizer: every list holds the same rows, in the same order, with the same
    codes as FAISS's own add() in RAM, although the rows came in chunks of 700 across uneven shards."""
    x = _clustered(6000, 32)
    source = _shards(tmp_path, x, [1000, 2500, 7, 2493])
    staging = tmp_path / "v"
    staging.mkdir()
    built = stream.build_streamed(source, staging, kind, {"nlist": 24}, chunk_rows=700)
    z = unit_rows(source)
    assert built.train_rows == len(z)  # a sample of all rows: the reference trains on the same points
    np.testing.assert_array_equal(np.load(staging / "embeddings.npy"), z)
    ref, _ = faiss_index.create_index(kind, 32, len(z), **built.params)
    ref.train(z)
    ref.add(z)
    assert faiss_index.on_disk_lists(built.index) and not faiss_index.on_disk_lists(ref)
    for ours, theirs in zip(_lists(built.index), _lists(ref)):
        np.testing.assert_array_equal(ours, theirs)
    assert _codes(built.index) == _codes(ref)
    q = z[::97]
    for nprobe in (1, 4, 24):
        faiss.extract_index_ivf(built.index).nprobe = faiss.extract_index_ivf(ref).nprobe = nprobe
        np.testing.assert_array_equal(
            faiss_index.search(built.index, q, 10)[1], faiss_index.search(ref, q, 10)[1]
        )


def test_streamed_recall_equals_in_ram_build_when_trained_on_a_sample(tmp_path, monkeypatch):
    """With a training sample smaller than N the streamed build's served recall is that of the in-RAM build
    trained on the same sample (the served search: IVF-PQ re-ranked from the stored rows)."""
    monkeypatch.setattr(stream, "TRAIN_BYTES", 4000 * 4 * 16)  # 4000 of 12000 rows
    x = _clustered(12000, 16, seed=1)
    np.save(tmp_path / "x.npy", x)
    source = open_vectors(tmp_path / "x.npy")
    staging = tmp_path / "v"
    staging.mkdir()
    built = stream.build_streamed(source, staging, "ivf-pq", {"m": 8, "nbits": 5}, seed=3, chunk_rows=1000)
    assert built.train_rows == 4000 and built.params["nlist"] == 4000 // 39
    z = unit_rows(source)
    rows = np.sort(np.random.default_rng(3).choice(len(z), size=4000, replace=False))
    ref, _ = faiss_index.create_index("ivf-pq", 16, len(z), **built.params)
    faiss_index.allow_small_training(ref, "ivf-pq", 4000)
    ref.train(z[rows])
    ref.add(z)
    q = z[np.random.default_rng(9).choice(len(z), 300, replace=False)]
    exact = np.argsort(-(q @ z.T), axis=1)[:, :10]
    for index in (built.index, ref):
        faiss.extract_index_ivf(index).nprobe = 8
    ours = faiss_index.recall_at_k(faiss_index.search_reranked(built.index, z, q, 10, 8)[1], exact)
    theirs = faiss_index.recall_at_k(faiss_index.search_reranked(ref, z, q, 10, 8)[1], exact)
    assert ours == pytest.approx(theirs, abs=0.01)
    assert ours > 0.8


def test_ivf_flat_at_nprobe_nlist_is_brute_force(tmp_path):
    x = _clustered(3000, 24, seed=2)
    np.save(tmp_path / "x.npy", x)
    staging = tmp_path / "v"
    staging.mkdir()
    built = stream.build_streamed(
        open_vectors(tmp_path / "x.npy"), staging, "ivf-flat", {"nlist": 16}, chunk_rows=256
    )
    z = x / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    faiss.extract_index_ivf(built.index).nprobe = 16
    q = z[:50].astype(np.float32)
    scores, rows = faiss_index.search(built.index, q, 10)
    exact = np.argsort(-(q.astype(np.float64) @ z.T), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(rows, exact)
    np.testing.assert_allclose(
        scores, np.take_along_axis(q.astype(np.float64) @ z.T, exact, axis=1), atol=1e-5
    )


def test_list_statistics_equal_the_in_ram_computation(tmp_path, monkeypatch):
    """normaliser_stats.npz written in the streamed passes equals ListStats.build over the same lists
    (partition exactly; means, radii, eigenvalues to float rounding), also when the scatter matrices
    take several passes."""
    monkeypatch.setattr(stream, "SCATTER_BYTES", 5 * 16 * 16 * 8)  # 5 lists a pass
    x = _clustered(4000, 16, seed=4)
    np.save(tmp_path / "x.npy", x)
    staging = tmp_path / "v"
    staging.mkdir()
    built = stream.build_streamed(
        open_vectors(tmp_path / "x.npy"), staging, "ivf-pq", {"nlist": 23, "m": 4}, chunk_rows=333
    )
    ours = ListStats.load(staging / LIST_STATS_FILE)
    ref = ListStats.build(np.load(staging / "embeddings.npy"), built.index)
    assert ours.source == ref.source and ours.problems(4000, 16, built.index) == []
    np.testing.assert_array_equal(ours.offsets, ref.offsets)
    np.testing.assert_array_equal(ours.order, ref.order)
    np.testing.assert_allclose(ours.means, ref.means, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours.radius, ref.radius, rtol=1e-9)
    np.testing.assert_allclose(ours.lam, ref.lam, rtol=1e-8)


def test_build_reads_the_rows_chunk_wise(tmp_path, monkeypatch):
    """Peak Python-allocated memory (numpy buffers, tracemalloc) of a streamed build stays a few chunks, far
    below the N x D rows, and every read of the source is a slice of at most one chunk."""
    monkeypatch.setattr(stream, "TRAIN_BYTES", 2000 * 4 * 32)
    n, d, chunk = 150000, 32, 2000
    np.save(tmp_path / "x.npy", _clustered(n, d, seed=5).astype(np.float64))  # 38 MB float64
    source = open_vectors(tmp_path / "x.npy")

    from index import paging

    largest = []
    read_rows = paging.read_rows

    def counting(array, rows):  # every read of the rows goes through paging.read_rows (pread)
        largest.append(len(np.asarray(rows).reshape(-1)))
        return read_rows(array, rows)

    monkeypatch.setattr(paging, "read_rows", counting)
    staging = tmp_path / "v"
    staging.mkdir()
    tracemalloc.start()
    try:
        stream.build_streamed(source, staging, "ivf-flat", chunk_rows=chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    full = n * d * 4
    assert max(largest) == chunk and sum(largest) >= 2 * n  # chunks only (two passes and more)
    assert peak < full / 4, f"peak {peak} B traced vs {full} B of float32 rows"


def test_streamed_version_serves_moves_and_accepts_additions(tmp_path):
    x = _clustered(5000, 16, seed=6)
    np.save(tmp_path / "x.npy", x)
    root = tmp_path / "store"
    version = build_from_vectors(tmp_path / "x.npy", root, BuildOptions(kind="ivf-pq", progress=False))
    store = IndexStore(root)
    loaded = store.load(version, verify=True, gpu=False)
    m = loaded.manifest
    assert m.build["streamed"] and IVFDATA_FILE in m.files and LIST_STATS_FILE in m.files
    assert loaded.ids[:3] == ["0", "1", "2"] and len(loaded.ids) == 5000
    assert faiss_index.on_disk_lists(loaded.index)
    assert m.quality_gate.passed and m.recall.reached
    z = unit_rows(open_vectors(tmp_path / "x.npy"))
    q = z[:20]
    served = faiss_index.search_reranked(loaded.index, loaded.embeddings, q, 10, m.params["rerank"])

    # self-contained: the store moved elsewhere (the original gone) loads and answers the same; the lists are
    # mapped from beside the moved index file (export refuses versions without an encoder, index/transfer.py)
    other = tmp_path / "moved"
    shutil.copytree(root, other)
    shutil.rmtree(root)
    again = IndexStore(other).load(version, verify=True, gpu=False)
    assert faiss_index.on_disk_lists(again.index)
    assert str(other) in faiss.downcast_InvertedLists(faiss.extract_index_ivf(again.index).invlists).filename
    moved = faiss_index.search_reranked(again.index, again.embeddings, q, 10, m.params["rerank"])
    np.testing.assert_array_equal(moved[1], served[1])
    assert again.list_stats().lists == m.params["nlist"]
    root, store = other, IndexStore(other)

    # index add --embeddings: the on-disk lists are copied into RAM and extended (the new version is in RAM)
    extra = _clustered(500, 16, seed=7)
    np.save(tmp_path / "extra.npy", extra)
    added = add_vectors(root, tmp_path / "extra.npy", progress=False)
    grown = store.load(added, verify=True, gpu=False)
    assert len(grown) == 5500 and not faiss_index.on_disk_lists(grown.index)
    ivf = faiss.extract_index_ivf(grown.index)
    ivf.nprobe = ivf.nlist
    all_z = np.concatenate([z, unit_rows(open_vectors(tmp_path / "extra.npy"))])
    _, rows = faiss_index.search_reranked(grown.index, all_z, all_z[-5:], 5, 64)
    np.testing.assert_array_equal(rows, np.argsort(-(all_z[-5:] @ all_z.T), axis=1)[:, :5])


def test_paging_helpers_return_the_same_rows(tmp_path):
    x = _clustered(3000, 8, seed=8)
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    idx = np.array([5, 2999, 0, 5, 6, 7, -1])
    np.testing.assert_array_equal(PagedRows(mapped)[idx], x[idx])
    np.testing.assert_array_equal(PagedRows(mapped)[10:20], x[10:20])
    np.testing.assert_array_equal(read_rows(mapped, idx), x[idx])
    np.testing.assert_array_equal(read_rows(mapped[1:], [0, 4]), x[[1, 5]])  # a view: read through the map
    np.testing.assert_array_equal(read_rows(x, [2, 1]), x[[2, 1]])  # in RAM
    with pytest.raises(IndexError):
        read_rows(mapped, [3000])
    # the index's lists are still readable after their pages were dropped
    staging = tmp_path / "v"
    staging.mkdir()
    built = stream.build_streamed(open_vectors(tmp_path / "x.npy"), staging, "ivf-flat", {"nlist": 8})
    before = faiss_index.search(built.index, x[:7] / np.linalg.norm(x[:7], axis=1, keepdims=True), 5)
    drop_index_pages(built.index)
    after = faiss_index.search(built.index, x[:7] / np.linalg.norm(x[:7], axis=1, keepdims=True), 5)
    np.testing.assert_array_equal(before[1], after[1])
    exact = faiss_index.exact_neighbours(mapped, x[:7], 5, block_rows=500)  # blocked: 6 blocks merged
    np.testing.assert_array_equal(exact, faiss_index.exact_neighbours(np.array(x), x[:7], 5))


def test_streamed_params_keep_the_sample_bounded():
    params, train = stream.streamed_params("ivf-pq", 30_000_000, 64)
    assert train == stream.TRAIN_BYTES // (4 * 64) and params["nlist"] == train // 39
    small, train_small = stream.streamed_params("ivf-flat", 5000, 64)
    assert train_small == 5000 and small["nlist"] == faiss_index.default_nlist(5000)
    given, train_given = stream.streamed_params("ivf-flat", 10_000_000, 64, {"nlist": 10000})
    assert given["nlist"] == 10000 and train_given == 390_000
