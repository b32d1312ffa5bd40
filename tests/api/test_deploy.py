"""Deploying an index: train, build, move the training run away, copy the store (`cp -a`, and
export -> import) to new paths, serve from there: ready, same version, same answers; eval and
add work from the copies alone."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
from api_helpers import png_bytes
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main
from api.config import Settings
from index.store import IndexStore
from training.datasets import create_dataset

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def _answers(root: Path, payloads: list[bytes]) -> tuple[str, list[dict]]:
    """(version from /healthz, search answers) of a server started on `root`; checks /readyz first."""
    with TestClient(create_app(Settings(index_root=root))) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        health = client.get("/healthz").json()
        assert health["version"] == ready.json()["version"]
        answers = []
        for data in payloads:
            r = client.post("/v1/search", files={"file": ("q.png", data, "image/png")}, data={"k": "5"})
            assert r.status_code == 200, r.text
            body = r.json()
            answers.append(
                {
                    "version": body["version"],
                    "temperature": body["temperature"],
                    "results": [(h["id"], h["similarity"], h["probability"]) for h in body["results"]],
                }
            )
        return health["version"], answers


def test_store_copied_or_shipped_serves_the_same_answers(tmp_path):
    train, store = tmp_path / "train", tmp_path / "store"
    assert main(["train", "--config", str(TINY), "--set", f'out_dir="{train}"', "--set", "steps=4"]) == 0
    assert (
        main(
            [
                "index",
                "build",
                "--root",
                str(store),
                "--checkpoint",
                str(train / "checkpoint.safetensors"),
                "--dataset",
                "synthetic",
                "--size",
                "96",
                "--no-progress",
            ]
        )
        == 0
    )
    queries = create_dataset("synthetic", split="test", size=6, seed=3)
    payloads = [png_bytes(queries.image(i)) for i in range(len(queries))]
    version, expected = _answers(store, payloads)

    shutil.move(train, tmp_path / "train-moved-away")  # the training run is gone
    copied = tmp_path / "elsewhere" / "copied"
    copied.parent.mkdir()
    subprocess.run(["cp", "-a", str(store), str(copied)], check=True)
    archive = tmp_path / "ship" / "index.tar.gz"
    assert main(["index", "export", "--root", str(store), "--out", str(archive)]) == 0
    imported = tmp_path / "elsewhere" / "imported"
    assert main(["index", "import", "--root", str(imported), str(archive)]) == 0
    shutil.move(store, tmp_path / "store-moved-away")  # and so is the original store

    for root in (copied, imported):
        got_version, got = _answers(root, payloads)
        assert got_version == version
        for a, b in zip(got, expected):
            assert a["version"] == b["version"] == version and a["temperature"] == b["temperature"]
            assert [r[0] for r in a["results"]] == [r[0] for r in b["results"]]
            np.testing.assert_allclose(
                [r[1:] for r in a["results"]], [r[1:] for r in b["results"]], rtol=1e-6
            )

    # eval and add need only the store root too
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--index",
                str(copied),
                "--max-queries",
                "16",
                "--no-k-law",
                "--n-boot",
                "20",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads((out / "report.json").read_text())["index"]["version"] == version
    assert (
        main(
            [
                "index",
                "add",
                "--root",
                str(imported),
                "--dataset",
                "synthetic",
                "--split",
                "test",
                "--size",
                "8",
                "--no-progress",
                "--force",
            ]
        )
        == 0
    )  # (the gate judges the data, not the point here)
    assert IndexStore(imported).load().manifest.count == 96 + 8
