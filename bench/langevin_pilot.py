"""Pilot: is the sweep's Langevin noise (bench/objectives_seeds.py LANGEVIN) neither negligible nor
destructive?

Trains the ``anneal-langevin`` objective of bench/objectives_seeds.py (log-annealed InfoNCE on
configs/fashion-mnist.toml) for a few steps twice, with its Langevin noise and with the noise off
(the baseline: the same run as a user would train it without the switch), same seed and data.
Per step it records the norm of the AdamW update (parameters after minus before
``optimizer.step()``) and the norm of the noise LangevinNoise adds; it reports their ratio early
and late in the (shortened) cosine learning-rate schedule, and the loss curves of both runs.

    .venv/bin/python bench/langevin_pilot.py [--steps 150] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from _common import row, write_results  # noqa: E402
from objectives_seeds import BATCH, CONFIG, LANGEVIN, OBJECTIVES  # noqa: E402

logger = logging.getLogger(__name__)


class UpdateNorms:
    """Norms of what optimizer.step() and LangevinNoise.apply change, step by step."""

    def __init__(self) -> None:
        self.adam: list[float] = []
        self.noise: list[float] = []
        self._before: list[torch.Tensor] = []

    @staticmethod
    def _params(optimizer) -> list[torch.Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"]]

    def pre(self, optimizer, args, kwargs) -> None:
        self._before = [p.detach().clone() for p in self._params(optimizer)]

    def post(self, optimizer, args, kwargs) -> None:
        sq = sum(float(((p.detach() - q) ** 2).sum()) for p, q in zip(self._params(optimizer), self._before))
        self.adam.append(math.sqrt(sq))

    def wrap_noise(self, apply):
        def wrapped(noise, params, lr, step):
            params = list(params)
            before = [p.detach().clone() for p in params]
            temp = apply(noise, params, lr, step)
            self.noise.append(
                math.sqrt(sum(float(((p.detach() - q) ** 2).sum()) for p, q in zip(params, before)))
            )
            return temp

        return wrapped


def _reuse_neighbour_table() -> None:
    """Both runs use the same Fashion-MNIST neighbour table: compute it once in this process."""
    from training import neighbours

    original, tables = neighbours.pixel_neighbours, {}

    def cached(dataset, k, *args, **kwargs):
        key = (type(dataset).__name__, len(dataset), k, repr(args), repr(sorted(kwargs.items())))
        if key not in tables:
            tables[key] = original(dataset, k, *args, **kwargs)
        return tables[key]

    neighbours.pixel_neighbours = cached


def pilot_run(with_noise: bool, steps: int, threads: int, out: Path) -> tuple[list[dict], UpdateNorms]:
    from training import langevin
    from training.config import load_train_config
    from training.trainer import train

    norms = UpdateNorms()
    overrides = [
        f"steps={steps}",
        f"batch_size={BATCH}",
        "seed=0",
        f"out_dir={out}",
        "progress=false",
        f"checkpoint_every={steps}",
        "warmup_steps=30",
        f"torch_threads={threads}",
    ]
    config = load_train_config(CONFIG, overrides)
    for key, value in OBJECTIVES["anneal-langevin"].items():
        setattr(config, key, value)
    if not with_noise:
        config.noise_schedule, config.noise_options = None, {}
    config.validate()
    original = langevin.LangevinNoise.apply
    hooks = [register_optimizer_step_pre_hook(norms.pre), register_optimizer_step_post_hook(norms.post)]
    langevin.LangevinNoise.apply = norms.wrap_noise(original)
    try:
        train(config)
    finally:
        langevin.LangevinNoise.apply = original
        for h in hooks:
            h.remove()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, norms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps < 60:
        raise SystemExit("error: --steps must be >= 60 (early and late windows of 20 steps)")
    results = {}
    _reuse_neighbour_table()
    with tempfile.TemporaryDirectory() as tmp:
        for with_noise in (False, True):
            tag = "noise" if with_noise else "no_noise"
            results[tag] = pilot_run(with_noise, args.steps, args.threads, Path(tmp) / tag)
            logger.info("%s: done", tag)
    metrics, norms = results["noise"]
    base_metrics, base_norms = results["no_noise"]
    out = []
    windows = {
        "early": range(30, 50),
        "late": range(args.steps - 20, args.steps),
    }  # after the 30 warm-up steps
    for name, w in windows.items():
        adam = statistics.median(norms.adam[i] for i in w)
        noise = statistics.median(norms.noise[i] for i in w)
        lr = statistics.median(metrics[i]["lr"] for i in w)
        temp = statistics.median(metrics[i]["noise_temperature"] for i in w)
        out.append(row(f"{name}/adam_update_norm", adam, f"L2 per step (lr {lr:.2e})", None))
        out.append(row(f"{name}/noise_norm", noise, f"L2 per step (T {temp:.2e})", adam))
        out.append(
            row(
                f"{name}/adam_update_norm_without_noise",
                statistics.median(base_norms.adam[i] for i in w),
                "L2 per step",
                None,
            )
        )
    for name, w in {
        "first10": range(0, 10),
        "mid10": range(args.steps // 2 - 5, args.steps // 2 + 5),
        "last10": range(args.steps - 10, args.steps),
    }.items():
        base = statistics.mean(base_metrics[i]["loss"] for i in w)
        out.append(
            row(f"loss/{name}/with_noise", statistics.mean(metrics[i]["loss"] for i in w), "loss", base)
        )
    out.append(row("noise/schedule", 0.0, json.dumps(LANGEVIN), None))
    write_results("langevin_pilot", out, "python bench/langevin_pilot.py " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise SystemExit(main())
