"""`index build --encoder open_clip:NAME --pretrained FILE` keeps the weights file's text tower: text queries
then equal open_clip's own encode_text (random weights written to a file; nothing downloaded), and the text
temperature is calibrated on the folder's sidecar captions."""

from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main
from api.config import Settings
from index.store import IndexStore

SIZE = 64


@pytest.mark.slow
def test_pretrained_index_keeps_the_text_tower(tmp_path, open_clip_weights, make_image_folder):
    folder = make_image_folder(tmp_path / "photos", count=12, classes=3, size=SIZE)
    files = sorted(p for p in folder.rglob("*.png"))
    for n, p in enumerate(files[:8]):  # sidecar captions (the Tux Paint layout) for 8 of the 12 images
        p.with_suffix(".txt").write_text(f"picture number {n}\nfr.utf8=image {n}\n")
    weights = open_clip_weights["files"]["safetensors"]
    root = tmp_path / "index"
    assert (
        main(
            [
                "index",
                "build",
                "--root",
                str(root),
                "--encoder",
                f"open_clip:{open_clip_weights['name']}",
                "--pretrained",
                str(weights),
                "--image-size",
                str(SIZE),
                "--dataset",
                "folder",
                "--data-root",
                str(folder),
                "--no-progress",
            ]
        )
        == 0
    )
    version = IndexStore(root).load()
    record = version.manifest.extra["text"]
    assert record["tower"]["model_name"] == open_clip_weights["name"] and record["exact"] is False
    assert record["n_queries"] == 8 and record["temperature"] > 0

    model = open_clip.create_model(
        open_clip_weights["name"], pretrained=str(weights), pretrained_text=False
    ).eval()
    tokenizer = open_clip.get_tokenizer(open_clip_weights["name"])
    text = "a photo of a red square"
    with torch.no_grad():
        reference = model.encode_text(tokenizer([text]), normalize=True).numpy()[0]
    z = np.asarray(version.embeddings, np.float64)
    s = z @ reference.astype(np.float64)
    tau = record["temperature"]
    p = np.exp(s / tau - np.logaddexp.reduce(s / tau))
    order = np.argsort(-s, kind="stable")[:5]
    with TestClient(create_app(Settings(index_root=root))) as http:
        r = http.post("/v1/search/text", json={"text": text, "k": 5})
        assert r.status_code == 200, r.text
        hits = r.json()["results"]
    assert [h["row"] for h in hits] == order.tolist()
    np.testing.assert_allclose([h["similarity"] for h in hits], s[order], atol=2e-5)
    np.testing.assert_allclose([h["probability"] for h in hits], p[order], atol=1e-6)
