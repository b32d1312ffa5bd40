"""Paired comparison of trained encoders with raw-pixel kNN on Fashion-MNIST (the same queries).

For each checkpoint of a `bench/objectives.py` run: per-query kNN correctness (k = 5 majority,
k = 20 and k = 200 weighted by exp(s/0.07)) on the full split (10 000 test queries against 60 000
training images), minus the pixel baseline's (cosine, k = 5 majority) on the same query, with a
95 % bootstrap interval over queries. Paired, so it is tighter than comparing two intervals.

    .venv/bin/python bench/objectives_paired.py --run-dir runs/objectives_resnet2000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from _common import row, write_results
from objectives import unit_pixels

from search.evaluation.metrics import knn_accuracy, knn_search
from training.checkpoint import load_checkpoint
from training.datasets import create_dataset
from training.encoder import embed

RULES = ((5, False), (20, True), (200, True))  # (k, weighted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--run-dir",
        default="runs/objectives",
        help="out-dir of bench/objectives.py (one sub-folder per objective)",
    )
    p.add_argument("--data-root", default=None)
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--name", default="objectives_paired")
    args = p.parse_args(argv)
    root = {} if args.data_root is None else {"root": args.data_root}
    db, qs = (
        create_dataset("fashion-mnist", split="train", **root),
        create_dataset("fashion-mnist", split="test", **root),
    )
    scores, rows_ = knn_search(unit_pixels(qs, np.arange(len(qs))), unit_pixels(db, np.arange(len(db))), 200)
    pixel = {k: knn_accuracy(scores, rows_, db.labels, qs.labels, k, weighted=w) for k, w in RULES}
    boot = np.random.default_rng(0).integers(0, len(qs), size=(args.resamples, len(qs)))
    rows = [
        row(f"pixel k={k}{' weighted' if w else ' majority'}", float(pixel[k].mean()), "accuracy", None)
        for k, w in RULES
    ]
    paired: dict = {}
    checkpoints = sorted(Path(args.run_dir).glob("*/checkpoint.safetensors"))
    if not checkpoints:
        raise SystemExit(f"no */checkpoint.safetensors under {args.run_dir}")
    for ckpt in checkpoints:
        name = ckpt.parent.name
        encoder, _ = load_checkpoint(ckpt)
        zd = embed(encoder, db.tensors(np.arange(len(db))), batch_size=512, progress=False)
        zq = embed(encoder, qs.tensors(np.arange(len(qs))), batch_size=512, progress=False)
        s, r = knn_search(zq, zd, 200)
        for k, w in RULES:
            acc = knn_accuracy(s, r, db.labels, qs.labels, k, weighted=w)
            diff = acc.astype(np.float64) - pixel[5].astype(np.float64)  # against pixels' best rule
            lo, hi = np.quantile(diff[boot].mean(axis=1), [0.025, 0.975])
            case = f"{name} k={k}{' weighted' if w else ' majority'} minus pixel k=5"
            paired[case] = {
                "accuracy": float(acc.mean()),
                "difference": float(diff.mean()),
                "ci95": [float(lo), float(hi)],
            }
            rows.append(row(case, float(diff.mean()), f"accuracy difference [{lo:+.4f}, {hi:+.4f}]", None))
    (Path(args.run_dir) / "paired.json").write_text(json.dumps(paired, indent=2) + "\n")
    command = "python bench/objectives_paired.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.name, rows, command.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
