"""The served OpenAPI document states the limits the routes enforce (api/openapi.py), and the routes
hold to it: what the schema admits is answered, what it excludes is refused (422)."""

from __future__ import annotations

import json

import jsonschema_rs
from api_helpers import png_bytes


def _resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref")
    return schema["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else node


def _body_schema(schema: dict, path: str, media: str = "application/json") -> dict:
    return _resolve(schema, schema["paths"][path]["post"]["requestBody"]["content"][media]["schema"])


def _folder_client(folder_index, **settings):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.config import Settings

    return TestClient(create_app(Settings(index_root=folder_index["root"], **settings)))


def test_schema_states_the_served_limits(folder_index):
    with _folder_client(folder_index, max_k=50) as client:
        _check_served_limits(client)


def _check_served_limits(client):
    schema = client.get("/openapi.json").json()
    vector = _body_schema(schema, "/v1/search/vector")["properties"]
    dim = client.get("/v1/index").json()["dim"]
    assert vector["vector"]["minItems"] == vector["vector"]["maxItems"] == dim  # the served index's dim
    assert vector["k"]["maximum"] == 50 and vector["offset"]["maximum"] == 50
    batch = _body_schema(schema, "/v1/search/batch")["properties"]
    assert batch["vectors"]["items"]["minItems"] == dim
    form = _body_schema(schema, "/v1/search", "multipart/form-data")["properties"]
    assert form["k"]["maximum"] == 50 and form["temperature"]["type"] == "number"  # no null in a form
    assert form["filter"]["$ref"] == "#/components/schemas/Filter"  # sent as a JSON part:
    content = schema["paths"]["/v1/search"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert content["encoding"]["filter"]["contentType"] == "application/json"
    fields = client.get("/v1/index").json()["fields"]
    flt = schema["components"]["schemas"]["Filter"]
    assert fields and set(flt["properties"]) == set(fields) | {"and", "or", "not"}


def test_what_the_schema_admits_is_answered_and_what_it_excludes_is_refused(folder_index, api_dataset):
    with _folder_client(folder_index) as client:
        _check_admitted_and_excluded(client, api_dataset)


def _check_admitted_and_excluded(client, api_dataset):
    schema = client.get("/openapi.json").json()
    body = _body_schema(schema, "/v1/search/vector")
    resolver_schema = {**body, "components": schema["components"]}
    field, value = "rating", 3
    assert client.get("/v1/index").json()["fields"][field] == "int"
    n = client.get("/v1/index").json()["dim"]
    admitted = [
        {"vector": [1.0] * n, "k": 1.0},  # an integer, in JSON Schema
        {"vector": [0.0] * (n - 1) + [1e-300], "k": 100, "offset": 100},  # k and offset each <= max_k
        {"vector": [1.0] * n, "filter": {"or": [{field: value}, {"not": {field: value}}]}},
        {"vector": [1.0] * n, "temperature": None, "filter": None},
    ]
    excluded = [
        {"vector": [1.0] * n, "k": True},
        {"vector": [1.0] * n, "k": "5"},
        {"vector": [True] * n},
        {"vector": [1.0] * (n - 1)},
        {"vector": [0.0] * n},
        {"vector": [1.0] * n, "offset": 101},
        {"vector": [1.0] * n, "k": 101},
        {"vector": [1.0] * n, "filter": {"no_such_field": 1}},
        {"vector": [1.0] * n, "filter": {}},
    ]
    validator = jsonschema_rs.Draft202012Validator(resolver_schema)
    for query in admitted:
        assert validator.is_valid(json.loads(json.dumps(query))), query
        r = client.post("/v1/search/vector", json=query)
        assert r.status_code == 200, (query, r.text)
    for query in excluded:
        assert not validator.is_valid(query), query
        r = client.post("/v1/search/vector", json=query)
        assert r.status_code == 422, (query, r.text)
    # a multipart filter of JSON null is no filter, as in the JSON routes
    image = png_bytes(api_dataset.image(0))
    r = client.post(
        "/v1/search", files={"file": ("q.png", image, "image/png")}, data={"k": "3", "filter": "null"}
    )
    assert r.status_code == 200 and r.json()["matched"] is None
