import json

import numpy as np
import pytest
import torch

from search.gap import softmax_gap
from search.quality import evaluate_version
from training.checkpoint import load_checkpoint, save_checkpoint
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder, embed

TINY = EncoderConfig(embed_dim=8, width=16, layers=1, heads=2, patch_size=8)


def _ckpt(path, seed, tau):
    torch.manual_seed(seed)
    return save_checkpoint(path, create_encoder(TINY), step=0, train_config={"seed": seed},
                           lineage={"objective": "infonce"}, metrics={"temperature": tau})


@pytest.mark.slow
def test_quality_gate_in_build_index(tmp_path):
    from index.build import QualityGateError, build_index
    from index.store import IndexStore

    a, b = _ckpt(tmp_path / "a.safetensors", 0, 0.2), _ckpt(tmp_path / "b.safetensors", 1, 0.1)
    db = create_dataset("synthetic", "train", size=48, seed=0)
    root = tmp_path / "idx"
    v1 = build_index(a, db, root, progress=False)
    queries = create_dataset("synthetic", "test", size=20, seed=0)

    def gate(cand, serv):
        return evaluate_version(cand, serv, queries)

    try:
        v2 = build_index(b, db, root, evaluator=gate, progress=False)
    except QualityGateError as err:
        v2 = err.version
    store = IndexStore(root)
    qg = store.manifest(v2)["quality_gate"]
    assert qg["metric"] == "neg_gap" and qg["serving_version"] == v1
    # the gate's numbers equal an independent computation with each version's own encoder and tau
    for role, ck, tau in (("candidate", b, 0.1), ("serving", a, 0.2)):
        enc, _ = load_checkpoint(ck)
        g = softmax_gap(embed(enc, queries, progress=False), embed(enc, db, progress=False), queries.latents,
                        db.latents, db.default_generator(), tau).summary()
        assert qg["gap"][role] == pytest.approx(g["kl"], rel=1e-5)
        assert qg[role] == pytest.approx(-g["kl"], rel=1e-5)
    assert qg["passed"] == (qg["candidate"] >= qg["serving"])
    # a version against itself: equal scores, ok
    same = evaluate_version(store.load(v1, gpu=False), store.load(v1, gpu=False), queries, metric="recall_at_10")
    assert same["candidate"] == same["serving"] and same["ok"]
    assert 0.0 <= same["recall_at_10"]["candidate"] <= 1.0


def test_bad_metric():
    with pytest.raises(ValueError, match="metric"):
        evaluate_version(None, None, metric="accuracy")
