"""HTTP API round trip against a real small index, every bad input -> its 4xx, admin auth,
rate limiting, readiness, metrics format and micro-batching."""

from __future__ import annotations

import io
import math
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from api_helpers import ADMIN_TOKEN, INDEX_SIZE, png_bytes
from fastapi.testclient import TestClient
from PIL import Image

from api.app import create_app
from api.config import Settings, load_settings
from index.build import BuildOptions, build_index
from index.store import IndexStore
from training.checkpoint import load_checkpoint
from training.encoder import embed
from training.transforms import preprocess


def _reference(api_index, images, tau=None):
    """Independent brute force: load encoder + stored embeddings, dense softmax over all items."""
    version = IndexStore(api_index["root"]).load(api_index["version"])
    enc, _ = load_checkpoint(api_index["checkpoint"])
    z = embed(enc, preprocess(images, enc.image_size), progress=False).astype(np.float64)
    s = z @ version.embeddings.astype(np.float64).T  # (Q, N)
    tau = tau or version.manifest.search_temperature
    logits = s / tau
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    return version, s, np.exp(logp), z


def _post_image(client, data: bytes, k=5, temperature=None, name="q.png", ctype="image/png"):
    form = {"k": str(k)}
    if temperature is not None:
        form["temperature"] = str(temperature)
    return client.post("/v1/search", files={"file": (name, data, ctype)}, data=form)


def test_image_round_trip_matches_brute_force(client, api_index, api_dataset):
    i = 17
    r = _post_image(client, png_bytes(api_dataset.image(i)), k=7)
    assert r.status_code == 200, r.text
    body = r.json()
    version, s, p, _ = _reference(api_index, [api_dataset.image(i)])
    assert body["version"] == api_index["version"] and body["count"] == INDEX_SIZE and body["k"] == 7
    top = np.argsort(-s[0], kind="stable")[:7]
    assert [h["id"] for h in body["results"]] == [version.ids[j] for j in top]
    assert body["results"][0]["id"] == api_dataset.item_id(i)  # the uploaded item finds itself
    np.testing.assert_allclose([h["similarity"] for h in body["results"]], s[0, top], atol=1e-5)
    np.testing.assert_allclose([h["probability"] for h in body["results"]], p[0, top], rtol=1e-4)
    # response is self-consistent: p = exp(s / tau - log Z)
    for h in body["results"]:
        assert h["probability"] == pytest.approx(
            math.exp(h["similarity"] / body["temperature"] - body["log_normaliser"]), rel=1e-6
        )


def test_vector_round_trip_and_temperature(client, api_index, api_dataset):
    _, s, p, z = _reference(api_index, [api_dataset.image(3)], tau=0.5)
    r = client.post("/v1/search/vector", json={"vector": (z[0] * 3.0).tolist(), "k": 4, "temperature": 0.5})
    assert r.status_code == 200, r.text
    body = r.json()
    top = np.argsort(-s[0], kind="stable")[:4]
    assert [h["row"] for h in body["results"]] == top.tolist()  # scaling the vector changes nothing
    np.testing.assert_allclose([h["probability"] for h in body["results"]], p[0, top], rtol=1e-4)
    assert body["temperature"] == 0.5
    # peakedness against the dense reference: top-1 vs uniform, and the exp(H) bound from the top-4 holds
    peak, full = body["peakedness"], p[0]
    assert peak["top1_vs_uniform"] == pytest.approx(full.max() * full.size, rel=1e-4)
    assert peak["topk_mass"] == pytest.approx(full[top].sum(), rel=1e-4)
    assert peak["effective_candidates_at_most"] >= np.exp(-(full * np.log(full)).sum()) * (1 - 1e-4)
    assert peak["near_uniform"] == (full.max() * full.size < 2)


