import pytest
import torch

from search.evaluation.gap import softmax_gap
from search.evaluation.quality import evaluate_version
from training.checkpoint import load_checkpoint, save_checkpoint
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder, embed

TINY = EncoderConfig(embed_dim=8, width=16, layers=1, heads=2, patch_size=8)


def _ckpt(path, seed, tau):
    torch.manual_seed(seed)
    return save_checkpoint(
        path,
        create_encoder(TINY),
        step=0,
        train_config={"seed": seed},
        lineage={"objective": "infonce"},
        metrics={"temperature": tau},
    )


@pytest.mark.slow
def test_quality_gate_in_build_index(tmp_path):
    from index.build import BuildOptions, QualityGateError, build_index
    from index.store import IndexStore

    a, b = _ckpt(tmp_path / "a.safetensors", 0, 0.2), _ckpt(tmp_path / "b.safetensors", 1, 0.1)
    db = create_dataset("synthetic", "train", size=48, seed=0)
    root = tmp_path / "idx"
    v1 = build_index(a, db, root, BuildOptions(progress=False))
    queries = create_dataset("synthetic", "test", size=20, seed=0)

    def gate(cand, serv):
        return evaluate_version(cand, serv, queries)

    try:
        v2 = build_index(b, db, root, BuildOptions(evaluator=gate, progress=False))
    except QualityGateError as err:
        v2 = err.version
    store = IndexStore(root)
    qg = store.manifest(v2).quality_gate.to_json()
    assert qg["metric"] == "neg_gap" and qg["serving_version"] == v1
    # the gate's numbers equal an independent computation with each version's own encoder and tau
    for role, ck, tau in (("candidate", b, 0.1), ("serving", a, 0.2)):
        enc, _ = load_checkpoint(ck)
        g = softmax_gap(
            embed(enc, queries, progress=False),
            embed(enc, db, progress=False),
            queries.latents,
            db.latents,
            db.default_generator(),
            tau,
        ).summary()
        assert qg["gap"][role] == pytest.approx(g["kl"], rel=1e-5)
        assert qg[role] == pytest.approx(-g["kl"], rel=1e-5)
    assert qg["passed"] == (qg["candidate"] >= qg["serving"])
    # a version against itself: equal scores, ok
    same = evaluate_version(
        store.load(v1, gpu=False), store.load(v1, gpu=False), queries, metric="recall_at_10"
    )
    assert same["candidate"] == same["serving"] and same["ok"]
    assert 0.0 <= same["recall_at_10"]["candidate"] <= 1.0


def test_bad_metric():
    with pytest.raises(ValueError, match="metric"):
        evaluate_version(None, None, metric="accuracy")


def test_build_stores_calibrated_search_temperature(tmp_path):
    """index build + calibrate_version: the manifest's tau is the held-out argmin of H(q,p)."""
    from functools import partial

    from index.build import BuildOptions, build_index
    from index.store import IndexStore
    from search.evaluation.calibration import calibrate_temperature
    from search.evaluation.quality import calibrate_version

    ck = _ckpt(tmp_path / "a.safetensors", 0, 0.5)
    db = create_dataset("synthetic", "train", size=64, seed=0)
    queries = create_dataset("synthetic", "test", size=24, seed=0)
    calibrator = partial(calibrate_version, queries=queries)
    store = IndexStore(tmp_path / "idx")
    v1 = build_index(ck, db, store.root, BuildOptions(calibrator=calibrator, progress=False))
    manifest = store.manifest(v1)
    assert manifest.search_temperature_source.startswith("calibrated")

    enc, _ = load_checkpoint(ck)
    zq, zdb = embed(enc, queries, progress=False), embed(enc, db, progress=False)
    ref = calibrate_temperature(
        zq, zdb, queries.latents, db.latents, db.default_generator(), train_temperature=0.5
    )
    # The minimiser of a flat objective is ill-conditioned (embedding round-off moves it a little);
    # the minimum value is not: both must agree.
    assert manifest.search_temperature == pytest.approx(ref.temperature, rel=0.05)
    at_tau = softmax_gap(
        zq, zdb, queries.latents, db.latents, db.default_generator(), manifest.search_temperature
    ).summary()["kl"]
    at_train = softmax_gap(zq, zdb, queries.latents, db.latents, db.default_generator(), 0.5).summary()["kl"]
    assert at_tau == pytest.approx(ref.gap_at_calibrated["kl"], rel=1e-4)
    assert at_tau < at_train and manifest.calibration["gap_at_calibrated"] == pytest.approx(at_tau, rel=1e-5)

    # An explicit temperature wins over calibration.
    fields = {"search_temperature": 0.3, "search_temperature_source": "command line"}
    v2 = build_index(ck, db, store.root, BuildOptions(calibrator=calibrator, progress=False, fields=fields))
    assert store.manifest(v2).search_temperature == 0.3 and store.manifest(v2).calibration is None
