import json
import re

import numpy as np
import pytest
import torch

from search.evaluation.calibration import calibrate_temperature
from search.evaluation.evaluate import main
from search.evaluation.gap import softmax_gap
from search.evaluation.metrics import retrieval_metrics
from search.evaluation.report import SECTIONS
from training.checkpoint import load_checkpoint, save_checkpoint
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder, embed

TINY = EncoderConfig(embed_dim=8, width=16, layers=1, heads=2, patch_size=8)


def _ckpt(path, seed, tau):
    torch.manual_seed(seed)
    enc = create_encoder(TINY)
    return save_checkpoint(
        path,
        enc,
        step=0,
        train_config={"seed": seed, "steps": 7},
        lineage={"objective": "infonce", "generator": {"name": "label", "options": {}}},
        metrics={"temperature": tau},
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    return _ckpt(d / "a.safetensors", 0, 0.2), _ckpt(d / "b.safetensors", 1, 0.1)


def _check_html(path, sections=SECTIONS, n_img=5):
    text = path.read_text()
    for s in sections:
        assert f"<section id='{s}'>" in text, s
    imgs = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert len(imgs) >= n_img
    assert "http://" not in text and "https://" not in text  # self-contained
    # every plot has a caption underneath; the tail section opens with the threshold-stability plot
    assert text.count("<figcaption>") == len(imgs)
    tail = text.split("<section id='tail'>", 1)[1]
    assert tail.index("alt='threshold stability'") < tail.index("<table")
    settings = text.split("<section id='settings'>", 1)[1].split("</section>", 1)[0]
    for needed in ("embedding dimension d", "regulariser weight", "random projections", "level 5 %"):
        assert needed in settings, needed
    return text


@pytest.mark.slow
def test_eval_checkpoint_synthetic_matches_library(ckpts, tmp_path, capsys):
    a, b = ckpts
    out = tmp_path / "rep"
    assert (
        main(
            [
                "--checkpoint",
                str(a),
                "--dataset",
                "synthetic",
                "--size",
                "64",
                "--queries-size",
                "24",
                "--out",
                str(out),
                "--n-boot",
                "100",
                "--k-law-samples",
                "200",
                "--compare",
                str(b),
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert "gap @ calibrated" in stdout and "ideal_recall@10" in stdout
    rep = json.loads((out / "report.json").read_text())
    text = _check_html(out / "report.html")
    assert "exact" in text and rep["generator"]["name"] == "latent"
    assert str(tmp_path) not in text and str(tmp_path) not in json.dumps(rep)  # no absolute paths
    assert (
        rep["checkpoint"]["file"] == "a.safetensors"
        and rep["compare"]["checkpoint"]["file"] == "b.safetensors"
    )
    ga, tail = rep["gaussianity"], rep["tail"]
    assert (
        ga["n"] == 24
        and ga["d"] == 8
        and ga["mardia"]["n_null"] == 199
        and ga["projections"]["n_projections"] == 64
    )
    assert "r(x, y) <= 1" in tail["negatives_rule"] and tail["gpd"]["n_queries"] == 24
    assert (
        tail["weibull_gumbel"]["n_queries"] == 24 and "maximum likelihood" in tail["weibull_gumbel"]["method"]
    )
    assert rep["k_law"]["summary"]["text"] in text
    # independent recomputation with the contract's embed() and the library functions
    enc, _ = load_checkpoint(a)
    db = create_dataset("synthetic", "train", size=64, seed=0)
    qs = create_dataset("synthetic", "test", size=24, seed=0)
    zdb, zq = embed(enc, db, progress=False), embed(enc, qs, progress=False)
    g = softmax_gap(zq, zdb, qs.latents, db.latents, db.default_generator(), 0.2).summary()
    for key in ("cross_entropy", "ideal_entropy", "kl"):
        assert rep["gap"]["serving"][key] == pytest.approx(g[key], rel=1e-5)
    cal = calibrate_temperature(
        zq, zdb, qs.latents, db.latents, db.default_generator(), train_temperature=0.2
    )
    assert rep["calibration"]["temperature"] == pytest.approx(cal.temperature, rel=1e-4)
    assert rep["gap"]["calibrated"]["kl"] == pytest.approx(cal.gap_at_calibrated["kl"], rel=1e-4)
    assert rep["temperatures"]["train"] == 0.2 and rep["compare"]["rows"]["training tau"]["other"] == 0.1
    assert rep["k_law"]["ks"][-1] == 1024 and len(rep["k_law"]["k_times_diff"]) == len(rep["k_law"]["ks"])


@pytest.mark.slow
def test_eval_index_labels_and_instance(ckpts, tmp_path):
    from index.build import BuildOptions, build_index

    a, _ = ckpts
    root = tmp_path / "idx"
    kw = dict(size=60, seed=0)
    try:
        db = create_dataset("fashion-mnist", "train", **kw)
    except (FileNotFoundError, ValueError):
        pytest.skip("fashion-mnist files not available")
    build_index(a, db, root, BuildOptions(progress=False))
    out = tmp_path / "rep"
    assert (
        main(
            [
                "--index",
                str(root),
                "--queries-size",
                "30",
                "--out",
                str(out),
                "--n-boot",
                "50",
                "--k-law-samples",
                "100",
                "--temperature",
                "0.3",
            ]
        )
        == 0
    )
    rep = json.loads((out / "report.json").read_text())
    _check_html(out / "report.html")
    assert (
        rep["generator"]["name"] == "label" and rep["index"]["root"] == root.name
    )  # no absolute paths in a report
    enc, _ = load_checkpoint(a)
    qs = create_dataset("fashion-mnist", "test", size=30, seed=0)
    zq, zdb = embed(enc, qs, progress=False), embed(enc, db, progress=False)
    m = retrieval_metrics(zq, zdb, qs.labels, db.labels, n_boot=50)
    assert rep["metrics"]["recall@10"]["mean"] == pytest.approx(m["recall@10"]["mean"])
    assert rep["metrics"]["knn5_majority"]["mean"] == pytest.approx(m["knn5_majority"]["mean"])
    # baselines: the trained row is the report's own precision@10, the raw-pixel row an independent
    # numpy search over 32x32 grey thumbnails (28 px Fashion-MNIST upsampled, then box-averaged)
    b = rep["baselines"]
    assert b["trained"]["precision@10"] == pytest.approx(m["precision@10"]["mean"])
    import torch.nn.functional as F

    def thumbs(ds):
        x = torch.stack([ds[i] for i in range(len(ds))]).float().mean(1, keepdim=True)
        return F.interpolate(x, size=(32, 32), mode="area").flatten(1).numpy().astype(np.float64)

    pdb_, pq = thumbs(db), thumbs(qs)
    mu = pdb_.mean(0)
    a = (pdb_ - mu) / np.linalg.norm(pdb_ - mu, axis=1, keepdims=True)
    c = (pq - mu) / np.linalg.norm(pq - mu, axis=1, keepdims=True)
    top = np.argsort(-(c @ a.T), axis=1, kind="stable")[:, :10]
    raw = (db.labels[top] == qs.labels[:, None]).mean(1)
    row = b["rows"][0]
    assert row["name"].startswith("raw pixels") and row["precision@10"] == pytest.approx(raw.mean(), abs=0.01)
    assert row["difference@10"]["low"] <= row["difference@10"]["mean"] <= row["difference@10"]["high"]
    assert b["verdict"].startswith("training ") and b["verdict"] in (out / "report.html").read_text()
    assert b["verdict"].endswith("; recipe: class folders as positives (label), 7 steps")  # which recipe ran
    # the label gap's ideal entropy is log n_c (closed form)
    counts = np.bincount(db.labels, minlength=10)
    assert rep["gap"]["serving"]["ideal_entropy"] == pytest.approx(
        np.mean(np.log(counts[qs.labels])), rel=1e-9
    )

    out2 = tmp_path / "rep2"
    assert (
        main(
            [
                "--index",
                str(root),
                "--generator",
                "instance",
                "--max-queries",
                "20",
                "--out",
                str(out2),
                "--n-boot",
                "20",
                "--no-k-law",
            ]
        )
        == 0
    )
    text = (out2 / "report.html").read_text()
    assert "approximation" in text
    rep2 = json.loads((out2 / "report.json").read_text())
    assert rep2["generator"]["exact"] is False and rep2["k_law"] is None
    assert rep2["gap"]["serving"]["ideal_entropy"] == pytest.approx(0.0, abs=1e-12)  # point mass


def test_eval_bad_input(ckpts, tmp_path):
    a, _ = ckpts
    with pytest.raises(ValueError, match="temperature"):
        main(
            [
                "--checkpoint",
                str(a),
                "--dataset",
                "synthetic",
                "--size",
                "16",
                "--temperature",
                "-1",
                "--out",
                str(tmp_path),
            ]
        )
    with pytest.raises(FileNotFoundError):
        main(
            [
                "--checkpoint",
                str(tmp_path / "missing.safetensors"),
                "--dataset",
                "synthetic",
                "--out",
                str(tmp_path),
            ]
        )
    with pytest.raises(ValueError, match="--index"):
        main(["--out", str(tmp_path)])


@pytest.mark.slow
def test_eval_folder_queries_are_database_items(ckpts, tmp_path):
    """A folder without a test/ split: queries are database items, their own rows excluded."""
    from PIL import Image

    from search.evaluation.metrics import hit_rate_at_k, knn_search, relevance

    a, _ = ckpts
    rng = np.random.default_rng(0)
    for c in ("cats", "dogs"):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(12):
            px = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) // (2 if c == "cats" else 1)
            Image.fromarray(px).save(tmp_path / "img" / c / f"{i}.png")
    out = tmp_path / "rep"
    assert (
        main(
            [
                "--checkpoint",
                str(a),
                "--dataset",
                "folder",
                "--data-root",
                str(tmp_path / "img"),
                "--out",
                str(out),
                "--n-boot",
                "20",
                "--no-k-law",
            ]
        )
        == 0
    )
    rep = json.loads((out / "report.json").read_text())
    assert rep["queries"]["same_as_database"] and rep["generator"]["name"] == "label"
    enc, _ = load_checkpoint(a)
    ds = create_dataset("folder", "all", root=str(tmp_path / "img"))
    z = embed(enc, ds, progress=False)
    _, nbr = knn_search(z, z, 10, exclude=np.arange(len(ds)))
    assert not np.any(nbr == np.arange(len(ds))[:, None])
    rec = hit_rate_at_k(relevance(nbr, ds.labels, ds.labels), 10).mean()
    assert rep["metrics"]["recall@10"]["mean"] == pytest.approx(rec)
