"""Real-data comparison of the training objectives on Fashion-MNIST (no labels in training).

Same encoder (configs/fashion-mnist.toml: open_clip ModifiedResNet tower [1, 1, 1, 1], width 32,
32 px), same label-free positives (the `neighbour` generator: an image and one of its 5 nearest
grey-pixel neighbours, both augmented), same step budget and seed; only the objective changes:

* ``infonce``      InfoNCE, fixed tau = 0.2
* ``weince``       WEINCE blend-only (variant "blend": margin 2, kappa_rho 10, kappa_aic 1, beta 1), tau = 0.2
* ``infonce-log``  InfoNCE with the logarithmic temperature schedule
                   1/tau_t = 1/0.5 + log(1 + t/10)/1, tau clipped to >= 0.1

Labels are used only to evaluate: kNN accuracy of test queries against the train database
(k=200 weighted by exp(s/0.07), and k=20 with the same weights), recall@10 (a same-label item in
the top 10), precision@10 and the label cross-entropy gap KL(q || p) of the softmax search at the
training tau and at the calibrated tau (search/evaluation/gap.py, search/evaluation/calibration.py). Baseline:
cosine kNN (k=5 majority) on raw 784-d pixels, on the same subsets and on the full 60k/10k split.

    .venv/bin/python bench/objectives.py [--steps 300] [--db-size 10000] [--queries 2000] [--config C]

(--db-size 60000 --queries 10000 is the full train / test split.)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent

import numpy as np
from _common import row, write_results

from search.evaluation.calibration import calibrate_temperature
from search.evaluation.gap import softmax_gap
from search.evaluation.metrics import (
    bootstrap_ci,
    hit_rate_at_k,
    knn_accuracy,
    knn_search,
    precision_at_k,
    relevance,
)
from training.checkpoint import load_checkpoint
from training.config import load_train_config
from training.datasets import create_dataset
from training.encoder import embed
from training.generators import create_generator
from training.trainer import train

logger = logging.getLogger(__name__)

CONFIG = _HERE.parent / "configs" / "fashion-mnist.toml"

# objective -> (loss, loss_options, schedule, schedule_options); replaces the config file's values
OBJECTIVES: dict[str, tuple[str, dict, str, dict]] = {
    "infonce": ("infonce", {}, "fixed", {"tau": 0.2}),
    "weince": ("weince", {"variant": "blend"}, "fixed", {"tau": 0.2}),
    "infonce-log": ("infonce", {}, "log", {"tau_0": 0.5, "t_0": 10.0, "c": 1.0, "tau_min": 0.1}),
}


def _subset(n_total: int, n: int | None, seed: int) -> np.ndarray:
    if n is None or n >= n_total:
        return np.arange(n_total)
    return np.sort(np.random.default_rng(seed).choice(n_total, size=n, replace=False))


def unit_pixels(ds, idx: np.ndarray) -> np.ndarray:
    """(N, 784) float32 raw pixels of items `idx`, L2-normalised (the cosine-kNN baseline's space)."""
    x = ds.images_batch(idx).reshape(len(idx), -1).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)


def pixel_knn(db, queries, db_idx, q_idx, k: int = 5) -> tuple[float, float, float]:
    """Cosine kNN (k=5 majority) on raw pixels: (mean, low, high) accuracy."""
    scores, rows = knn_search(unit_pixels(queries, q_idx), unit_pixels(db, db_idx), k)
    acc = knn_accuracy(scores, rows, db.labels[db_idx], queries.labels[q_idx], k, weighted=False)
    return bootstrap_ci(acc)