def test_index_items_health_and_page(client, api_index, api_dataset):
    assert client.get("/healthz").json() == {"status": "ok", "version": api_index["version"]}
    assert client.get("/readyz").json()["version"] == api_index["version"]
    idx = client.get("/v1/index").json()
    assert idx["count"] == INDEX_SIZE and idx["dim"] == 16
    assert idx["manifest"]["checkpoint"]["path"] == str(api_index["checkpoint"].resolve())
    sample = client.get("/v1/items", params={"n": 5, "seed": 1}).json()
    assert len(sample["items"]) == 5 and len({it["id"] for it in sample["items"]}) == 5
    item_id = api_dataset.item_id(9)
    meta = client.get(f"/v1/items/{item_id}").json()
    assert meta["row"] == 9 and meta["dataset"]["name"] == "synthetic"
    png = client.get(meta["thumbnail_url"])
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    got = np.asarray(Image.open(io.BytesIO(png.content)).convert("RGB"))
    assert np.array_equal(got, np.asarray(api_dataset.image(9).convert("RGB")))  # the stored image, exactly
    page = client.get("/")
    assert page.status_code == 200 and "softsearch" in page.text and "cdn" not in page.text.lower()
    assert client.get("/static/app.js").status_code == 200
    cfg = client.get("/v1/config").json()
    assert cfg["max_k"] == 100 and cfg["report_url"] is None


def _truncated_png(dataset) -> bytes:
    data = png_bytes(dataset.image(0).resize((64, 64)))
    return data[: len(data) * 2 // 3]


def _bomb_png() -> bytes:
    return png_bytes(Image.new("1", (6000, 6000)))  # 36 Mpx, a few KB compressed


@pytest.mark.parametrize(
    "case, status, code",
    [
        ("not_an_image", 400, "not_an_image"),
        ("empty", 400, "empty_file"),
        ("truncated", 400, "corrupt_image"),
        ("bomb", 413, "image_too_large"),
        ("k_zero", 422, "validation_error"),
        ("k_too_big", 422, "k_out_of_range"),
        ("k_text", 422, "validation_error"),
        ("temperature_negative", 422, "validation_error"),
        ("temperature_nan", 422, "validation_error"),
        ("no_file", 422, "validation_error"),
        ("json_to_upload", 415, "unsupported_media_type"),
    ],
)
def test_bad_image_requests(client, api_dataset, case, status, code):
    good = png_bytes(api_dataset.image(0))
    if case == "not_an_image":
        r = _post_image(client, b"definitely not an image" * 10, ctype="image/png")
    elif case == "empty":
        r = _post_image(client, b"")
    elif case == "truncated":
        r = _post_image(client, _truncated_png(api_dataset))
    elif case == "bomb":
        r = _post_image(client, _bomb_png())
    elif case == "k_zero":
        r = _post_image(client, good, k=0)
    elif case == "k_too_big":
        r = _post_image(client, good, k=101)
    elif case == "k_text":
        r = _post_image(client, good, k="many")
    elif case == "temperature_negative":
        r = _post_image(client, good, temperature=-1)
    elif case == "temperature_nan":
        r = _post_image(client, good, temperature="nan")
    elif case == "no_file":
        r = client.post("/v1/search", data={"k": "3"}, files={"other": ("x", b"y")})
    elif case == "json_to_upload":
        r = client.post("/v1/search", json={"k": 3})
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == code and body["detail"]


def test_upload_size_limits(make_client, api_dataset):
    client = make_client(max_upload_bytes=2048)
    # file over the limit but body within the multipart allowance: the route's own check
    r = _post_image(client, png_bytes(api_dataset.image(0).resize((256, 256))) + b"\0" * 4096)
    assert r.status_code == 413 and r.json()["error"] == "upload_too_large"
    # declared body far over the limit: refused from Content-Length before reading it
    r = _post_image(client, b"\0" * 200_000)
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    # chunked body (no Content-Length) over the limit: refused while streaming
    boundary = "xyz"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()

    def chunks():
        yield head
        for _ in range(40):
            yield b"\0" * 4096
        yield f"\r\n--{boundary}--\r\n".encode()

    r = client.post(
        "/v1/search", content=chunks(), headers={"content-type": f"multipart/form-data; boundary={boundary}"}
    )
    assert r.status_code == 413 and r.json()["error"] == "upload_too_large"


@pytest.mark.parametrize(
    "payload, status, needle",
    [
        ({"vector": [0.1] * 5, "k": 3}, 422, "dimension is 16"),
        ({"vector": [0.0] * 16, "k": 3}, 422, "zero norm"),
        ({"vector": [0.1] * 16, "k": 0}, 422, "k"),
        ({"vector": [0.1] * 16, "k": 1000}, 422, "max_k"),
        ({"vector": [], "k": 3}, 422, "vector"),
        ({"vector": "abc", "k": 3}, 422, "vector"),
        ({"k": 3}, 422, "vector"),
        ({"vector": [1e300] * 16, "k": 3}, 422, "overflow"),
    ],
)
def test_bad_vector_requests(client, payload, status, needle):
    r = client.post("/v1/search/vector", json=payload)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]


