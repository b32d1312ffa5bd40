"""The index-kind registry (index/kinds/): a kind defined and registered here, in the test alone, is built,
gated and served end to end, and its answers are checked against a numpy brute force."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from index import kinds
from index.kinds.base import ID_BYTES
from index.kinds.ivf import IVFKind

N, DIM, K = 3000, 32, 10


class IVFSQ8(IVFKind):
    """Inverted lists of 8-bit scalar-quantised rows: a kind none of the project's modules name."""

    name = "toy-ivf-sq8"
    streamable = False
    gpu = False

    def factory(self, params: dict) -> str:
        return f"IVF{params['nlist']},SQ8"

    def bytes(self, dim: int, count: int, params: dict) -> int:
        return count * (dim + ID_BYTES) + params["nlist"] * dim * 4

    def matches(self, index) -> bool:
        return isinstance(index, faiss.IndexIVFScalarQuantizer)


@pytest.fixture
def toy_kind():
    kind = kinds.register(IVFSQ8())
    try:
        yield kind
    finally:
        kinds.unregister(kind.name)


def _unit(rng, n, d):
    centres = rng.standard_normal((40, d))
    x = centres[rng.integers(0, 40, n)] + 0.6 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_registry_refuses_duplicates_and_unknown_names(toy_kind):
    assert kinds.get(toy_kind.name) is toy_kind and toy_kind.name in kinds.names()
    with pytest.raises(ValueError, match="already registered"):
        kinds.register(IVFSQ8())
    with pytest.raises(ValueError, match="unknown index kind 'nope'"):
        kinds.get("nope")
    kinds.unregister(toy_kind.name)
    with pytest.raises(ValueError, match="unknown index kind"):
        kinds.get(toy_kind.name)
    kinds.register(toy_kind)  # back for the fixture's teardown


def test_builtin_kinds_recognise_their_own_indexes():
    from index import faiss_index

    x = _unit(np.random.default_rng(0), 2000, DIM)
    for name in kinds.names():
        index, _ = faiss_index.build(name, x)
        assert kinds.of_index(faiss.downcast_index(index)).name == name


def test_a_registered_kind_is_built_gated_and_served(toy_kind, tmp_path):
    from index.build import BuildOptions, build_from_vectors
    from index.gate import activation_checks
    from index.store import IndexStore
    from search.serving.searcher import Searcher

    rng = np.random.default_rng(3)
    emb = _unit(rng, N, DIM)
    np.save(tmp_path / "v.npy", emb)
    root = tmp_path / "index"
    target = 0.9
    version = build_from_vectors(
        tmp_path / "v.npy", root, BuildOptions(kind=toy_kind.name, target_recall=target, progress=False)
    )

    stored = IndexStore(root)
    assert stored.current_version() == version  # activated: the gate let it through
    loaded = stored.load(version)
    m = loaded.manifest
    assert m.kind == toy_kind.name and isinstance(
        faiss.downcast_index(loaded.index), faiss.IndexIVFScalarQuantizer
    )
    assert m.params["nprobe"] == faiss.extract_index_ivf(loaded.index).nprobe  # tuned knob applied on load
    assert m.recall.param == "nprobe" and m.recall.recall >= target
    checks = activation_checks(m)
    assert [c.passed for c in checks] == [True, True], [c.message for c in checks]

    searcher = Searcher(root, load=True)
    queries = _unit(rng, 50, DIM)
    answer = searcher.search_vectors(queries, K)
    exact = np.argsort(-(queries.astype(np.float64) @ emb.T.astype(np.float64)), axis=1)[:, :K]
    hits = 0
    for q, found, truth in zip(queries, answer, exact):
        rows = [h.row for h in found]
        assert len(rows) == K
        # the served similarity is the exact cosine of the stored row (re-scored from the stored vectors)
        np.testing.assert_allclose([h.similarity for h in found], emb[rows].astype(np.float64) @ q, atol=1e-5)
        hits += len(set(rows) & set(truth.tolist()))
    assert hits / (len(queries) * K) >= target - 0.05  # new queries, near the gate's target


def test_refusal_hints_come_from_each_kind():
    from index import faiss_index

    n, d = 5000, 32  # --kind auto chooses flat for 5000 x 32
    hints = {
        name: faiss_index.suggest_kind(name, faiss_index.default_params(name, d, n), n, d, 0.95)
        for name in kinds.names()
    }
    assert hints["flat"] == "--kind flat is exact"
    assert hints["ivf-flat"].endswith("--kind auto chooses flat")
    assert hints["ivf-pq"].startswith("--kind auto chooses flat for 5000 x 32")
    assert "--param M=64" in hints["hnsw"] and "--kind flat" in hints["hnsw"]
    large = faiss_index.suggest_kind(
        "ivf-pq", {"m": 8}, 2_000_000, 64, 0.95
    )  # auto: ivf-flat or ivf-pq (RAM)
    assert "--param m= a larger divisor of 64" in large
