"""The energy scale of the training loss: how deep are the barriers Langevin annealing must climb (issue 31)?

The annealing theorem (docs/theory.md §3) needs c above the depth d* of the deepest non-global basin of the
energy the noise samples, here the training loss: SGLD adds sqrt(2 lr T_t) noise, so its stationary
density is exp(-L(theta) / T) and T is in nats of the batch-mean loss. This script measures two
estimates of that scale from finished runs, on the same fixed batches for every model:

- the loss difference between the minima that different seeds (or schedules) end in, |L_A - L_B|;
- the barrier on the straight path between them, max_a L((1 - a) theta_A + a theta_B) - max(L_A, L_B)
  (an upper bound on the lowest barrier between the two basins: another path can only be lower, and
  networks from different seeds are not aligned for permutations, which makes it larger still).

The loss is evaluated as training sees it (train-mode BatchNorm, the run's generator and temperature,
no gradient), on `--batches` batches drawn with the sampler of step 10^6 so no run trained on exactly
these views.

    .venv/bin/python bench/energy_scale.py RUN_A RUN_B [RUN_C ...] [--batches 8] [--points 11]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from _common import row, write_results  # noqa: E402


def fixed_batches(config, n_batches: int):
    """`n_batches` pairs of view tensors from the run's own data and generator, away from its training
    steps."""
    from training.trainer import batch_indices, build_data, sample_views

    dataset, generator = build_data(config)
    out = []
    for b in range(n_batches):
        step = 10**6 + b
        idx = batch_indices(step, len(dataset), config.batch_size, seed=12345)
        out.append(
            sample_views(generator, dataset, idx, seed=12345, step=step, offset=0, chunk=config.sample_chunk)
        )
    return out


@torch.no_grad()
def mean_loss(encoder, loss_fn, batches, temperature: float) -> float:
    """Batch-mean training loss averaged over `batches`, BatchNorm on batch statistics as in training."""
    from training.distributed import DistInfo
    from training.trainer import contrastive_step

    encoder.train()
    info = DistInfo()
    return float(
        np.mean([float(contrastive_step(encoder, loss_fn, a, b, temperature, info).loss) for a, b in batches])
    )


def interpolate(state_a: dict, state_b: dict, alpha: float) -> dict:
    """(1 - alpha) theta_A + alpha theta_B for float tensors; integer buffers (BN counters) from A."""
    return {
        k: ((1 - alpha) * v + alpha * state_b[k]) if v.is_floating_point() else v for k, v in state_a.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "runs", nargs="+", type=Path, help="run directories (config.json + checkpoint.safetensors)"
    )
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--points", type=int, default=11, help="points on each straight path, ends included")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="loss temperature (default: the first run's final training temperature)",
    )
    parser.add_argument("--name", default="energy_scale")
    args = parser.parse_args(argv)

    from training.checkpoint import load_checkpoint, read_checkpoint_metadata
    from training.config import config_from_dict
    from training.losses import create_loss

    torch.manual_seed(0)
    config = config_from_dict(json.loads((args.runs[0] / "config.json").read_text()))
    tau = args.temperature
    if tau is None:
        meta = read_checkpoint_metadata(args.runs[0] / "checkpoint.safetensors")
        tau = float(meta["metrics"].get("temperature") or config.schedule_options["tau"])
    loss_fn = create_loss("infonce")
    batches = fixed_batches(config, args.batches)
    encoders = {run.name: load_checkpoint(run / "checkpoint.safetensors")[0] for run in args.runs}
    ends = {name: mean_loss(enc, loss_fn, batches, tau) for name, enc in encoders.items()}
    rows = [row(f"L({name}) at tau {tau:g}", value, "nats", None) for name, value in ends.items()]
    alphas = np.linspace(0.0, 1.0, args.points)
    for (na, ea), (nb, eb) in itertools.combinations(encoders.items(), 2):
        probe = load_checkpoint(args.runs[0] / "checkpoint.safetensors")[0]
        sa, sb = ea.state_dict(), eb.state_dict()
        path = []
        for alpha in tqdm(alphas, desc=f"{na} -> {nb}", unit="point"):
            probe.load_state_dict(interpolate(sa, sb, float(alpha)))
            path.append(mean_loss(probe, loss_fn, batches, tau))
        barrier = max(path) - max(path[0], path[-1])
        print(f"{na} -> {nb}: " + " ".join(f"{v:.3f}" for v in path))
        rows += [
            row(f"|L_A - L_B| {na} vs {nb}", abs(path[0] - path[-1]), "nats", None),
            row(f"straight-path barrier {na} -> {nb}", barrier, "nats", None),
            row(f"path max {na} -> {nb} (alpha {alphas[int(np.argmax(path))]:.1f})", max(path), "nats", None),
        ]
    write_results(args.name, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
