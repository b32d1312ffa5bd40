"""`softsearch index sync --notify` while a real uvicorn server answers 12 clients continuously: the
folder changes twice, each sync (quality gate, calibration, activation, notify) swaps the server to
the synced version; zero failed requests, and every answer matches the version it reports."""

from __future__ import annotations

import shutil
import time

import httpx
import numpy as np
import pytest
from api_helpers import ADMIN_TOKEN, SearchClients, ServerThread, make_checkpoint, png_bytes
from PIL import Image, ImageOps

from api.app import create_app
from api.cli import main
from api.config import Settings
from index.store import IndexStore
from training.datasets import create_dataset

CLIENTS = 12
K = 5


def _expected(root, version, payloads):
    """Brute-force top-K of every query against one version's stored embeddings (queries decoded
    as the server decodes uploads to an index of image files: the image cache's square)."""
    from index.models import load_version_encoder
    from training.encoder import embed
    from training.images import cache_resolution, load_square
    from training.transforms import preprocess

    v = IndexStore(root).load(version)
    enc, _, _ = load_version_encoder(v)
    squares = np.stack([load_square(p, cache_resolution(enc.image_size)) for p in payloads])
    z = embed(enc, preprocess(squares, enc.image_size), progress=False)
    s = z.astype(np.float64) @ np.asarray(v.embeddings, dtype=np.float64).T
    top = np.argsort(-s, axis=1, kind="stable")[:, :K]
    return [[v.ids[j] for j in row] for row in top]


@pytest.mark.slow
def test_sync_with_notify_swaps_under_load(tmp_path, make_image_folder):
    ck = make_checkpoint(tmp_path / "encoder.safetensors", seed=21)
    every = make_image_folder(tmp_path / "every", count=70, classes=3, size=40)
    files = sorted(every.rglob("*.png"))
    folder = tmp_path / "photos"
    for path in files[:50]:
        (folder / path.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, folder / path.parent.name / path.name)
    root = tmp_path / "index"
    assert (
        main(
            [
                "index",
                "build",
                "--root",
                str(root),
                "--checkpoint",
                str(ck),
                "--dataset",
                "folder",
                "--split",
                "all",
                "--data-root",
                str(folder),
                "--no-progress",
            ]
        )
        == 0
    )
    first = IndexStore(root).current_version()
    queries = [Image.open(p).convert("RGB") for p in files[::9]]
    payloads = [png_bytes(im) for im in queries]

    app = create_app(
        Settings(index_root=root, admin_token=ADMIN_TOKEN, batch_max_size=16, batch_max_wait_ms=2)
    )
    versions = [first]
    with ServerThread(app) as server, SearchClients(server.url, payloads, CLIENTS, K) as load:
        for step in range(2):
            time.sleep(0.5)
            current = sorted(folder.rglob("*.png"))
            for path in current[step::10]:  # remove ~10 %
                path.unlink()
            for path in current[5 + step :: 20]:  # modify ~5 %
                if path.exists():
                    with Image.open(path) as im:
                        ImageOps.invert(im.convert("RGB")).save(path)
            for path in files[50 + 10 * step : 60 + 10 * step]:  # add new files
                shutil.copy2(path, folder / path.parent.name / path.name)
            assert (
                main(
                    [
                        "index",
                        "sync",
                        "--root",
                        str(root),
                        "--no-progress",
                        "--notify",
                        server.url,
                        "--token",
                        ADMIN_TOKEN,
                    ]
                )
                == 0
            )
            versions.append(IndexStore(root).current_version())
            assert versions[-1] != versions[-2]
            with httpx.Client(base_url=server.url, timeout=30) as http:
                assert http.get("/healthz").json()["version"] == versions[-1]  # the server follows
            load.wait_for(CLIENTS)
    results = load.results

    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:5]
    seen = {body["version"] for _, _, body in results}
    assert seen <= set(versions) and versions[-1] in seen
    expected = {v: _expected(root, v, payloads) for v in seen}
    for q, _, body in results:
        assert [h["id"] for h in body["results"]] == expected[body["version"]][q], (body["version"], q)
    gate = IndexStore(root).manifest(versions[-1]).quality_gate.to_json()
    assert gate["passed"] and gate["serving_version"] == versions[-2]
    assert "serving_scored_on" in gate  # its own files changed: scored by its settings on the new items
    assert len(results) >= 3 * CLIENTS and len(seen) == 3, (len(results), seen)
    assert (
        create_dataset("folder", split="all", root=str(folder), image_size=32).item_ids()
        == IndexStore(root).load().ids
    )