@pytest.mark.parametrize(
    "raw, status, code",
    [
        ('{"vector": [NaN' + ", 0.1" * 15 + '], "k": 3}', 422, "bad_vector"),
        ('{"vector": [Infinity' + ", 0.1" * 15 + '], "k": 3}', 422, "bad_vector"),
        ('{"vector": [1e999' + ", 0.1" * 15 + '], "k": 3}', 422, "bad_vector"),
        ('{"vector": [0.1, 0.2', 400, "malformed_json"),
        ("", 422, "validation_error"),  # no body at all: "body: Field required"
    ],
)
def test_non_finite_and_malformed_json(client, raw, status, code):
    r = client.post("/v1/search/vector", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"] == code


def test_wrong_content_type_for_vector(client):
    r = client.post("/v1/search/vector", content=b"vector=1", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["detail"]


def test_not_found_is_json(client):
    r = client.get("/v1/items/synthetic/train/99999")
    assert r.status_code == 404 and r.json()["error"] == "item_not_found"
    r = client.get("/v1/items/nope/thumbnail")
    assert r.status_code == 404 and r.json()["error"] == "item_not_found"
    r = client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    r = client.delete("/v1/index")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
    # the schema documents the 404 the item routes answer (schemathesis flagged it as undocumented)
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/items/{item_id}", "/v1/items/{item_id}/thumbnail"):
        assert "404" in paths[path]["get"]["responses"], path


def test_admin_auth(make_client, api_index):
    disabled = make_client(admin_token=None)
    assert disabled.post("/v1/admin/reload").status_code == 404
    client = make_client()
    r = client.post("/v1/admin/reload")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = client.post("/v1/admin/reload", headers={"Authorization": "Bearer wrong-token-xyz"})
    assert r.status_code == 403 and r.json()["error"] == "forbidden"
    r = client.post("/v1/admin/reload", headers={"Authorization": "Basic " + ADMIN_TOKEN})
    assert r.status_code == 401
    r = client.post("/v1/admin/reload", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "previous": api_index["version"],
        "version": api_index["version"],
        "changed": False,
        "encoder_reloaded": False,
        "count": INDEX_SIZE,
        "store_current": api_index["version"],
    }
    r = client.post(
        "/v1/admin/reload",
        json={"version": "20990101T000000000Z-00000000"},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert r.status_code == 409 and api_index["version"] in r.json()["detail"]
    assert client.get("/readyz").json()["version"] == api_index["version"]


def test_rate_limit_429_with_retry_after(make_client):
    client = make_client(rate_limit_rps=0.05, rate_limit_burst=3)  # slow refill: no timing flakiness
    codes = [client.get("/v1/index").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = client.get("/v1/index")
    assert r.status_code == 429 and r.json()["error"] == "rate_limited"
    assert 15 <= int(r.headers["retry-after"]) <= 20  # one token at 0.05/s
    assert client.get("/healthz").status_code == 200  # health and metrics are never limited
    assert "softsearch_rate_limited_total 2" in client.get("/metrics").text


def test_token_bucket_arithmetic():
    from api.ratelimit import TokenBucketLimiter

    now = [0.0]
    lim = TokenBucketLimiter(rate=2.0, burst=3, max_clients=2, clock=lambda: now[0])
    assert [lim.acquire("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert lim.acquire("a") == pytest.approx(0.5)  # empty: 1 token at 2/s
    now[0] = 0.25
    assert lim.acquire("a") == pytest.approx(0.25)  # half a token refilled
    now[0] = 0.5
    assert lim.acquire("a") == 0.0 and lim.acquire("b") == 0.0  # clients are independent
    lim.acquire("c")  # evicts the least recently seen ("a"), which comes back with a full bucket
    assert lim.acquire("a") == 0.0


def test_readiness_before_and_after_first_index(tmp_path, api_index, api_dataset):
    root = tmp_path / "empty"
    settings = Settings(index_root=root, admin_token=ADMIN_TOKEN)
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").json() == {"status": "ok", "version": None}  # alive, nothing loaded
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["error"] == "not_ready"
        assert client.post("/v1/search/vector", json={"vector": [1.0] * 16}).status_code == 503
        assert "softsearch_ready 0" in client.get("/metrics").text
        version = build_index(api_index["checkpoint"], api_dataset, root, BuildOptions(progress=False))
        r = client.post("/v1/admin/reload", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert r.status_code == 200 and r.json()["version"] == version
        assert client.get("/readyz").status_code == 200
        assert client.get("/healthz").json()["version"] == version


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$")


def _parse_metrics(text: str) -> dict:
    """Minimal Prometheus text parser: {(name, frozenset(labels)): value}; checks HELP/TYPE lines."""
    out, typed = {}, set()
    for line in text.strip().splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            assert kind in {"counter", "gauge", "histogram"}
            typed.add(name)
            continue
        if line.startswith("#"):
            assert line.startswith("# HELP ")
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line {line!r}"
        name, _, labels, value = m.groups()
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in typed or base in typed, f"{name} has no TYPE line"
        pairs = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))
        out[(name, pairs)] = float(value)
    return out


def test_metrics_prometheus_format(client, api_dataset, api_index):
    for _ in range(3):
        assert _post_image(client, png_bytes(api_dataset.image(1))).status_code == 200
    client.post("/v1/search", json={})  # 415
    m = _parse_metrics(client.get("/metrics").text)
    key = (
        "softsearch_http_requests_total",
        frozenset({("route", "/v1/search"), ("method", "POST"), ("status", "200")}),
    )
    assert m[key] == 3
    assert (
        m[
            (
                "softsearch_http_requests_total",
                frozenset({("route", "/v1/search"), ("method", "POST"), ("status", "415")}),
            )
        ]
        == 1
    )
    lab = {("route", "/v1/search"), ("method", "POST")}
    buckets = sorted(
        ((float("inf") if dict(k[1])["le"] == "+Inf" else float(dict(k[1])["le"])), v)
        for k, v in m.items()
        if k[0] == "softsearch_http_request_duration_seconds_bucket" and lab <= set(k[1])
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == 4  # cumulative, +Inf = all requests
    assert m[("softsearch_http_request_duration_seconds_count", frozenset(lab))] == 4
    assert m[("softsearch_index_info", frozenset({("version", api_index["version"])}))] == 1
    assert m[("softsearch_index_items", frozenset())] == INDEX_SIZE
    assert m[("softsearch_batch_size_count", frozenset())] == 3
    assert m[("softsearch_queries_total", frozenset({("kind", "image")}))] == 3


def test_concurrent_requests_are_batched_and_equal_unbatched(make_client, api_dataset):
    client = make_client(batch_max_size=16, batch_max_wait_ms=200)
    rows = list(range(12))
    datas = [png_bytes(api_dataset.image(i)) for i in rows]
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda d: _post_image(client, d, k=5), datas))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    sizes = [r.json()["batch_size"] for r in responses]
    assert max(sizes) > 1
    m = _parse_metrics(client.get("/metrics").text)
    count, total = (
        m[("softsearch_batch_size_count", frozenset())],
        m[("softsearch_batch_size_sum", frozenset())],
    )
    assert total == 12 and count < 12  # fewer encoder calls than queries
    # a bad upload in a batch fails alone
    mixed = datas[:5] + [b"not an image at all"] + datas[5:10]
    with ThreadPoolExecutor(11) as pool:
        codes = [r.status_code for r in pool.map(lambda d: _post_image(client, d, k=5), mixed)]
    assert codes == [200] * 5 + [400] + [200] * 5
    # same answers without batching
    plain = make_client(batch_max_size=1)
    for d, r in zip(datas, responses):
        ref = _post_image(plain, d, k=5).json()
        assert ref["batch_size"] == 1
        got = r.json()
        assert [h["id"] for h in got["results"]] == [h["id"] for h in ref["results"]]
        np.testing.assert_allclose(
            [h["probability"] for h in got["results"]], [h["probability"] for h in ref["results"]], rtol=1e-5
        )


def test_settings_validation(tmp_path):
    with pytest.raises(ValueError, match="SOFTSEARCH_PORT"):
        load_settings(environ={"SOFTSEARCH_PORT": "http"})
    with pytest.raises(ValueError, match="max_k"):
        load_settings({"max_k": 0}, environ={})
    with pytest.raises(ValueError, match="host"):
        load_settings({"host": "not a host"}, environ={})
    with pytest.raises(ValueError, match="at least 8"):
        load_settings({"admin_token": "short"}, environ={})
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        load_settings({"index_root": str(f)}, environ={})
    s = load_settings(
        {"port": 9000},
        environ={"SOFTSEARCH_PORT": "8001", "SOFTSEARCH_MAX_K": "50", "SOFTSEARCH_ADMIN_TOKEN": ""},
    )
    assert (s.port, s.max_k, s.admin_token, s.host) == (9000, 50, None, "127.0.0.1")  # CLI beats env


def test_serve_main_rejects_bad_settings(capsys):
    from api.server import main

    assert main(["--port", "70000"]) == 2
    assert "(--port=70000)" in capsys.readouterr().err  # names the flag actually used
    assert main(["--admin-token", "short"]) == 2
    err = capsys.readouterr().err
    assert "(--admin-token=<hidden>): " in err and "at least 8 characters" in err and "SOFTSEARCH_" not in err


def test_bad_env_setting_names_the_variable(monkeypatch, capsys):
    from api.server import build_parser, main

    monkeypatch.setenv("SOFTSEARCH_ADMIN_TOKEN", "short")
    assert main([]) == 2
    assert "(SOFTSEARCH_ADMIN_TOKEN=<hidden>): " in capsys.readouterr().err
    assert "at least 8 characters" in " ".join(build_parser().format_help().split())


def test_search_by_stored_item_equals_searching_its_stored_vector(client, api_index, api_dataset):
    """POST /v1/search/item == /v1/search/vector with the item's stored embedding (ids and p to 1e-6),
    minus the item itself, which is reported as self_rank; include_self keeps it; unknown id is 404."""
    from index.store import IndexStore

    version = IndexStore(api_index["root"]).load(api_index["version"], verify=False, gpu=False)
    for row in (0, 7):
        item_id = version.ids[row]
        vec = np.asarray(version.embeddings[row], dtype=np.float64)
        ref = client.post(
            "/v1/search/vector", json={"vector": vec.tolist(), "k": 6, "temperature": 0.3}
        ).json()
        got = client.post("/v1/search/item", json={"id": item_id, "k": 5, "temperature": 0.3})
        assert got.status_code == 200, got.text
        body = got.json()
        expected = [h for h in ref["results"] if h["id"] != item_id][:5]
        assert [h["id"] for h in body["results"]] == [h["id"] for h in expected]
        np.testing.assert_allclose(
            [h["probability"] for h in body["results"]],
            [h["probability"] for h in expected],
            rtol=1e-6,
            atol=1e-12,
        )
        assert body["self_rank"] == 1 + [h["id"] for h in ref["results"]].index(item_id)
        both = client.post(
            "/v1/search/item", json={"id": item_id, "k": 6, "temperature": 0.3, "include_self": True}
        ).json()
        assert [h["id"] for h in both["results"]] == [h["id"] for h in ref["results"]]
    r = client.post("/v1/search/item", json={"id": "no/such/item", "k": 3})
    assert r.status_code == 404 and r.json()["error"] == "item_not_found"
    assert (
        client.post("/v1/search/item", json={"id": version.ids[0], "k": 3, "include_self": 0}).status_code
        == 422
    )


@pytest.mark.parametrize("seed", range(6))
def test_cut_offs_and_pages_match_a_dense_reference(client, api_index, api_dataset, seed):
    """min_probability, mass and offset on /v1/search/vector against the dense softmax over all items."""
    rng = np.random.default_rng(seed)
    _, s, p, z = _reference(api_index, [api_dataset.image(int(rng.integers(0, 50)))], tau=0.1)
    order = np.argsort(-s[0], kind="stable")
    ranked = p[0, order]
    k, offset = int(rng.integers(1, 8)), int(rng.integers(0, 8))
    j = int(rng.integers(0, 12))
    min_p = float(np.sqrt(ranked[j] * ranked[j + 1]))  # between two ranks: float32 vs float64 cannot flip it
    mass = float(rng.uniform(0.1, 0.9))
    for extra, passes in (
        ({"min_probability": min_p}, ranked >= min_p),
        ({"mass": mass}, np.r_[0.0, np.cumsum(ranked)[:-1]] < mass),
        ({}, np.ones(ranked.size, bool)),
    ):
        body = client.post(
            "/v1/search/vector",
            json={"vector": z[0].tolist(), "k": k, "offset": offset, "temperature": 0.1, **extra},
        ).json()
        n_pass = int(np.argmin(passes)) if not passes.all() else ranked.size  # passing hits form a prefix
        fetched = min(k + offset, ranked.size)
        want = order[: min(n_pass, fetched)][offset : offset + k]
        assert [h["row"] for h in body["results"]] == want.tolist(), extra
        assert body["n_passed"] == min(n_pass, fetched) and body["offset"] == offset
        np.testing.assert_allclose([h["probability"] for h in body["results"]], p[0, want], rtol=1e-4)
    # pages are stable: two pages of k equal one page of 2k
    first = client.post(
        "/v1/search/vector", json={"vector": z[0].tolist(), "k": 3, "temperature": 0.1}
    ).json()
    second = client.post(
        "/v1/search/vector", json={"vector": z[0].tolist(), "k": 3, "offset": 3, "temperature": 0.1}
    ).json()
    both = client.post("/v1/search/vector", json={"vector": z[0].tolist(), "k": 6, "temperature": 0.1}).json()
    assert [h["id"] for h in first["results"] + second["results"]] == [h["id"] for h in both["results"]]


def test_k_and_offset_are_bounded_by_max_k(client, api_dataset):
    r = client.post("/v1/search/vector", json={"vector": [1.0] * 16, "k": 90, "offset": 101})
    assert r.status_code == 422 and r.json()["error"] == "offset_out_of_range"
    r = client.post("/v1/search/vector", json={"vector": [1.0] * 16, "k": 100, "offset": 100})
    assert r.status_code == 200 and r.json()["offset"] == 100
    r = client.post("/v1/search/vector", json={"vector": [1.0] * 16, "k": 5, "mass": 0})
    assert r.status_code == 422
