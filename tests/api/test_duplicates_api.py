"""`softsearch dedup` on a real folder with planted edited copies, then GET /v1/duplicates and /duplicates."""
from __future__ import annotations

import dataclasses
import json
import re

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
from search.duplicates.page import _calibration_axes
from search.evaluation.figures import pyplot
from training.images import load_rgb


@pytest.fixture(scope="module")
def scanned(tmp_path_factory, make_image_folder):
    base = tmp_path_factory.mktemp("dedup")
    folder = make_image_folder(base / "photos", count=40, classes=2, size=48)
    rng = np.random.default_rng(0)
    originals = sorted(folder.rglob("*.png"))[:4]
    for path in originals:
        data, _ = edited_copy(Image.fromarray(load_rgb(path)), rng)
        path.with_name(path.stem + ".copy.jpg" if data[:2] == b"\xff\xd8" else path.stem + ".copy.png").write_bytes(data)
    ck = make_checkpoint(base / "enc.safetensors", seed=1)
    root = base / "index"
    assert main(["index", "build", "--root", str(root), "--checkpoint", str(ck), "--dataset", "folder", "--split", "all",
                 "--data-root", str(folder), "--no-progress"]) == 0
    return {"root": root, "folder": folder, "out": base / "dups.json"}


def test_dedup_writes_groups_that_the_api_serves(scanned, capsys):
    root = scanned["root"]
    store = IndexStore(root)
    version = store.current_version()
    with TestClient(create_app(Settings(index_root=root))) as http:
        ss = SoftsearchClient(http=http)
        with pytest.raises(SoftsearchError) as err:          # not scanned yet: 404 saying what to run
            ss._call("GET", "/v1/duplicates")
        assert err.value.status == 404 and "softsearch dedup" in err.value.detail
        assert main(["dedup", "--index", str(root), "--calibration-items", "15", "--threshold", "0.5",
                     "--out", str(scanned["out"]), "--no-progress"]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith(f"dedup {version}:") and "held-out ECE" in line
        data = json.loads(store.duplicates_path(version).read_text())
        assert data == json.loads(scanned["out"].read_text())
        assert data["threshold"] == 0.5 and data["count"] == 44 and data["temperature"] > 0
        cal = data["calibration"]
        assert cal["fitted_on"] == cal["held_out"] == 30 and 0 <= cal["ece"] <= 1   # every query held out once
        for g in data["groups"]:   # every member's original is among the others with p >= the threshold
            assert len(g["ids"]) >= 2 and g["confidence"] >= 0.5 - 1e-9
            assert all(p["p_ab"] > 0 and p["p_ba"] > 0 for p in g["pairs"])
        body = ss._call("GET", "/v1/duplicates", params={"limit": 1}).json()
        assert body["version"] == version and body["total_groups"] == len(data["groups"])
        assert body["groups"] == data["groups"][:1]
        page = ss.http.get("/duplicates")
        assert page.status_code == 200 and "Duplicates in index version" in page.text and "data:image/png" in page.text
        # one threshold on the page: the header's, the figure line's (alt text) and the legend's are the scan's P,
        # not the calibration queries' own precision threshold (which differs here)
        header = re.search(r"at probability &ge; ([0-9.e+-]+?)\. ", page.text).group(1)
        alt = re.search(r"red line: groups kept: p \u2265 ([0-9.e+-]+)'", page.text).group(1)
        assert float(header) == float(alt) == data["threshold"] == 0.5 and cal["threshold"] != 0.5
        fig = _calibration_axes(cal, data["threshold"])
        legend = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
        assert "groups kept: p \u2265 0.5" in legend, legend
        lines = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == "groups kept: p \u2265 0.5"]
        assert len(lines) == 1 and set(lines[0].get_xdata()) == {0.5}
        pyplot().close(fig)


