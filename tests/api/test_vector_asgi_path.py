"""POST /v1/search/vector through the raw ASGI path (api/vector_path.py) against the FastAPI route: the same
bytes for good queries, the same 4xx bodies for bad ones, the same metrics, batching and deadlines."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

N, DIM = 2000, 24


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A flat version built from clustered unit vectors (no encoder)."""
    from index.build import BuildOptions, build_from_vectors

    base = tmp_path_factory.mktemp("vector_asgi")
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((20, DIM))
    emb = centres[rng.integers(0, 20, N)] + 0.5 * rng.standard_normal((N, DIM))
    emb = (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)
    np.save(base / "v.npy", emb)
    build_from_vectors(base / "v.npy", base / "index", BuildOptions(kind="flat", force=True, progress=False))
    return base / "index"


def _app(root, raw: bool, **settings):
    from api.app import create_app
    from api.config import Settings

    app = create_app(Settings(index_root=root, watch_interval_s=0, **settings))
    app.state.vector_path.enabled = raw and app.state.vector_path.enabled
    return app


_V = np.random.default_rng(9).standard_normal((4, DIM)).astype(np.float32)
JSON = "application/json"
OCTET = "application/octet-stream"

# (query string, content type, body): every field, both bodies, the query string merged into JSON
GOOD = [
    ("", JSON, json.dumps({"vector": _V[0].tolist()}).encode()),
    ("", JSON, json.dumps({"vector": _V[1].tolist(), "k": 7, "temperature": 0.2, "offset": 2}).encode()),
    ("", JSON, json.dumps({"vector": _V[2].tolist(), "k": 20, "min_probability": 0.01}).encode()),
    ("", JSON, json.dumps({"vector": _V[3].tolist(), "k": 30, "mass": 0.5}).encode()),
    ("", "application/json; charset=utf-8", json.dumps({"vector": (_V[0] * 7).tolist(), "k": 3}).encode()),
    ("k=3&temperature=0.3", JSON, json.dumps({"vector": _V[1].tolist(), "k": 5}).encode()),
    ("k=10", OCTET, _V[2].astype("<f4").tobytes()),
    ("", OCTET, _V[3].astype("<f4").tobytes()),
    ("k=4&temperature=0.5&offset=1&mass=0.9", OCTET, _V[0].astype("<f4").tobytes()),
    ("", JSON, json.dumps({"vector": _V[0].tolist(), "unknown_field": 1}).encode()),  # ignored by both
    ("filter=null", JSON, json.dumps({"vector": _V[1].tolist(), "k": 2}).encode()),
    ("", JSON, json.dumps({"vector": [int(v > 0) - 0.5 for v in _V[2]], "k": 2, "filter": None}).encode()),
]

BAD = [
    ("", JSON, b'{"vector": [0.1, 0.2'),  # malformed: 400
    ("", JSON, ('{"vector": [NaN' + ", 0.1" * (DIM - 1) + "]}").encode()),  # non-finite literal
    ("", JSON, b""),  # no body
    ("", JSON, json.dumps({"vector": _V[0][:-1].tolist()}).encode()),  # wrong dimension
    ("", JSON, json.dumps({"vector": [0.0] * DIM}).encode()),  # zero norm
    ("", JSON, json.dumps({"vector": [1e300] * DIM}).encode()),  # beyond float32
    ("", JSON, json.dumps({"vector": _V[0].tolist(), "k": 0}).encode()),
    ("", JSON, json.dumps({"vector": _V[0].tolist(), "k": 101}).encode()),  # over max_k
    ("", JSON, json.dumps({"vector": _V[0].tolist(), "offset": 500}).encode()),
    ("", JSON, json.dumps({"vector": _V[0].tolist(), "temperature": -1}).encode()),
    ("", JSON, json.dumps({"vector": _V[0].tolist(), "filter": {"class": "cat"}}).encode()),  # no field
    ("", JSON, json.dumps([1, 2, 3]).encode()),
    ("", "text/plain", b"vector=1"),  # 415
    ("", "", b"{}"),  # no content type: 415
    ("k=3", OCTET, b"\x00\x00\x80"),  # not a multiple of 4 bytes
    ("k=3", OCTET, np.ones(DIM - 1, dtype="<f4").tobytes()),
    ("k=3", OCTET, np.full(DIM, np.nan, dtype="<f4").tobytes()),
    ("k=abc", OCTET, _V[0].astype("<f4").tobytes()),
    ("k=3&bogus=1", OCTET, _V[0].astype("<f4").tobytes()),
    ("filter=%7B%7D&filter=%7B%7D", OCTET, _V[0].astype("<f4").tobytes()),  # filter twice
    ("filter=%7Bnot%20json", OCTET, _V[0].astype("<f4").tobytes()),
    ("k=3", JSON, b'{"vector": "abc"}'),
]


