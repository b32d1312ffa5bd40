"""Hostile filters on every search route: numbers beyond float64 (JSON integers of hundreds of digits),
non-finite numbers and filters nested far deeper than a valid one are 4xx JSON naming the problem, never
a 500 (a 500 also closed the client's keep-alive connection). The counts of matched items are checked
against the CSV the folder index was built from (id n has rating n % 5)."""

from __future__ import annotations

import http.client
import json

import pytest
from api_helpers import ADMIN_TOKEN, ServerThread
from fastapi.testclient import TestClient

from api.app import create_app
from api.config import Settings
from search.serving.filters import MAX_DEPTH, MAX_NODES, MAX_NUMBER

HUGE = 10**400  # a JSON integer float() cannot convert (OverflowError)
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def app(folder_index):
    return create_app(Settings(index_root=folder_index["root"], admin_token=ADMIN_TOKEN))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def query(folder_index):
    """(a query vector of the served dimension, an indexed id, an indexed PNG file's bytes)."""
    version = folder_index["version"]
    first = folder_index["ids"][0]
    return version.embeddings[0].tolist(), first, (folder_index["folder"] / first).read_bytes()


def _depth(value) -> int:
    """Levels of objects and lists."""
    if isinstance(value, (dict, list)):
        return 1 + max(map(_depth, value.values() if isinstance(value, dict) else value), default=0)
    return 0


def _json_routes(vector, item_id, flt: str) -> list[tuple[str, str]]:
    """(route, raw JSON body) with the filter spliced in as text, so integers keep every digit."""
    vec = json.dumps(vector)
    return [
        ("/v1/search/vector", f'{{"vector": {vec}, "k": 3, "filter": {flt}}}'),
        ("/v1/search/item", f'{{"id": {json.dumps(item_id)}, "k": 3, "filter": {flt}}}'),
        ("/v1/search/batch", f'{{"vectors": [{vec}, {vec}], "k": 3, "filter": {flt}}}'),
    ]


def _multipart(client, png: bytes, flt: str) -> list:
    return [
        client.post(
            "/v1/search", files={"file": ("q.png", png, "image/png")}, data={"k": "3", "filter": flt}
        ),
        client.post(
            "/v1/search/batch", files=[("files", ("q.png", png, "image/png"))], data={"k": "3", "filter": flt}
        ),
    ]


@pytest.mark.parametrize(
    "flt, field",
    [
        (f'{{"rating": {{"gte": {HUGE}}}}}', "rating"),  # int field, range
        (f'{{"rating": {HUGE}}}', "rating"),  # int field, equality
        (f'{{"mtime": {{"lt": -{HUGE}}}}}', "mtime"),  # float field, negative
        (f'{{"size": {{"in": [1, {HUGE}]}}}}', "size"),  # inside an `in` list
        (f'{{"not": {{"or": [{{"rating": 1}}, {{"width": {{"lte": {HUGE}}}}}]}}}}', "width"),
        ('{"rating": {"gt": NaN}}', "rating"),  # Python's json reads these too
        ('{"mtime": Infinity}', "mtime"),
        ('{"mtime": {"in": [-Infinity]}}', "mtime"),
    ],
)
def test_huge_and_non_finite_numbers_are_422_naming_the_field(client, query, flt, field):
    vector, item_id, png = query
    answers = [
        client.post(route, content=body, headers=JSON) for route, body in _json_routes(vector, item_id, flt)
    ]
    answers += _multipart(client, png, flt)
    for r in answers:
        assert r.status_code == 422, (r.request.url, r.text)
        body = r.json()
        assert body["error"] == "bad_filter" and f"'{field}'" in body["detail"], body
        assert len(body["detail"]) < 300  # the number is described, not echoed
    if "Infinity" not in flt and "NaN" not in flt:
        assert "out of range" in answers[0].json()["detail"] and "401 digits" in answers[0].json()["detail"]


def test_the_largest_float64_still_compares(client, query, folder_index):
    """The bound is exact: an integer equal to the largest float64 is accepted and compares as it."""
    vector, item_id, png = query
    biggest = int(MAX_NUMBER)
    rated = len(folder_index["ids"])  # every item has a rating (0..4)
    for flt, matched in [
        (f'{{"rating": {{"lt": {biggest}}}}}', rated),
        (f'{{"rating": {{"gte": {biggest}}}}}', 0),
        (f'{{"rating": {{"gt": -{biggest}, "lte": 1}}}}', sum(1 for n in range(rated) if n % 5 <= 1)),
    ]:
        r = client.post("/v1/search/vector", content=_json_routes(vector, item_id, flt)[0][1], headers=JSON)
        assert r.status_code == 200, r.text
        assert r.json()["matched"] == matched
    too_big = biggest + 2**971  # float() of this one overflows
    r = client.post(
        "/v1/search/vector",
        content=_json_routes(vector, item_id, f'{{"rating": {too_big}}}')[0][1],
        headers=JSON,
    )
    assert r.status_code == 422 and "out of range" in r.json()["detail"]


def test_an_integer_longer_than_python_converts_is_4xx(client, query):
    """A multipart filter holding a 5,000-digit integer (over Python's int-string limit): 422, not JSON."""
    vector, item_id, png = query
    for r in _multipart(client, png, '{"rating": 1' + "0" * 5000 + "}"):
        assert r.status_code == 422 and r.json()["error"] == "bad_filter", r.text
    r = client.post(
        "/v1/search/vector",
        content=_json_routes(vector, item_id, '{"rating": 1' + "0" * 5000 + "}")[0][1],
        headers=JSON,
    )
    assert r.status_code == 400, r.text  # the JSON body itself cannot be read


