"""POST /v1/search/vector at serving speed: concurrent queries batched into one exact pass, JSON (orjson)
and binary float32 bodies; every answer checked against a float64 brute force over the stored vectors."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

N, DIM = 3000, 32


@pytest.fixture(scope="module")
def vector_index(tmp_path_factory):
    """{root, emb, tau}: a flat version built from clustered unit vectors (no encoder)."""
    from index.build import BuildOptions, build_from_vectors
    from index.store import IndexStore

    base = tmp_path_factory.mktemp("vector_fast")
    rng = np.random.default_rng(11)
    centres = rng.standard_normal((30, DIM))
    emb = centres[rng.integers(0, 30, N)] + 0.5 * rng.standard_normal((N, DIM))
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)
    np.save(base / "v.npy", emb)
    build_from_vectors(base / "v.npy", base / "index", BuildOptions(kind="flat", force=True, progress=False))
    version = IndexStore(base / "index").load()
    return {
        "root": base / "index",
        "emb": np.asarray(version.embeddings),
        "tau": version.manifest.temperature,
    }


def _brute(emb: np.ndarray, vector: np.ndarray, tau: float, k: int):
    """(ids, similarities, probabilities) of the top k, float64 throughout."""
    x = vector.astype(np.float64) / np.linalg.norm(vector.astype(np.float64))
    s = emb.astype(np.float64) @ x
    log_z = np.logaddexp.reduce(s / tau)
    top = np.argsort(-s, kind="stable")[:k]
    return [str(i) for i in top], s[top], np.exp(s[top] / tau - log_z)


def _check(answer: dict, emb: np.ndarray, vector: np.ndarray, tau: float, k: int) -> None:
    ids, sims, probs = _brute(emb, vector, tau, k)
    got = answer["results"]
    assert len(got) == k
    np.testing.assert_allclose([h["similarity"] for h in got], sims, rtol=0, atol=1e-6)
    np.testing.assert_allclose([h["probability"] for h in got], probs, rtol=1e-5, atol=0)
    # the same rows, up to the order of items whose similarities tie within float32 rounding
    assert sum(h["id"] == i for h, i in zip(got, ids)) >= k - 2
    assert answer["normaliser"]["method"] == "exact"


def _app(root, **settings):
    from api.app import create_app
    from api.config import Settings

    return create_app(Settings(index_root=root, watch_interval_s=0, **settings))


def test_concurrent_json_and_binary_queries_share_passes_and_are_exact(vector_index):
    app = _app(vector_index["root"], batch_workers=1)
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((24, DIM)).astype(np.float32)
    ks = [int(k) for k in rng.integers(1, 20, 24)]

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            jobs = []
            for i, (v, k) in enumerate(zip(vectors, ks)):
                if i % 2:
                    jobs.append(
                        client.post(
                            f"/v1/search/vector?k={k}",
                            content=v.astype("<f4").tobytes(),
                            headers={"content-type": "application/octet-stream"},
                        )
                    )
                else:
                    jobs.append(client.post("/v1/search/vector", json={"vector": v.tolist(), "k": k}))
            return await asyncio.gather(*jobs)

    answers = asyncio.run(go())
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    bodies = [r.json() for r in answers]
    assert max(b["batch_size"] for b in bodies) > 1  # concurrent queries were batched
    for b, v, k in zip(bodies, vectors, ks):
        _check(b, vector_index["emb"], v, vector_index["tau"], k)


def test_binary_equals_json_and_query_string_fields(vector_index):
    from fastapi.testclient import TestClient

    v = np.random.default_rng(2).standard_normal(DIM).astype(np.float32)
    with TestClient(_app(vector_index["root"])) as client:
        as_json = client.post(
            "/v1/search/vector", json={"vector": v.tolist(), "k": 7, "temperature": 0.2, "offset": 2}
        )
        as_bin = client.post(
            "/v1/search/vector?k=7&temperature=0.2&offset=2",
            content=v.tobytes(),
            headers={"content-type": "application/octet-stream"},
        )
        assert as_json.status_code == as_bin.status_code == 200
        assert as_json.headers["content-type"] == "application/json"
        assert as_json.json() == as_bin.json()
        ids, _, probs = _brute(vector_index["emb"], v, 0.2, 9)
        assert [h["id"] for h in as_bin.json()["results"]] == ids[2:]
        np.testing.assert_allclose([h["probability"] for h in as_bin.json()["results"]], probs[2:], rtol=1e-5)
        # a JSON body's own field beats the query string's; the query string fills the rest
        r = client.post("/v1/search/vector?k=3&temperature=0.2", json={"vector": v.tolist(), "k": 4}).json()
        assert r["k"] == 4 and len(r["results"]) == 4 and r["temperature"] == 0.2


@pytest.mark.parametrize(
    "query, body, status, code",
    [
        ("k=3", b"\x00\x00\x80", 422, "bad_vector"),  # not a multiple of 4 bytes
        ("k=3", np.ones(DIM - 1, dtype="<f4").tobytes(), 422, "bad_vector"),  # wrong dimension
        ("k=3", np.full(DIM, np.nan, dtype="<f4").tobytes(), 422, "bad_vector"),
        ("k=3", np.zeros(DIM, dtype="<f4").tobytes(), 422, "bad_vector"),  # no direction
        ("k=3", b"", 422, "bad_vector"),
        ("k=0", np.ones(DIM, dtype="<f4").tobytes(), 422, "validation_error"),
        ("k=abc", np.ones(DIM, dtype="<f4").tobytes(), 422, "validation_error"),
        ("k=3&bogus=1", np.ones(DIM, dtype="<f4").tobytes(), 422, "validation_error"),
        ("k=100000", np.ones(DIM, dtype="<f4").tobytes(), 422, "k_out_of_range"),
    ],
)
def test_bad_binary_queries_are_4xx_json(vector_index, query, body, status, code):
    from fastapi.testclient import TestClient

    with TestClient(_app(vector_index["root"])) as client:
        r = client.post(
            f"/v1/search/vector?{query}", content=body, headers={"content-type": "application/octet-stream"}
        )
        assert r.status_code == status, r.text
        assert r.json()["error"] == code


def test_openapi_documents_both_bodies(vector_index):
    from fastapi.testclient import TestClient

    with TestClient(_app(vector_index["root"])) as client:
        op = client.get("/openapi.json").json()["paths"]["/v1/search/vector"]["post"]
    assert (
        op["requestBody"]["content"]["application/json"]["schema"]["properties"]["vector"]["minItems"] == DIM
    )
    assert "application/octet-stream" in op["description"] and "little-endian float32" in op["description"]


def test_batch_workers_auto_runs_one_batch_thread_for_a_version_built_from_vectors(vector_index, api_index):
    """`--batch-workers auto` (the default): one batch thread over a version with no encoder, two over
    one with an encoder (its forwards release the GIL); a number given is kept; bad values are refused."""
    from api.config import load_settings

    assert _app(vector_index["root"]).state.batcher.workers == 1
    assert _app(api_index["root"]).state.batcher.workers == 2
    assert _app(vector_index["root"], batch_workers=3).state.batcher.workers == 3
    assert load_settings({"batch_workers": "2"}, environ={}).batch_workers == 2
    for bad in ("0", "65", "two", "1.5"):
        with pytest.raises(ValueError, match="batch_workers"):
            load_settings({"batch_workers": bad}, environ={})


def test_batch_linger_auto_lingers_only_with_several_workers_over_a_vector_version(vector_index, api_index):
    """`--batch-linger-ms auto` (the default): 3 ms with --workers > 1 over a version with no encoder, 0 with
    one worker or an encoder; a number given is kept; bad values are refused."""
    from api.config import AUTO_LINGER_MS, load_settings

    assert _app(vector_index["root"]).state.batcher.linger == 0.0
    assert _app(vector_index["root"], workers=2).state.batcher.linger == AUTO_LINGER_MS / 1000 == 0.003
    assert _app(api_index["root"], workers=2).state.batcher.linger == 0.0
    assert _app(vector_index["root"], batch_linger_ms=2.5).state.batcher.linger == 0.0025
    assert load_settings({"batch_linger_ms": "4"}, environ={}).batch_linger_ms == 4.0
    assert load_settings({}, environ={"SOFTSEARCH_BATCH_LINGER_MS": "auto"}).batch_linger_ms == "auto"
    for bad in ("-1", "1001", "nan", "soon"):
        with pytest.raises(ValueError, match="batch_linger_ms"):
            load_settings({"batch_linger_ms": bad}, environ={})
