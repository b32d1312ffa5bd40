"""The vertical slice through the real `softsearch` command: train -> index build -> eval -> HTTP.

Independent checks: the held-out cross-entropy gap is recomputed from the checkpoints with the
dense reference (`softmax_gap_dense`), and HTTP answers are compared with brute-force numpy.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.cli import main
from api.config import Settings
from search.evaluation.gap import softmax_gap_dense
from training.checkpoint import load_checkpoint
from training.datasets import create_dataset
from training.encoder import embed

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
DB_SIZE, QUERY_SIZE = 512, 128


def heldout_gap(checkpoint: Path, temperature: float) -> float:
    """Mean KL(q||p) of synthetic test queries against the train database, dense reference."""
    encoder, _ = load_checkpoint(checkpoint)
    db = create_dataset("synthetic", split="train", size=DB_SIZE)
    queries = create_dataset("synthetic", split="test", size=QUERY_SIZE)
    db_emb = embed(encoder, db, batch_size=256, progress=False)
    q_emb = embed(encoder, queries, batch_size=256, progress=False)
    result = softmax_gap_dense(
        q_emb, db_emb, queries.metadata(), db.metadata(), db.default_generator(), temperature
    )
    return float(np.mean(result.kl))


@pytest.mark.slow
def test_train_index_eval_serve(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                str(TINY),
                "--set",
                f'out_dir="{run / "train"}"',
                "--set",
                "steps=200",
                "--set",
                "batch_size=32",
                "--set",
                "dataset_size=1024",
                "--set",
                "lr=3e-3",
                "--set",
                "warmup_steps=10",
                "--set",
                "checkpoint_every=1000",
            ]
        )
        == 0
    )
    ckpt, init = run / "train" / "checkpoint.safetensors", run / "train" / "init.safetensors"
    metrics = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 200 and np.mean([m["loss"] for m in metrics[-20:]]) < np.mean(
        [m["loss"] for m in metrics[:20]]
    )

    # ~200 steps lower the held-out gap (dense reference, independent of the eval command).
    tau = metrics[-1]["temperature"]
    gap_before, gap_after = heldout_gap(init, tau), heldout_gap(ckpt, tau)
    assert gap_after < 0.8 * gap_before, (gap_before, gap_after)

    assert (
        main(
            [
                "index",
                "build",
                "--root",
                str(run / "index"),
                "--checkpoint",
                str(ckpt),
                "--dataset",
                "synthetic",
                "--split",
                "train",
                "--size",
                str(DB_SIZE),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "eval",
                "--index",
                str(run / "index"),
                "--queries-dataset",
                "synthetic",
                "--queries-split",
                "test",
                "--queries-size",
                str(QUERY_SIZE),
                "--no-k-law",
                "--temperature",
                str(tau),
                "--compare",
                str(init),
                "--out",
                str(run / "eval"),
            ]
        )
        == 0
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    assert (run / "eval" / "report.html").stat().st_size > 10_000
    # The eval command's streaming gap at the serving tau equals the dense reference above.
    serving = report["gap"]["serving"]
    assert serving["temperature"] == pytest.approx(tau)
    assert serving["kl"] == pytest.approx(gap_after, rel=1e-4)
    assert serving["kl"] == pytest.approx(serving["cross_entropy"] - serving["ideal_entropy"], abs=1e-9)
    # Calibration can only lower the held-out gap.
    assert report["gap"]["calibrated"]["kl"] <= serving["kl"] + 1e-9

    # HTTP: an indexed image comes back as its own top hit, probabilities match brute force.
    settings = Settings(index_root=run / "index")
    with TestClient(create_app(settings)) as client:
        db = create_dataset("synthetic", split="train", size=DB_SIZE)
        buf = io.BytesIO()
        db.image(5).save(buf, format="PNG")
        resp = client.post(
            "/v1/search", files={"file": ("q.png", buf.getvalue(), "image/png")}, data={"k": "5"}
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        hits = body["results"]
        assert body["version"] == client.get("/v1/index").json()["version"]
        assert body["count"] == DB_SIZE and hits[0]["id"] == db.item_id(5)
        encoder, _ = load_checkpoint(ckpt)
        db_emb = embed(encoder, db, batch_size=256, progress=False)
        sims = db_emb @ db_emb[5]
        logits = sims / body["temperature"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-sims)[:5]
        assert [h["id"] for h in hits] == [db.item_id(i) for i in top]
        np.testing.assert_allclose([h["probability"] for h in hits], probs[top], rtol=1e-3)