@pytest.mark.parametrize(
    "flt",
    [
        "[" * 100_000,  # the two shapes
        '{"not":' * 2000 + '{"rating": 1}' + "}" * 2000,
        '{"not":' * (MAX_DEPTH + 1) + '{"rating": 1}' + "}" * (MAX_DEPTH + 1),
        '{"rating": {"in": '
        + "[" * 900
        + "1"
        + "]" * 900
        + "}}",  # deep inside a value (under the parser's limit)
    ],
)
def test_a_deeply_nested_filter_is_400_on_every_route(client, query, flt):
    vector, item_id, png = query
    for r in _multipart(client, png, flt):
        assert r.status_code == 400, r.text
        assert r.json()["error"] == "filter_too_deep" and str(MAX_DEPTH) in r.json()["detail"]
    for route, body in _json_routes(vector, item_id, flt):
        r = client.post(route, content=body, headers=JSON)
        assert r.status_code == 400, (route, r.text)  # the parser's own refusal or ours
        assert r.json()["error"] in ("filter_too_deep", "bad_request", "malformed_json")


def test_brackets_inside_strings_do_not_count(client, query, folder_index):
    """A string of 10,000 '[' is a value, not nesting: answered as any unknown class (matches nothing)."""
    vector, item_id, png = query
    flt = json.dumps({"class": "[" * 10_000 + '\\"{'})
    for r in _multipart(client, png, flt):
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body.get("matched") if "matched" in body else body["responses"][0]["matched"]) == 0


def test_the_deepest_filter_is_answered_alike_on_every_route(client, query, folder_index):
    """A filter nested exactly MAX_DEPTH levels (and-lists inside and-lists, a `not`, an `in` list) is
    answered on every route, JSON and multipart, matching the items its condition leaves out; one
    level more is 400 on every route; MAX_NODES + 1 conditions side by side are 422."""
    vector, item_id, png = query
    flt: dict = {"rating": {"in": [0, 3]}}  # 3 levels
    for _ in range((MAX_DEPTH - 4) // 2):
        flt = {"and": [flt]}  # 2 levels each
    flt = {"not": flt}  # 3 + 60 + 1
    text = json.dumps(flt)
    assert _depth(flt) == MAX_DEPTH
    expected = sum(1 for n in range(len(folder_index["ids"])) if n % 5 not in (0, 3))  # under the `not`
    for r in [
        client.post(route, content=body, headers=JSON) for route, body in _json_routes(vector, item_id, text)
    ] + _multipart(client, png, text):
        assert r.status_code == 200, (r.request.url, r.text)
        body = r.json()
        answers = body["responses"] if "responses" in body else [body]
        assert all(a["matched"] == expected for a in answers)
    deeper = json.dumps({"not": flt})
    for r in [
        client.post(route, content=body, headers=JSON)
        for route, body in _json_routes(vector, item_id, deeper)
    ] + _multipart(client, png, deeper):
        assert r.status_code == 400 and r.json()["error"] == "filter_too_deep", (r.request.url, r.text)
    wide = json.dumps({"or": [{"rating": n % 5} for n in range(MAX_NODES)]})
    r = client.post("/v1/search/vector", content=_json_routes(vector, item_id, wide)[0][1], headers=JSON)
    assert r.status_code == 422 and f"more than {MAX_NODES} conditions" in r.json()["detail"]


def test_the_connection_stays_open_after_a_refused_filter(app, query):
    """Over a real socket: the refused request is answered and the next one on the same keep-alive
    connection is served (a 500 used to close it under the client)."""
    vector, item_id, png = query
    bad = _json_routes(vector, item_id, f'{{"rating": {{"gte": {HUGE}}}}}')
    good = _json_routes(vector, item_id, '{"rating": 2}')
    with ServerThread(app) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            first = None
            for (route, body), (_, ok_body) in zip(bad, good):
                conn.request("POST", route, body=body, headers=JSON)
                r = conn.getresponse()
                assert r.status == 422 and json.loads(r.read())["error"] == "bad_filter"
                assert (r.getheader("connection") or "").lower() != "close"
                first = first or conn.sock
                conn.request("POST", route, body=ok_body, headers=JSON)
                r = conn.getresponse()
                assert r.status == 200, r.read()
                r.read()
            assert conn.sock is first and first is not None  # still the first socket
        finally:
            conn.close()


def test_an_unhandled_error_is_a_500_that_keeps_the_connection(app, query, monkeypatch):
    """Any error a route does not handle (here one made to happen in the filter parser) is answered with
    the JSON 500 and the keep-alive connection stays usable (Starlette's last-resort handler re-raised,
    and uvicorn closed the connection under the client)."""
    import api.routes.search as search_routes

    vector, item_id, png = query
    real = search_routes.parse_filter

    def broken(spec, types):
        if spec == {"rating": 4}:
            raise RuntimeError("a bug")
        return real(spec, types)

    monkeypatch.setattr(search_routes, "parse_filter", broken)
    bad = _json_routes(vector, item_id, '{"rating": 4}')[0]
    good = _json_routes(vector, item_id, '{"rating": 2}')[0]
    with ServerThread(app) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request("POST", bad[0], body=bad[1], headers=JSON)
            r = conn.getresponse()
            assert r.status == 500 and json.loads(r.read()) == {
                "error": "internal_error",
                "detail": "internal error (RuntimeError)",
            }
            first = conn.sock
            conn.request("POST", good[0], body=good[1], headers=JSON)
            r = conn.getresponse()
            assert r.status == 200, r.read()
            r.read()
            assert conn.sock is first and first is not None
        finally:
            conn.close()