def test_dedup_user_mistakes_are_one_line(scanned, tmp_path, capsys):
    for argv, needle in ((["--threshold", "1.5"], "--threshold must be in (0, 1)"),
                         (["--precision", "0"], "--precision must be in (0, 1)"),
                         (["--min-probability", "1"], "--min-probability must be in [0, 1)")):
        assert main(["dedup", "--index", str(scanned["root"]), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0]
    assert main(["dedup", "--index", str(tmp_path / "nope")]) == 2
    assert "error:" in capsys.readouterr().err


def test_dedup_without_threshold_takes_the_lowest_threshold_expected_to_reach_the_precision(scanned, capsys):
    """No --threshold: P is the lowest group confidence at which the groups kept have a mean confidence that
    reaches --precision, never below --min-probability (default job.MIN_PROBABILITY; 0: the rule alone), checked
    here by brute force on a scan at the lowest level (or, when none does, the calibration's own threshold and a
    note saying so); every group written is at least P sure."""
    from search.duplicates.calibration import LEVELS, DuplicateCalibration
    from search.duplicates.job import MIN_PROBABILITY, find_duplicates
    from search.serving.searcher import Searcher

    root = scanned["root"]
    store = IndexStore(root)
    for floor in (MIN_PROBABILITY, 0.0):
        extra = [] if floor == MIN_PROBABILITY else ["--min-probability", "0"]
        assert main(["dedup", "--index", str(root), "--calibration-items", "15", "--precision", "0.9",
                     "--no-progress", *extra]) == 0
        out = capsys.readouterr().out
        data = json.loads(store.duplicates_path(store.current_version()).read_text())
        calib = DuplicateCalibration.from_json(data["calibration"])
        searcher = Searcher(root)
        searcher.load()
        low = find_duplicates(searcher.snapshot(), calib, threshold=min(LEVELS), progress=False)
        conf = np.array([g["confidence"] for g in low["groups"]])
        ok = sorted(min(t, 0.9999) for t in conf if conf[conf >= t].mean() >= 0.9)   # P < 1
        if ok:
            assert data["threshold"] == pytest.approx(max(ok[0], floor)) and "note:" not in out
        else:
            assert data["threshold"] == calib.threshold and "note: no groups" in out
        assert all(g["confidence"] >= data["threshold"] - 1e-9 for g in data["groups"])


def test_a_second_scan_of_one_calibration_verifies_no_pair_again(scanned, monkeypatch):
    """The default threshold's scan and the final scan share the verified pair scores (job.scores_cache): the
    second scan calls verify.match zero times and finds exactly what a scan without the cache finds."""
    from search.duplicates import verify
    from search.duplicates.calibration import LEVELS
    from search.duplicates.job import calibrate_snapshot, find_duplicates, scores_cache
    from search.serving.searcher import Searcher

    searcher = Searcher(scanned["root"])
    searcher.load()
    snap = searcher.snapshot()
    calib = calibrate_snapshot(snap, "verified", items=15, precision=0.9, progress=False)
    calls = []
    real_match = verify.match
    monkeypatch.setattr(verify, "match", lambda a, b: calls.append(1) or real_match(a, b))
    cache = scores_cache(snap, calib)
    low = find_duplicates(snap, calib, threshold=min(LEVELS), progress=False, cache=cache)
    first = len(calls)
    assert first > 0 and cache.known.all()
    high = find_duplicates(snap, calib, threshold=0.95, progress=False, cache=cache)
    assert len(calls) == first                                  # nothing verified twice
    for p, cached in ((min(LEVELS), low), (0.95, high)):
        fresh = find_duplicates(snap, calib, threshold=p, progress=False)
        assert [g["ids"] for g in cached["groups"]] == [g["ids"] for g in fresh["groups"]]
        assert [g["confidence"] for g in cached["groups"]] == pytest.approx([g["confidence"] for g in fresh["groups"]])
    assert scores_cache(snap, dataclasses.replace(calib, stage="encoder")) is None


def test_index_add_reports_new_duplicates_after_a_scan(scanned, tmp_path, capsys):
    """After `softsearch dedup`, `index add` says which new items duplicate indexed ones (a byte-identical
    copy of an indexed file has similarity 1 to it: its group must include that file)."""
    import shutil

    root = scanned["root"]
    if not IndexStore(root).duplicates_path(IndexStore(root).current_version()).is_file():
        assert main(["dedup", "--index", str(root), "--calibration-items", "15", "--threshold", "0.5",
                     "--no-progress"]) == 0
    extra = tmp_path / "extra"   # class folders like the indexed ones (the quality gate scores by class)
    originals = sorted(scanned["folder"].rglob("*.png"))[10:12]
    for n, original in enumerate(originals):
        (extra / f"class{n}").mkdir(parents=True)
        shutil.copy2(original, extra / f"class{n}" / f"again{n}.png")
    capsys.readouterr()
    assert main(["index", "add", "--root", str(root), "--dataset", "folder", "--split", "all",
                 "--data-root", str(extra), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "duplicate groups among 2 new items" in out
    for n, original in enumerate(originals):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"duplicate: class{n}/again{n}.png")), None)
        if line is not None:
            assert original.relative_to(scanned["folder"]).as_posix() in line


