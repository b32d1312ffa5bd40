"""A user's own image folder through the real `softsearch` commands: train -> index build -> eval -> serve.

Real clip art (a subset of Debian's tuxpaint-stamps-default: RGBA, grey+alpha and palette PNGs
of every size) in train/ and test/ with class subfolders, plus what users' folders hold: a
600-megapixel PNG, a truncated PNG and a text file named .png in train/ AND test/, an RGBA
palette PNG, a CMYK JPEG and an EXIF-rotated JPEG. Every command exits 0, each bad file is
listed once with its reason, and an uploaded copy of an indexed file finds itself.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import httpx
import image_files as F
import pytest

from api.cli import main
from api.launch import serve_process
from training.images import load_rgb

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "folder.toml"
CATEGORIES = ["animals", "food", "symbols", "town"]

pytestmark = pytest.mark.skipif(
    not F.TUXPAINT_STAMPS.is_dir(), reason="tuxpaint-stamps-default not installed"
)


def _folder(root: Path) -> tuple[dict, dict]:
    F.tuxpaint_folder(root, CATEGORIES, per_class=15)  # 12 train + 3 test per class
    bad_train = {f"train/animals/{k}": v for k, v in F.bad_files(root / "train" / "animals").items()}
    bad_test = {f"test/food/{k}": v for k, v in F.bad_files(root / "test" / "food", "_t").items()}
    F.rgba_palette_png(root / "train" / "symbols" / "palette.png")
    F.cmyk_jpeg(root / "train" / "food" / "cmyk.jpg")
    F.exif_rotated_jpeg(root / "train" / "town" / "rotated.jpg")
    return bad_train, bad_test


def _reasons(items: list[dict]) -> dict:
    ids = [s["id"] for s in items]
    assert len(ids) == len(set(ids)), f"a file is listed twice: {ids}"
    return {s["id"]: s["reason"] for s in items}


@pytest.mark.slow
def test_folder_train_index_eval_serve(tmp_path, caplog, capsys):
    img = tmp_path / "img"
    bad_train, bad_test = _folder(img)
    run = tmp_path / "run"

    with caplog.at_level(logging.INFO):
        assert (
            main(
                [
                    "train",
                    "--config",
                    str(CONFIG),
                    "--set",
                    f'data_root="{img}"',
                    "--set",
                    f'out_dir="{run / "train"}"',
                    "--set",
                    "steps=4",
                    "--set",
                    "batch_size=16",
                    "--set",
                    "warmup_steps=1",
                    "--set",
                    "checkpoint_every=1000",
                    "--set",
                    "progress=false",
                    "--set",
                    "num_workers=0",
                    "--set",
                    "cache_workers=1",
                ]
            )
            == 0
        )
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "skipped" in r.getMessage()
    ]
    assert len(warnings) == 1 and "3 file(s) skipped" in warnings[0], warnings  # one summary line
    assert _reasons(json.loads((run / "train" / "skipped.json").read_text())) == bad_train
    ckpt = run / "train" / "checkpoint.safetensors"
    assert ckpt.is_file()

    index = run / "index"
    build = [
        "index",
        "build",
        "--root",
        str(index),
        "--checkpoint",
        str(ckpt),
        "--dataset",
        "folder",
        "--data-root",
        str(img),
        "--split",
        "train",
        "--no-progress",
    ]
    capsys.readouterr()
    assert main(build) == 0
    assert "3 skipped" in capsys.readouterr().out
    assert main(build + ["--force"]) == 0  # a second version: the quality gate runs against the first
    versions = sorted((index / "versions").iterdir())
    first, second = (json.loads((v / "manifest.json").read_text()) for v in versions)
    for m in (first, second):
        assert _reasons(m["skipped"]) == bad_train and m["count"] == 48 + 3
        assert "train/food/cmyk.jpg" in json.loads(
            (index / "versions" / m["version"] / "ids.json").read_text()
        )
    assert first["calibration"]["skipped_queries"] == 3  # test/'s bad files, counted
    gate = second["quality_gate"]
    assert (
        gate["details"]["candidate"]["skipped_queries"] == 3
        and gate["details"]["candidate"]["n_queries"] == 12
    )

    assert (
        main(["eval", "--index", str(index), "--out", str(run / "eval"), "--no-k-law", "--n-boot", "20"]) == 0
    )
    assert "3 held-out" in capsys.readouterr().out
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["generator"]["name"] == "label" and report["queries"]["count"] == 12
    assert report["queries"]["skipped"] == 3 and _reasons(report["queries"]["skipped_files"]) == bad_test
    assert report["database"]["skipped"] == 3

    log_path = tmp_path / "serve.log"
    with serve_process(
        index, log_path=log_path, timeout_s=180, poll_s=0.5, stop_signal=signal.SIGINT, stop_timeout_s=60
    ) as server:
        url = server.url

        def upload(path: Path):
            return httpx.post(
                url + "/v1/search",
                files={"file": (path.name, path.read_bytes())},
                data={"k": "3"},
                timeout=60,
            )

        stamp = sorted((img / "train" / "town").rglob("*.png"))[0]
        for path, item in (
            (stamp, stamp.relative_to(img).as_posix()),
            (img / "train/food/cmyk.jpg", "train/food/cmyk.jpg"),
            (img / "train/town/rotated.jpg", "train/town/rotated.jpg"),
        ):
            r = upload(path)
            assert r.status_code == 200, r.text
            assert r.json()["results"][0]["id"] == item and r.json()["results"][0][
                "similarity"
            ] == pytest.approx(1.0, abs=1e-4)
        for name, (status, code) in {
            "huge.png": (413, "image_too_large"),
            "truncated.png": (400, "corrupt_image"),
            "notes.png": (400, "not_an_image"),
        }.items():
            r = upload(img / "train" / "animals" / name)
            assert (r.status_code, r.json()["error"]) == (status, code), r.text
        r = httpx.get(url + "/v1/items/train%2Ftown%2Frotated.jpg/thumbnail", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        shown = load_rgb(r.content)
        assert shown.shape == (32, 16, 3) and shown[:14].mean() > 240  # EXIF-rotated: tall, white on top
    assert server.proc.returncode == 0, server.log_tail(2000)
    assert "Traceback" not in server.log
