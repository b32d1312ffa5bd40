"""Each serving process follows the store's `current` pointer (api/swap.py): an activation is served
without an admin reload; a version that cannot be loaded is refused once and the old one keeps serving."""

from __future__ import annotations

import time

from api_helpers import make_checkpoint
from fastapi.testclient import TestClient

from api.app import create_app
from api.config import Settings
from index.build import BuildOptions, build_index
from index.store import IndexStore
from training.datasets import create_dataset


def _wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_follows_current_and_refuses_a_broken_version_once(tmp_path):
    ck_a = make_checkpoint(tmp_path / "a.safetensors", seed=31)
    ck_b = make_checkpoint(tmp_path / "b.safetensors", seed=32)
    ck_c = make_checkpoint(tmp_path / "c.safetensors", seed=33)
    root = tmp_path / "index"
    ds = create_dataset("synthetic", split="train", size=40, seed=0)
    v1 = build_index(ck_a, ds, root, BuildOptions(progress=False))
    with TestClient(create_app(Settings(index_root=root, watch_interval_s=0.05))) as client:
        version = lambda: client.get("/readyz").json()["version"]  # noqa: E731
        assert version() == v1
        v2 = build_index(ck_b, ds, root, BuildOptions(progress=False))  # activates: served without any reload
        _wait_for(lambda: version() == v2)
        metrics = client.app.state.metrics
        assert metrics.sample("softsearch_index_reloads_total", result="changed") == 1
        assert metrics.sample("softsearch_index_info", version=v2) == 1
        assert metrics.sample("softsearch_index_info", version=v1) is None

        v3 = build_index(ck_c, ds, root, BuildOptions(progress=False, activate=False))
        store = IndexStore(root)
        with open(
            store.path(v3) / "ids.json", "r+b"
        ) as fh:  # damaged on disk: its checksum no longer matches
            fh.write(b"{")
        store.activate(v3, verify=False)  # the pointer moves to it; the server cannot load it
        _wait_for(lambda: (metrics.sample("softsearch_index_reloads_total", result="refused") or 0) >= 1)
        time.sleep(0.5)  # ten more polls: refused once, not retried while `current` stays put
        assert metrics.sample("softsearch_index_reloads_total", result="refused") == 1
        assert version() == v2
        r = client.post("/v1/search/vector", json={"vector": [1.0] * 16, "k": 3})
        assert r.status_code == 200 and r.json()["version"] == v2