def _post(client, query: str, media: str, body: bytes):
    headers = {"content-type": media} if media else {}
    return client.post("/v1/search/vector" + (f"?{query}" if query else ""), content=body, headers=headers)


def _answers(root, raw: bool, cases) -> tuple[list, dict]:
    app = _app(root, raw)
    with TestClient(app) as client:
        out = [_post(client, *case) for case in cases]
        metrics = client.get("/metrics").text
    state = app.state.vector_path
    return out, {"answered": state.answered, "handed_over": state.handed_over, "metrics": metrics}


def _sample(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_good_queries_get_the_routes_bytes(root):
    raw, raw_state = _answers(root, True, GOOD)
    route, route_state = _answers(root, False, GOOD)
    assert raw_state["answered"] == len(GOOD) and raw_state["handed_over"] == 0
    assert route_state["answered"] == 0
    for a, b in zip(raw, route):
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.content == b.content  # byte for byte
        assert a.headers["content-type"] == b.headers["content-type"] == JSON
        assert a.headers["content-length"] == b.headers["content-length"]
    # the numbers themselves, against a float64 brute force over the stored rows
    from index.store import IndexStore

    version = IndexStore(root).load()
    emb, tau = np.asarray(version.embeddings, dtype=np.float64), version.manifest.temperature
    body = raw[0].json()
    x = _V[0].astype(np.float64) / np.linalg.norm(_V[0].astype(np.float64))
    s = emb @ x
    log_z = np.logaddexp.reduce(s / tau)
    top = np.argsort(-s, kind="stable")[:10]
    assert [h["row"] for h in body["results"]] == top.tolist()
    probs = [h["probability"] for h in body["results"]]
    np.testing.assert_allclose(probs, np.exp(s[top] / tau - log_z), 1e-5)
    assert body["log_normaliser"] == pytest.approx(log_z, abs=1e-5)
    # the same counts in the metrics: requests by route and status, latency, queries
    for state in (raw_state, route_state):
        m = state["metrics"]
        assert _sample(
            m, "softsearch_http_requests_total", route="/v1/search/vector", method="POST", status="200"
        ) == len(GOOD)
        assert _sample(
            m, "softsearch_http_request_duration_seconds_count", route="/v1/search/vector", method="POST"
        ) == len(GOOD)
        assert _sample(m, "softsearch_queries_total", kind="vector") == len(GOOD)


def test_bad_queries_get_the_routes_errors(root):
    raw, raw_state = _answers(root, True, BAD)
    route, _ = _answers(root, False, BAD)
    assert raw_state["answered"] == 0
    for case, a, b in zip(BAD, raw, route):
        assert 400 <= a.status_code < 500, (case, a.text)
        assert (a.status_code, a.content) == (b.status_code, b.content), case
        assert a.headers["content-type"] == JSON
    assert _sample(raw_state["metrics"], "softsearch_queries_total", kind="vector") == 0
    statuses = {str(a.status_code) for a in raw}
    for status in statuses:  # each error counted once, by the app's own metrics middleware
        assert _sample(
            raw_state["metrics"],
            "softsearch_http_requests_total",
            route="/v1/search/vector",
            method="POST",
            status=status,
        ) == sum(str(a.status_code) == status for a in raw)


def test_too_large_and_not_ready_are_answered_by_the_app(root, tmp_path):
    from api.app import create_app
    from api.config import Settings

    body = json.dumps({"vector": _V[0].tolist()}).encode()
    for raw in (True, False):
        app = _app(root, raw, max_upload_bytes=1024)
        with TestClient(app) as client:
            big = _post(client, "", JSON, b" " * (80 * 1024) + body)
            assert big.status_code == 413 and big.json()["error"] == "upload_too_large"
        empty = create_app(Settings(index_root=tmp_path / "nothing", watch_interval_s=0))
        empty.state.vector_path.enabled = raw
        with TestClient(empty) as client:
            r = _post(client, "", JSON, body)
            assert r.status_code == 503 and r.json()["error"] == "not_ready"


def test_concurrent_queries_on_the_raw_path_are_batched(root):
    app = _app(root, True, batch_workers=1)
    vectors = np.random.default_rng(4).standard_normal((24, DIM)).astype(np.float32)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                jobs = [
                    client.post(
                        "/v1/search/vector?k=5",
                        content=v.astype("<f4").tobytes(),
                        headers={"content-type": OCTET},
                    )
                    for v in vectors
                ]
                return await asyncio.gather(*jobs)

    answers = asyncio.run(go())
    assert all(r.status_code == 200 for r in answers)
    assert app.state.vector_path.answered == len(vectors)
    assert max(r.json()["batch_size"] for r in answers) > 1  # the batcher saw them together
    single = _answers(root, False, [("k=5", OCTET, v.astype("<f4").tobytes()) for v in vectors[:3]])[0]
    for a, b in zip(answers[:3], single):  # a batched answer's numbers are the lone route's
        got, want = a.json(), b.json()
        assert [h["id"] for h in got["results"]] == [h["id"] for h in want["results"]]
        np.testing.assert_allclose(
            [h["probability"] for h in got["results"]], [h["probability"] for h in want["results"]], 1e-6
        )


def test_a_stalled_body_gets_the_same_408(root):
    """Half a body and then nothing: the raw path answers 408 at the body deadline, as the app would."""

    async def stalled(app) -> list[dict]:
        sent: list[dict] = []
        first = [{"type": "http.request", "body": b'{"vector": [', "more_body": True}]

        async def receive():
            if first:
                return first.pop()
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/search/vector",
            "raw_path": b"/v1/search/vector",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"999")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), 20)
        return sent

    raw_app, route_app = _app(root, True, body_timeout_s=0.3), _app(root, False, body_timeout_s=0.3)
    raw, route = asyncio.run(stalled(raw_app)), asyncio.run(stalled(route_app))
    assert raw[0]["status"] == route[0]["status"] == 408
    assert raw == route
    assert raw_app.state.vector_path.answered == 0 and route_app.state.vector_path.answered == 0
    assert (
        raw_app.state.metrics.sample(
            "softsearch_http_requests_total", route="/v1/search/vector", method="POST", status="408"
        )
        == 1
    )


def test_rate_limit_keeps_every_request_on_the_full_app(root):
    app = _app(root, True, rate_limit_rps=0.001, rate_limit_burst=1)
    assert not app.state.vector_path.enabled  # create_app switched it off
    app = _app(root, False, rate_limit_rps=0.001, rate_limit_burst=1)
    with TestClient(app) as client:
        body = _V[0].astype("<f4").tobytes()
        assert _post(client, "k=3", OCTET, body).status_code == 200
        r = _post(client, "k=3", OCTET, body)
        assert r.status_code == 429 and r.json()["error"] == "rate_limited"
