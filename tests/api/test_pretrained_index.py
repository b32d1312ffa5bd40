"""An index built straight from pretrained open_clip weights, without training
(`softsearch index build --encoder open_clip:NAME --pretrained FILE`), with the model's own
preprocessing, serves; its embeddings equal open_clip's own pipeline on the same files."""

from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch
from api_helpers import png_bytes
from fastapi.testclient import TestClient
from PIL import Image

from api.app import create_app
from api.cli import main
from api.config import Settings
from index.manifest import file_sha256
from index.store import IndexStore

SIZE = 64  # a reduced input size (open_clip resizes the position embeddings) keeps this quick on CPU


def test_index_from_pretrained_weights_serves(tmp_path, open_clip_weights, make_image_folder):
    folder = make_image_folder(tmp_path / "photos", count=24, classes=3, size=SIZE)
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
    store = IndexStore(root)
    version = store.load()
    m = version.manifest
    assert m.encoder["model_name"] == open_clip_weights["name"] and m.encoder["image_size"] == SIZE
    assert m.encoder["image_mean"] == pytest.approx(open_clip.OPENAI_DATASET_MEAN)
    assert m.lineage["pretrained"]["sha256"] == file_sha256(weights)
    assert m.checkpoint.path is None and store.models.shas() == [m.checkpoint.sha256]
    assert not list(store.staging_dir.glob("pretrained-*"))  # the temporary checkpoint is gone
    assert m.search_temperature > 0 and m.count == 24

    # independent reference: open_clip itself, its own transform, the same files
    model = open_clip.create_model(
        open_clip_weights["name"], pretrained=str(weights), force_image_size=SIZE, pretrained_text=False
    ).eval()
    cfg = open_clip.get_model_preprocess_cfg(model)
    transform = open_clip.image_transform(SIZE, is_train=False, mean=cfg["mean"], std=cfg["std"])
    images = [Image.open(folder / item).convert("RGB") for item in version.ids]
    with torch.no_grad():
        reference = model.encode_image(torch.stack([transform(im) for im in images]), normalize=True).numpy()
    np.testing.assert_allclose(version.embeddings, reference, atol=2e-5)

    with TestClient(create_app(Settings(index_root=root))) as client:
        assert client.get("/readyz").status_code == 200
        assert client.get("/healthz").json()["version"] == version.version
        for row in (0, 13):
            r = client.post(
                "/v1/search", files={"file": ("q.png", png_bytes(images[row]), "image/png")}, data={"k": "3"}
            )
            assert r.status_code == 200, r.text
            top = r.json()["results"][0]
            assert top["id"] == version.ids[row] and top["similarity"] == pytest.approx(1.0, abs=1e-4)


def test_build_from_pretrained_user_errors(tmp_path, capsys, open_clip_weights):
    weights = str(open_clip_weights["files"]["bin"])
    cases = [
        (["--encoder", "open_clip:ViT-S-32-alt"], "needs --pretrained FILE"),
        (["--encoder", "timm:resnet50", "--pretrained", weights], "expected open_clip:MODEL_NAME"),
        (["--encoder", "open_clip:NoSuchNet", "--pretrained", weights], "unknown open_clip model_name"),
        (
            ["--encoder", "open_clip:ViT-S-32-alt", "--pretrained", str(tmp_path / "nope.bin")],
            "not a local file",
        ),
        (
            ["--encoder", "open_clip:ViT-S-32-alt", "--pretrained", weights, "--image-mean", "1,2"],
            "three comma",
        ),
        ([], "give --checkpoint C, or --encoder"),
    ]
    for extra, message in cases:
        argv = [
            "index",
            "build",
            "--root",
            str(tmp_path / "r"),
            "--dataset",
            "synthetic",
            "--size",
            "8",
            *extra,
        ]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
