"""Text queries end to end: a (briefly) trained image-text checkpoint, `index build` storing the text tower
and a calibrated text temperature, HTTP text search equal to the offline search and to numpy brute force, the
client, `softsearch search --text`, and 409 on a version without a text tower."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import gate_calibrator
from api.cli import main as cli_main
from api.client import SoftsearchClient, SoftsearchError
from api.config import Settings
from index.build import BuildOptions, build_index
from index.store import IndexStore
from search.serving.searcher import Searcher
from search.serving.text import search_text
from training.checkpoint import load_checkpoint
from training.config import TrainConfig
from training.datasets import create_dataset
from training.encoder import EncoderConfig
from training.text import load_text_encoder
from training.trainer import train

TEXTS = ["a red disc at the top, light from the east", "light from the south, a blue disc at the lower left"]


@pytest.fixture(scope="module")
def text_store(tmp_path_factory):
    base = tmp_path_factory.mktemp("text_search")
    config = TrainConfig(
        dataset="synthetic",
        dataset_size=96,
        steps=3,
        batch_size=32,
        warmup_steps=1,
        encoder=EncoderConfig(embed_dim=16, width=16, layers=1, heads=2, patch_size=8),
        text={"width": 16, "layers": 1, "heads": 2, "context_length": 20},
        out_dir=str(base / "run"),
        progress=False,
        device="cpu",
    )
    ck = train(config)
    ds = create_dataset("synthetic", split="test", size=80, seed=0)
    root = base / "index"
    build_index(ck, ds, root, BuildOptions(progress=False, calibrator=gate_calibrator))
    version = IndexStore(root).load(verify=False, gpu=False)
    return {"root": root, "checkpoint": ck, "version": version, "base": base}


@pytest.fixture(scope="module")
def ss(text_store):
    with TestClient(create_app(Settings(index_root=text_store["root"]))) as http:
        yield SoftsearchClient(http=http), http


def test_checkpoint_holds_both_towers(text_store):
    enc, meta = load_checkpoint(text_store["checkpoint"])
    text = load_text_encoder(text_store["checkpoint"])
    assert meta["text"]["config"]["width"] == 16 and text.embed_dim == enc.embed_dim == 16
    assert meta["lineage"]["objective"] == "clip-symmetric infonce"
    z = text.encode(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)
    # one file, both towers: the image reader takes the un-prefixed tensors, the text reader the text.* ones
    from safetensors import safe_open

    with safe_open(str(text_store["checkpoint"]), framework="pt") as fh:
        keys = set(fh.keys())
    assert {k for k in keys if not k.startswith("text.")} == set(enc.state_dict())
    assert {k[len("text.") :] for k in keys if k.startswith("text.")} == set(text.state_dict())


def test_manifest_records_calibrated_text_temperature(text_store):
    record = text_store["version"].manifest.extra["text"]
    assert record["exact"] is True and record["temperature"] > 0
    assert record["model_sha256"] == text_store["version"].manifest.checkpoint_record.sha256
    assert 0 < record["n_queries"] <= 500


def _brute(z, q, tau):
    s = z.astype(np.float64) @ q.astype(np.float64)
    p = np.exp(s / tau - np.logaddexp.reduce(s / tau))
    order = np.argsort(-s, kind="stable")
    return order, p[order]


def test_http_text_search_equals_offline_and_brute_force(ss, text_store):
    client, _ = ss
    version = text_store["version"]
    snap = Searcher(text_store["root"], optimise_encoder=False, load=True).snapshot()
    offline = search_text(snap, TEXTS, 10)
    tau = version.manifest.extra["text"]["temperature"]
    text = load_text_encoder(text_store["checkpoint"])
    z = np.asarray(version.embeddings)
    for t, hits in zip(TEXTS, offline):
        answer = client.search_text(t, k=10)
        assert answer.temperature == pytest.approx(tau, rel=1e-12)
        assert [h.id for h in answer.results] == [h.id for h in hits]
        np.testing.assert_allclose(
            [h.probability for h in answer.results], [h.probability for h in hits], atol=1e-6
        )
        rows, p = _brute(z, text.encode([t])[0], tau)
        assert [h.row for h in answer.results] == rows[:10].tolist()
        np.testing.assert_allclose([h.probability for h in answer.results], p[:10], atol=1e-6)
    batch = client.search_texts(TEXTS, k=5)
    assert [[h.id for h in r.results] for r in batch] == [[h.id for h in hits[:5]] for hits in offline]


def test_text_search_cutoffs_and_bad_input(ss):
    client, http = ss
    full = client.search_text(TEXTS[0], k=20)
    cut = client.search_text(TEXTS[0], k=20, min_probability=full.results[2].probability)
    assert [h.id for h in cut.results] == [h.id for h in full.results[:3]]
    for body in (
        {"text": ""},
        {"text": "x", "k": 0},
        {"text": "x" * 1001},
        {"k": 3},
        {"text": "x", "bogus": 1},
    ):
        r = http.post("/v1/search/text", json=body)
        assert r.status_code == 422, body
        assert "detail" in r.json() or "error" in r.json()
    r = http.post("/v1/search/text", json={"text": "x", "filter": {"nope": {"eq": 1}}})
    assert r.status_code == 422


def test_cli_search_text_matches_offline(text_store, capsys):
    assert (
        cli_main(["search", "--index", str(text_store["root"]), "--text", TEXTS[0], "-k", "5", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    snap = Searcher(text_store["root"], optimise_encoder=False, load=True).snapshot()
    hits = search_text(snap, [TEXTS[0]], 5)[0]
    assert [h["id"] for h in out["results"]] == [h.id for h in hits]
    assert cli_main(["search", "--index", str(text_store["root"]), "--text", " "]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_version_without_text_tower_answers_409(tmp_path):
    from api_helpers import make_checkpoint

    ck = make_checkpoint(tmp_path / "enc.safetensors", seed=1)
    root = tmp_path / "index"
    build_index(
        ck, create_dataset("synthetic", split="test", size=40, seed=0), root, BuildOptions(progress=False)
    )
    with TestClient(create_app(Settings(index_root=root))) as http:
        r = http.post("/v1/search/text", json={"text": "a red disc"})
        assert r.status_code == 409
        assert "no text tower" in r.json()["detail"] and "\n" not in r.json()["detail"]
        with pytest.raises(SoftsearchError) as err:
            SoftsearchClient(http=http).search_text("a red disc")
        assert err.value.status == 409
    assert cli_main(["search", "--index", str(root), "--text", "a red disc"]) == 2


@pytest.mark.slow
def test_page_text_box_shows_the_text_search(tmp_path, text_store):
    """Type words in the page's text box (headless Chromium): the grid is the HTTP text search's answer."""
    from test_web_page import CHROMEDRIVER, CHROMIUM, page_on

    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("headless browser test needs Debian 'chromium' and 'chromium-driver' (make system-deps)")
    from selenium.webdriver.common.by import By

    ids_js = "return Array.from(document.querySelectorAll('#results .result')).map(c => c.dataset.id);"
    app = create_app(Settings(index_root=text_store["root"]))
    with page_on(app, tmp_path) as (driver, wait, url):
        expected = SoftsearchClient(url).search_text(TEXTS[1], k=12)
        wait.until(lambda d: d.find_element(By.ID, "version").text.startswith("index "))
        driver.find_element(By.ID, "text-query").send_keys(TEXTS[1])
        driver.find_element(By.ID, "text-search").click()
        wait.until(lambda d: d.execute_script(ids_js) == [h.id for h in expected.results])
        meta = driver.find_element(By.ID, "result-meta").text
        shown_tau = float(meta.split("tau ")[1].split()[0])
        assert shown_tau == pytest.approx(expected.temperature, rel=5e-3)  # the calibrated text temperature
        # an empty box says so instead of searching
        driver.find_element(By.ID, "text-query").clear()
        driver.find_element(By.ID, "text-search").click()
        wait.until(lambda d: "type some words" in d.find_element(By.ID, "status").text)


def test_added_and_deleted_versions_keep_the_text_temperature(tmp_path, text_store):
    import shutil

    from index.build import add_items
    from index.options import EmbedOptions
    from index.sync import delete_items

    root = tmp_path / "index"
    shutil.copytree(text_store["root"], root)
    record = text_store["version"].manifest.extra["text"]
    extra = create_dataset("synthetic", split="test", size=90, seed=0)  # 10 new items after the 80
    added = add_items(root, extra, embed=EmbedOptions(progress=False))
    store = IndexStore(root)
    assert store.load(added, verify=False, gpu=False).manifest.extra["text"] == record
    gone, _ = delete_items(root, [store.load(added, verify=False, gpu=False).ids[0]])
    assert store.load(gone, verify=False, gpu=False).manifest.extra["text"] == record
