"""A server never evaluates: an admin reload of a version with no quality-gate result is one clear 409,
nothing changes (store pointer, served version); once `softsearch index activate` has gated it, the server
follows."""

from __future__ import annotations

import numpy as np
import pytest
from api_helpers import ADMIN_TOKEN
from fastapi.testclient import TestClient

N, DIM = 400, 16
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _vectors(path, seed):
    x = np.random.default_rng(seed).standard_normal((N, DIM))
    np.save(path, (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))
    return path


@pytest.mark.parametrize("force", [False, True])
def test_reload_of_an_ungated_version_is_409_until_the_cli_gates_it(tmp_path, force):
    from api.app import create_app
    from api.config import Settings
    from index.build import BuildOptions, build_from_vectors
    from index.cli import main as index_main
    from index.manifest import read_manifest_json, write_manifest
    from index.store import IndexStore

    root = tmp_path / "index"
    v1 = build_from_vectors(_vectors(tmp_path / "a.npy", 0), root, BuildOptions(kind="flat", progress=False))
    v2 = build_from_vectors(
        _vectors(tmp_path / "b.npy", 1), root, BuildOptions(kind="flat", progress=False, activate=False)
    )
    store = IndexStore(root)
    manifest = read_manifest_json(store.path(v2))
    del manifest["quality_gate"]  # as a store written before the gate existed
    write_manifest(store.path(v2), manifest)

    with TestClient(
        create_app(Settings(index_root=root, admin_token=ADMIN_TOKEN, watch_interval_s=0.05))
    ) as client:
        r = client.post("/v1/admin/reload", json={"version": v2, "force": force}, headers=AUTH)
        assert r.status_code == 409, r.text
        body = r.json()
        assert body["error"] == "reload_refused"
        assert "has no quality-gate result and a server does not evaluate" in body["detail"]
        assert (
            f"softsearch index activate {v2}" in body["detail"]
            and f"still serving version {v1}" in body["detail"]
        )
        assert store.current_version() == v1 and store.manifest(v2).quality_gate is None  # nothing recorded
        assert client.get("/readyz").json()["version"] == v1

        # the CLI gates it (a version built from vectors: recall check on held-out rows, no evaluator call)
        assert (
            index_main(
                ["activate", "--root", str(root), v2],
                evaluator=lambda c, s: pytest.fail("vectors-only versions are not scored"),
            )
            == 0
        )
        gate = store.manifest(v2).quality_gate
        assert gate is not None and gate.passed and store.current_version() == v2
        r = client.post("/v1/admin/reload", json={"version": v2, "force": force}, headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == v2, r.text