def test_dedup_with_the_collection_prior_reweighs_by_the_share_it_reports(scanned, capsys):
    """The collection prior (the default): the share of items with a duplicate is estimated from the scan (EM),
    reported, and the written calibration is the calibration prior's with its bias moved by Bayes' rule to that
    share; the API says which prior the probabilities assume. The encoder stage cannot estimate it: an error."""
    import math

    root = scanned["root"]
    store = IndexStore(root)
    version = store.current_version()
    runs = {}
    for prior in ("calibration", "collection"):   # the collection's is the default at the verified stage
        chosen = ["--prior", prior] if prior == "calibration" else []
        assert main(["dedup", "--index", str(root), "--calibration-items", "15", "--threshold", "0.5",
                     *chosen, "--no-progress"]) == 0
        assert "items with a duplicate:" in capsys.readouterr().out
        runs[prior] = json.loads(store.duplicates_path(version).read_text())
    base, shifted = runs["calibration"], runs["collection"]
    share, pi0 = shifted["collection_share"], shifted["design_share"]
    assert base["prior"] == "calibration" and shifted["prior"] == "collection"
    assert 0 < share < 1 and share == pytest.approx(base["collection_share"]) and 0 < pi0 < 1
    tau = base["temperature"]
    assert shifted["temperature"] == tau
    assert shifted["bias"] == pytest.approx(base["bias"] + tau * (math.log((1 - share) / (1 - pi0))
                                                                  - math.log(share / pi0)))
    with TestClient(create_app(Settings(index_root=root))) as http:
        body = http.get("/v1/duplicates").json()
        assert body["prior"] == "collection" and body["collection_share"] == pytest.approx(share)
        page = http.get("/duplicates").text
        assert f"about {share:.1%} of this collection" in page and "assume this collection's share" in page
    assert main(["dedup", "--index", str(root), "--stage", "encoder", "--prior", "collection"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prior collection needs the verified stage" in err[0]


def test_verified_calibration_negatives_are_the_items_themselves_searched_without_themselves(scanned):
    """The "none" queries are the pairs a scan judges for an item with no duplicate: the sampled item itself (not an
    edited copy of it) against its nearest other items, never itself. Checked against a second computation: the
    sample drawn again with the same seed, each query's candidates re-verified from the item's own pixels."""
    from search.duplicates import verify
    from search.duplicates.job import hard_negative_sample, item_thumb, verified_calibration_queries
    from search.serving.searcher import Searcher

    searcher = Searcher(scanned["root"])
    searcher.load()
    snap = searcher.snapshot()
    items, seed = 15, 3
    queries, _ = verified_calibration_queries(snap, items, seed, progress=False)
    rng = np.random.default_rng(seed)
    m = min(items, snap.count // 2)
    rng.permutation(snap.count)
    rows, weights = hard_negative_sample(snap.index, m, rng)
    negatives = queries[m:]
    assert len(negatives) == m and all(q.source == -1 for q in negatives)
    checked = 0
    for q, row, weight in zip(negatives, rows, weights):
        assert q.weight == pytest.approx(weight) and int(row) not in q.top_rows.tolist()
        if q.top.size:
            own = item_thumb(snap, int(row))
            best = verify.match(own, item_thumb(snap, int(q.top_rows[0])))
            assert q.top[0] == pytest.approx(float(verify.evidence(best.ncc)), abs=1e-9)
            checked += 1
    assert checked > 0
