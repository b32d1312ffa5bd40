"""A version built from your own vectors, served: vector, item and batch search (with filters) against
numpy brute force; image routes answer 409 and thumbnails 404 (there is no encoder and no image)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import create_app
from api.client import SoftsearchClient, SoftsearchError
from api.config import Settings
from index.cli import main as index_main
from index.store import IndexStore

N, D = 2000, 24


@pytest.fixture(scope="module")
def vector_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("byo")
    rng = np.random.default_rng(11)
    centres = rng.normal(size=(30, D))
    x = centres[rng.integers(0, 30, N)] + 0.4 * rng.normal(size=(N, D))
    shards = tmp / "vectors"
    shards.mkdir()
    np.save(shards / "000.npy", x[:1200].astype(np.float16))
    np.save(shards / "001.npy", x[1200:].astype(np.float32))
    with open(tmp / "meta.jsonl", "w") as fh:
        for i in range(N):
            fh.write(json.dumps({"id": str(i), "shard": "a" if i < 1200 else "b", "score": i % 10}) + "\n")
    root = tmp / "store"
    assert (
        index_main(
            [
                "build",
                "--root",
                str(root),
                "--no-progress",
                "--embeddings",
                str(shards),
                "--metadata",
                str(tmp / "meta.jsonl"),
            ]
        )
        == 0
    )
    version = IndexStore(root).load()
    return {"root": root, "z": np.asarray(version.embeddings, np.float64), "version": version.version}


@pytest.fixture(scope="module")
def ss(vector_store):
    with TestClient(create_app(Settings(index_root=vector_store["root"]))) as http:
        yield SoftsearchClient(http=http), http


def _exact(z, q, rows, tau):
    """Brute force over `rows`: similarity order and softmax over exactly those rows (float64)."""
    s = z[rows] @ (q / np.linalg.norm(q))
    p = np.exp(s / tau - np.logaddexp.reduce(s / tau))
    order = np.argsort(-s, kind="stable")
    return rows[order], s[order], p[order]


def test_vector_search_is_exact_search_with_exact_probabilities(ss, vector_store):
    client, _ = ss
    z = vector_store["z"]
    q = np.random.default_rng(0).normal(size=D)
    answer = client.search_vector(q.tolist(), k=10, temperature=0.05)
    rows, s, p = _exact(z, q, np.arange(N), 0.05)
    assert [h.row for h in answer.results] == rows[:10].tolist()
    assert [h.id for h in answer.results] == [str(r) for r in rows[:10]]  # ids default to the row number
    np.testing.assert_allclose([h.similarity for h in answer.results], s[:10], atol=1e-5)
    np.testing.assert_allclose([h.probability for h in answer.results], p[:10], rtol=1e-4)


def test_filters_item_and_batch_routes(ss, vector_store):
    client, _ = ss
    z = vector_store["z"]
    q = np.random.default_rng(1).normal(size=D)
    answer = client.search_vector(
        q.tolist(), k=5, temperature=0.1, filter={"shard": "b", "score": {"gte": 5}}
    )
    rows = np.array([i for i in range(1200, N) if i % 10 >= 5])
    want, _, p = _exact(z, q, rows, 0.1)
    assert [h.row for h in answer.results] == want[:5].tolist() and answer.matched == len(rows)
    np.testing.assert_allclose([h.probability for h in answer.results], p[:5], rtol=1e-4)
    item = client.search_item("7", k=5)
    exact = [r for r in np.argsort(-(z @ z[7]), kind="stable") if r != 7][:5]
    assert item.self_rank == 1 and [h.row for h in item.results] == exact
    batch = client.search_batch(vectors=[q.tolist(), z[3].tolist()], k=3)
    assert [h.row for h in batch[0].results] == _exact(z, q, np.arange(N), 0.1)[0][:3].tolist()
    assert batch[1].results[0].row == 3
    meta = client.item("1500")
    assert meta.fields == {"shard": "b", "score": 0}


def test_image_routes_answer_409_and_thumbnails_404(ss, vector_store):
    client, http = ss
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, format="PNG")
    png = buf.getvalue()
    for call in (lambda: client.search_image(png, k=3), lambda: client.search_batch(images=[png, png], k=3)):
        with pytest.raises(SoftsearchError) as err:
            call()
        assert err.value.status == 409 and err.value.code == "no_encoder"
        assert "this index version has no encoder: search it with vectors" in err.value.detail
    r = http.get("/v1/items/12/thumbnail")
    assert r.status_code == 404 and r.json()["error"] == "image_unavailable"
    assert http.get("/readyz").status_code == 200


def test_swaps_between_an_image_version_and_a_vector_version(tmp_path):
    """Same store, same dimension: an image-encoder version, then one built from vectors (gated by its recall
    check, the image evaluator never called), then a rollback. The searcher drops and reloads the encoder
    with each swap; vector answers match brute force on the version being served."""
    from api_helpers import make_checkpoint

    from index.build import BuildOptions, build_index
    from search.evaluation.quality import evaluate_version
    from search.serving.searcher import NoEncoderError, Searcher
    from training.datasets import create_dataset

    root = tmp_path / "store"
    ds = create_dataset("synthetic", split="train", size=64, seed=0)
    v1 = build_index(
        make_checkpoint(tmp_path / "enc.safetensors", seed=3), ds, root, BuildOptions(progress=False)
    )
    searcher = Searcher(root, load=True)
    image = Image.new("RGB", (32, 32), (10, 200, 30))
    assert len(searcher.search_images([image], 3)[0]) == 3
    x = np.random.default_rng(4).normal(size=(500, 16))
    np.save(tmp_path / "v.npy", x)
    assert (
        index_main(
            ["build", "--root", str(root), "--no-progress", "--embeddings", str(tmp_path / "v.npy")],
            evaluator=evaluate_version,
        )
        == 0
    )  # the image evaluator cannot score it: skipped, not failed
    store = IndexStore(root)
    v2 = store.current_version()
    gate = store.manifest(v2).quality_gate.to_json()
    assert (
        v2 != v1 and gate["passed"] and gate["serving_version"] == v1 and "recall check only" in gate["note"]
    )
    result = searcher.reload()
    assert result.version == v2 and searcher.snapshot().encoder is None
    with pytest.raises(NoEncoderError, match="search it with vectors"):
        searcher.search_images([image], 3)
    z = x / np.linalg.norm(x, axis=1, keepdims=True)
    q = np.random.default_rng(5).normal(size=16)
    rows, _, _ = _exact(z, q, np.arange(500), 0.1)
    assert [h.row for h in searcher.search_vectors(q[None, :], 5)[0]] == rows[:5].tolist()
    assert index_main(["rollback", "--root", str(root)]) == 0
    result = searcher.reload()
    assert result.version == v1 and result.encoder_reloaded and searcher.snapshot().encoder is not None
    assert len(searcher.search_images([image], 3)[0]) == 3
    # vectors from elsewhere are not appended to an image-encoder version (two embedding spaces)
    assert index_main(["add", "--root", str(root), "--embeddings", str(tmp_path / "v.npy")]) == 2
