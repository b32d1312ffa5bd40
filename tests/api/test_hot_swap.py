"""Hot swap under load on a real uvicorn server: 16 clients query continuously while the index
is rebuilt and swapped 5 times; zero failed requests, every answer matches its reported version."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from api_helpers import ADMIN_TOKEN, SearchClients, ServerThread, make_checkpoint, png_bytes

from api.app import create_app
from api.config import Settings
from index.build import BuildOptions, build_index
from index.store import IndexStore
from training.checkpoint import load_checkpoint
from training.datasets import create_dataset
from training.encoder import embed
from training.transforms import preprocess

CLIENTS = 16
SWAPS = 5
K = 5


def _expected(root, version, images):
    """Brute force for one version: its own checkpoint's encoder, its stored embeddings."""
    v = IndexStore(root).load(version)
    enc, _ = load_checkpoint(v.manifest.checkpoint.path)
    z = embed(enc, preprocess(images, enc.image_size), progress=False)
    s = z.astype(np.float64) @ v.embeddings.astype(np.float64).T  # (Q, N)
    top = np.argsort(-s, axis=1, kind="stable")[:, :K]
    return [[v.ids[j] for j in row] for row in top], np.take_along_axis(s, top, 1)


@pytest.mark.slow
def test_hot_swap_under_load(tmp_path):
    ck_a = make_checkpoint(tmp_path / "a.safetensors", seed=11)
    ck_b = make_checkpoint(tmp_path / "b.safetensors", seed=12)
    ck_wide = make_checkpoint(tmp_path / "wide.safetensors", seed=13, embed_dim=24)
    root = tmp_path / "index"
    # each swap changes encoder, size or dimension, so answers really differ between versions
    plan = [(ck_a, 100), (ck_b, 80), (ck_wide, 90), (ck_a, 60), (ck_b, 110), (ck_wide, 70)]
    first = build_index(
        plan[0][0],
        create_dataset("synthetic", split="train", size=plan[0][1], seed=0),
        root,
        BuildOptions(progress=False),
    )
    queries = create_dataset("synthetic", split="test", size=8, seed=0)
    images = [queries.image(i) for i in range(len(queries))]
    payloads = [png_bytes(im) for im in images]

    app = create_app(
        Settings(index_root=root, admin_token=ADMIN_TOKEN, batch_max_size=16, batch_max_wait_ms=2)
    )
    versions = [first]
    with ServerThread(app) as server, SearchClients(server.url, payloads, CLIENTS, K) as load:
        with httpx.Client(base_url=server.url, timeout=60) as admin:
            for ck, size in plan[1 : SWAPS + 1]:
                time.sleep(0.5)
                versions.append(
                    build_index(
                        ck,
                        create_dataset("synthetic", split="train", size=size, seed=0),
                        root,
                        BuildOptions(progress=False),
                    )
                )
                r = admin.post("/v1/admin/reload", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                assert r.status_code == 200 and r.json()["version"] == versions[-1], r.text
                load.wait_for(CLIENTS)  # queries on this version
    results = load.results

    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:5]
    assert len(results) >= CLIENTS * SWAPS
    seen = {body["version"] for _, _, body in results}
    assert seen <= set(versions) and len(seen) >= SWAPS  # answers came from (nearly) every version
    expected = {v: _expected(root, v, images) for v in seen}
    counts = {v: IndexStore(root).manifest(v).count for v in seen}
    for q, _, body in results:
        ids, sims = expected[body["version"]]
        assert [h["id"] for h in body["results"]] == ids[q], (body["version"], q)
        np.testing.assert_allclose([h["similarity"] for h in body["results"]], sims[q], atol=1e-4)
        assert body["count"] == counts[body["version"]]
