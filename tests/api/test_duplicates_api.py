"""`softsearch dedup` on a real folder with planted edited copies, then GET /v1/duplicates and /duplicates."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from api_helpers import make_checkpoint
from fastapi.testclient import TestClient
from PIL import Image

from api.app import create_app
from api.cli import main
from api.client import SoftsearchClient, SoftsearchError
from api.config import Settings
from index.store import IndexStore
from search.duplicates.edits import edited_copy
from training.images import load_rgb


@pytest.fixture(scope="module")
def scanned(tmp_path_factory, make_image_folder):
    base = tmp_path_factory.mktemp("dedup")
    folder = make_image_folder(base / "photos", count=40, classes=2, size=48)
    rng = np.random.default_rng(0)
    originals = sorted(folder.rglob("*.png"))[:4]
    copies = []
    for path in originals:
        data, _ = edited_copy(Image.fromarray(load_rgb(path)), rng, edits=("jpeg", "colour"))
        copy = path.with_name(path.stem + (".copy.jpg" if data[:2] == b"\xff\xd8" else ".copy.png"))
        copy.write_bytes(data)
        copies.append(copy)
    ck = make_checkpoint(base / "enc.safetensors", seed=1)
    root = base / "index"
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
    return {
        "root": root,
        "folder": folder,
        "out": base / "dups.json",
        "originals": originals,
        "copies": copies,
    }


def test_dedup_writes_groups_that_the_api_serves_with_notes_threshold_and_highest_p(scanned, capsys):
    root = scanned["root"]
    store = IndexStore(root)
    version = store.current_version()
    with TestClient(create_app(Settings(index_root=root))) as http:
        ss = SoftsearchClient(http=http)
        with pytest.raises(SoftsearchError) as err:  # not scanned yet: 404 saying what to run
            ss._call("GET", "/v1/duplicates")
        assert err.value.status == 404 and "softsearch dedup" in err.value.detail
        assert main(["dedup", "--index", str(root), "--out", str(scanned["out"]), "--no-progress"]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith(f"dedup {version}:") and "highest p" in line
        data = json.loads(store.duplicates_path(version).read_text())
        assert data == json.loads(scanned["out"].read_text())
        assert data["threshold"] == 0.5 and data["count"] == 44 and data["threshold_rule"] == "default"
        # the planted JPEG / colour copies are found, each with its original (folder ids are relative paths)
        rel = lambda p: p.relative_to(scanned["folder"]).as_posix()  # noqa: E731
        pairs = {frozenset((q["a"], q["b"])) for g in data["groups"] for q in g["pairs"]}
        planted = {frozenset((rel(o), rel(c))) for o, c in zip(scanned["originals"], scanned["copies"])}
        assert len(planted & pairs) >= 3
        for g in data["groups"]:
            assert len(g["ids"]) >= 2 and g["confidence"] >= 0.5 - 1e-12
            assert g["confidence"] == pytest.approx(min(q["p_ab"] for q in g["pairs"]))
        assert data["max_probability"] == pytest.approx(
            max(q["p_ab"] for g in data["groups"] for q in g["pairs"])
        )
        body = ss._call("GET", "/v1/duplicates", params={"limit": 1}).json()
        assert body["version"] == version and body["total_groups"] == len(data["groups"])
        assert body["groups"] == data["groups"][:1]
        assert body["threshold"] == 0.5 and body["max_probability"] == data["max_probability"]
        assert body["notes"] == data["notes"] and body["skipped"] == []
        # the usual rules beside the scan: cosine >= 0.99 against brute force on the stored embeddings
        assert body["baselines"] == data["baselines"] and data["baselines"][:2] == [
            {**b, "name": n} for b, n in zip(data["baselines"][:2], ("dHash", "pHash"))
        ]
        emb = np.asarray(store.load(version, verify=False, gpu=False).embeddings, np.float64)
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        cos = emb @ emb.T
        want = int((np.triu(cos, 1) >= 0.99).sum())
        assert [b["pairs"] for b in data["baselines"] if b["name"] == "cosine"] == [want]
        page = ss.http.get("/duplicates")
        assert (
            page.status_code == 200
            and "Duplicates in index version" in page.text
            and "data:image/png" in page.text
        )
        assert "The usual rules on the same items" in page.text


def test_a_precision_threshold_is_a_probability_the_scan_found(scanned):
    root = scanned["root"]
    store = IndexStore(root)
    assert (
        main(
            [
                "dedup",
                "--index",
                str(root),
                "--precision",
                "0.97",
                "--calibration-items",
                "100",
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads(store.duplicates_path(store.current_version()).read_text())
    found = [q["p_ab"] for g in data["groups"] for q in g["pairs"]]
    if data["threshold_rule"].startswith("lowest p"):
        assert data["threshold"] in found and np.mean([p for p in found if p >= data["threshold"]]) >= 0.97
    else:
        assert any("no pairs are expected" in n for n in data["notes"])


def test_an_unreachable_threshold_is_reported_with_the_highest_p(scanned):
    root = scanned["root"]
    store = IndexStore(root)
    assert (
        main(
            [
                "dedup",
                "--index",
                str(root),
                "--threshold",
                "0.999999999",
                "--calibration-items",
                "100",
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads(store.duplicates_path(store.current_version()).read_text())
    if data["max_probability"] < data["threshold"]:
        assert data["groups"] == [] and any(f"{data['max_probability']:.3g}" in n for n in data["notes"])
    with TestClient(create_app(Settings(index_root=root))) as http:
        assert http.get("/v1/duplicates").json()["notes"] == data["notes"]


def test_dedup_user_mistakes_are_one_line(scanned, tmp_path, capsys):
    for argv, needle in (
        (["--threshold", "1.5"], "--threshold must be in (0, 1)"),
        (["--precision", "0"], "--precision must be in (0, 1)"),
        (["--threshold", "0.5", "--precision", "0.9"], "not both"),
        (["--calibration-items", "3"], "calibration_items must be >= 20"),
    ):
        assert main(["dedup", "--index", str(scanned["root"]), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]
    assert main(["dedup", "--index", str(tmp_path / "nope")]) == 2
    assert "error:" in capsys.readouterr().err


def test_an_unreadable_file_is_skipped_and_reported(scanned, tmp_path):
    """A file corrupted after indexing is left out of the scan and listed, in the JSON and by the API."""
    root = tmp_path / "index"
    shutil.copytree(scanned["root"], root)
    folder = tmp_path / "photos"
    shutil.copytree(scanned["folder"], folder)
    store = IndexStore(root)
    # the copied store still points at the module's folder: corrupt a file there and restore it afterwards
    victim = sorted(scanned["folder"].rglob("*.png"))[-1]
    saved = victim.read_bytes()
    try:
        victim.write_bytes(b"not an image")
        assert main(["dedup", "--index", str(root), "--calibration-items", "100", "--no-progress"]) == 0
    finally:
        victim.write_bytes(saved)
    data = json.loads(store.duplicates_path(store.current_version()).read_text())
    assert [s["id"] for s in data["skipped"]] == [victim.relative_to(scanned["folder"]).as_posix()]
    assert any("unreadable" in n for n in data["notes"])
    assert all(data["skipped"][0]["id"] not in g["ids"] for g in data["groups"])
    with TestClient(create_app(Settings(index_root=root))) as http:
        assert http.get("/v1/duplicates").json()["skipped"] == data["skipped"]


def test_a_scan_in_the_older_format_is_refused_with_what_to_run(scanned, tmp_path):
    root = tmp_path / "index"
    shutil.copytree(scanned["root"], root)
    store = IndexStore(root)
    path = store.duplicates_path(store.current_version())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": "softsearch-duplicates", "groups": []}))
    with TestClient(create_app(Settings(index_root=root))) as http:
        r = http.get("/v1/duplicates")
        assert r.status_code == 404 and "softsearch dedup" in r.text


def test_index_add_reports_new_duplicates_after_a_scan(scanned, tmp_path, capsys):
    """After `softsearch dedup`, `index add` says which new items duplicate indexed ones: a byte-identical
    copy of an indexed file is reported with that file."""
    root = scanned["root"]
    assert main(["dedup", "--index", str(root), "--calibration-items", "100", "--no-progress"]) == 0
    extra = tmp_path / "extra"  # class folders like the indexed ones (the quality gate scores by class)
    originals = sorted(scanned["folder"].rglob("*.png"))[10:12]
    for n, original in enumerate(originals):
        (extra / f"class{n}").mkdir(parents=True)
        shutil.copy2(original, extra / f"class{n}" / f"again{n}.png")
    capsys.readouterr()
    assert (
        main(
            [
                "index",
                "add",
                "--root",
                str(root),
                "--dataset",
                "folder",
                "--split",
                "all",
                "--data-root",
                str(extra),
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "duplicate pairs among 2 new items" in out
    for n, original in enumerate(originals):
        lines = [ln for ln in out.splitlines() if ln.startswith("duplicate:") and f"again{n}.png" in ln]
        assert any(original.relative_to(scanned["folder"]).as_posix() in ln for ln in lines)


def test_dedup_with_the_copy_encoder_is_served_with_its_readout(scanned, tmp_path):
    """`softsearch dedup --verifier encoder` (a copy of the module's index, so the other tests' scan stays):
    the JSON names the verifier and carries the copy model instead of the pixel one, GET /v1/duplicates
    answers with the held-apart copies' recall from it, and the page says what decided the pairs."""
    root = tmp_path / "index"
    shutil.copytree(scanned["root"], root)
    store = IndexStore(root)
    assert main(["dedup", "--index", str(root), "--verifier", "encoder", "--no-progress"]) == 0
    data = json.loads(store.duplicates_path(store.current_version()).read_text())
    assert data["config"]["verifier"] == "encoder" and data["model"] is None
    copy = data["copy_model"]
    assert copy["scale"] > 0 and 0 < copy["prior"] < 1 and 0 <= copy["copy_recall"] <= 1
    assert all(0.0 <= q["p_ab"] <= 1.0 for g in data["groups"] for q in g["pairs"])
    with TestClient(create_app(Settings(index_root=root))) as http:
        body = http.get("/v1/duplicates").json()
        assert body["copy_recall"] == pytest.approx(copy["copy_recall"])
        page = http.get("/duplicates")
        assert page.status_code == 200 and "copy detector trained on this collection" in page.text
