"""`softsearch serve` over a sharded version (in-process fan-out): the non-search routes describe it as one
version of all its items, as they describe the unsharded version it came from."""

from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.config import Settings
from index.shards import reshard
from index.store import IndexStore


@pytest.fixture(scope="module")
def clients(api_index, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_api") / "index"
    shutil.copytree(api_index["root"], root)
    version = reshard(root, 3)
    whole = TestClient(create_app(Settings(index_root=api_index["root"], watch_interval_s=0)))
    sharded = TestClient(create_app(Settings(index_root=root, watch_interval_s=0)))
    with whole, sharded:
        yield whole, sharded, version, IndexStore(root).load(verify=False).ids


def test_index_items_and_health_routes_describe_one_version(clients):
    whole, sharded, version, ids = clients
    assert sharded.get("/readyz").status_code == 200
    a, b = whole.get("/v1/index").json(), sharded.get("/v1/index").json()
    assert b["version"] == version and b["count"] == a["count"] == len(ids) and b["dim"] == a["dim"]
    assert b["fields"] == a["fields"] and b["temperature"] == a["temperature"]
    assert [s["count"] for s in b["manifest"]["shards"]] == [40, 40, 40]
    for item in (ids[0], ids[41], ids[119]):  # one item in each shard
        got, want = sharded.get(f"/v1/items/{item}"), whole.get(f"/v1/items/{item}")
        assert got.status_code == 200, got.text
        assert {k: v for k, v in got.json().items() if k != "version"} == {
            k: v for k, v in want.json().items() if k != "version"
        }
        thumb = sharded.get(f"/v1/items/{item}/thumbnail")
        assert thumb.status_code == 200 and thumb.content == whole.get(f"/v1/items/{item}/thumbnail").content
    assert sharded.get("/v1/items/no-such-item").status_code == 404
    sample = sharded.get("/v1/items", params={"n": 5})
    assert sample.status_code == 200, sample.text