def evaluate(encoder, db, queries, db_idx, q_idx, train_tau: float) -> dict:
    """kNN accuracies, recall/precision@10 and the label gap for one encoder."""
    t0 = time.perf_counter()
    zd = embed(encoder, db.tensors(db_idx), batch_size=512, progress=False)
    zq = embed(encoder, queries.tensors(q_idx), batch_size=512, progress=False)
    t_embed = time.perf_counter() - t0
    lab_d, lab_q = db.labels[db_idx], queries.labels[q_idx]
    scores, rows = knn_search(zq, zd, 200)
    out: dict = {"embed_seconds": t_embed}
    out["knn200"] = bootstrap_ci(knn_accuracy(scores, rows, lab_d, lab_q, 200, weighted=True))
    out["knn20"] = bootstrap_ci(knn_accuracy(scores, rows, lab_d, lab_q, 20, weighted=True))
    out["knn5"] = bootstrap_ci(
        knn_accuracy(scores, rows, lab_d, lab_q, 5, weighted=False)
    )  # the pixel baseline's rule
    rel = relevance(rows, lab_q, lab_d)
    out["recall@10"] = bootstrap_ci(hit_rate_at_k(rel, 10))
    out["precision@10"] = bootstrap_ci(precision_at_k(rel, 10))
    gen = create_generator("label")
    gap = softmax_gap(zq, zd, lab_q, lab_d, gen, train_tau)
    out["label_gap_at_train_tau"] = bootstrap_ci(gap.kl)
    cal = calibrate_temperature(zq, zd, lab_q, lab_d, gen, train_temperature=train_tau, n_curve=5)
    out["calibrated_tau"] = cal.temperature
    out["label_gap_at_calibrated_tau"] = cal.gap_at_calibrated["kl"]
    # norm of the mean embedding: 0 for a uniform spread, 1 for a collapse
    out["mean_embedding_norm"] = float(np.linalg.norm(zd.mean(axis=0)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--db-size", type=int, default=10000, help="train items in the kNN database (None = all)")
    p.add_argument("--queries", type=int, default=2000, help="test queries")
    p.add_argument("--data-root", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/objectives")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-pixel-full", action="store_true", help="skip the full 60k/10k pixel baseline")
    p.add_argument("--name", default="objectives")
    p.add_argument("--config", default=str(CONFIG), help="training config (objective fields are replaced)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.objectives.split(",") if n.strip()]
    for n in names:
        if n not in OBJECTIVES:
            raise ValueError(f"unknown objective {n!r}; choose from {sorted(OBJECTIVES)}")
    root_opt = {} if args.data_root is None else {"root": args.data_root}
    db = create_dataset("fashion-mnist", split="train", **root_opt)
    queries = create_dataset("fashion-mnist", split="test", **root_opt)
    db_idx = _subset(len(db), args.db_size, args.seed + 1)
    q_idx = _subset(len(queries), args.queries, args.seed + 2)

    result: dict = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "db_size": len(db_idx),
        "queries": len(q_idx),
        "seed": args.seed,
        "objectives": {},
    }
    t0 = time.perf_counter()
    result["pixel_knn5_subset"] = pixel_knn(db, queries, db_idx, q_idx)
    if not args.no_pixel_full:
        result["pixel_knn5_full"] = pixel_knn(db, queries, np.arange(len(db)), np.arange(len(queries)))
    logger.info(
        "pixel baselines: %s (%.0f s)",
        {k: v for k, v in result.items() if k.startswith("pixel")},
        time.perf_counter() - t0,
    )

    rows = [row("pixel_cosine_knn5/subset", result["pixel_knn5_subset"][0], "accuracy", None)]
    if "pixel_knn5_full" in result:
        rows.append(row("pixel_cosine_knn5/full_60k_10k", result["pixel_knn5_full"][0], "accuracy", None))
    base_knn = None
    for name in names:
        overrides = [
            f"steps={args.steps}",
            f"batch_size={args.batch_size}",
            f"seed={args.seed}",
            f"out_dir={Path(args.out_dir) / name}",
            f"device={args.device}",
            "progress=false",
            "checkpoint_every=100000",
            "warmup_steps=30",
        ]
        if args.data_root is not None:
            overrides.append(f"data_root={args.data_root}")
        config = load_train_config(args.config, overrides)
        config.loss, config.loss_options, config.schedule, config.schedule_options = OBJECTIVES[name]
        config.validate()
        t_train = time.perf_counter()
        ckpt = train(config)
        t_train = time.perf_counter() - t_train
        encoder, meta = load_checkpoint(ckpt)
        last = meta.get("metrics") or {}
        train_tau = float(last.get("temperature", 0.2))
        ev = evaluate(encoder, db, queries, db_idx, q_idx, train_tau)
        ev.update(
            {
                "train_seconds": t_train,
                "final_train_loss": last.get("loss"),
                "train_tau_final": train_tau,
                "checkpoint": str(ckpt),
                "overrides": overrides,
                "objective": dict(
                    zip(["loss", "loss_options", "schedule", "schedule_options"], OBJECTIVES[name])
                ),
                "weince_lambda_mean": last.get("weince_lambda_mean"),
            }
        )
        result["objectives"][name] = ev
        logger.info("%s: %s", name, json.dumps(ev, default=str))
        if base_knn is None:
            base_knn = ev["knn200"][0]
        rows.append(row(f"{name}/knn200_weighted", ev["knn200"][0], "accuracy", base_knn))
        rows.append(row(f"{name}/knn20_weighted", ev["knn20"][0], "accuracy", None))
        rows.append(row(f"{name}/knn5_majority", ev["knn5"][0], "accuracy", result["pixel_knn5_subset"][0]))
        rows.append(row(f"{name}/recall@10", ev["recall@10"][0], "fraction", None))
        rows.append(row(f"{name}/precision@10", ev["precision@10"][0], "fraction", None))
        rows.append(row(f"{name}/label_gap_train_tau", ev["label_gap_at_train_tau"][0], "nats", None))
        rows.append(row(f"{name}/label_gap_calibrated", ev["label_gap_at_calibrated_tau"], "nats", None))
        rows.append(row(f"{name}/train_seconds", t_train, "s", None))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "objectives.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    command = "python bench/objectives.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.name, rows, command.strip())
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(main())
