"""Benchmark: one WEINCE training step vs one InfoNCE step (target: full-step ratio <= 1.10).

``weince`` is the default paper variant (blend + two top-50 terms + the beta_t tail fit),
``weince-blend`` the blend alone (``variant = "blend"``).

Same small open_clip encoder (training/encoder.py defaults), same random two-view batch, AdamW.
"full step" = encoder forward on both views + loss + backward + optimizer step; "loss only" =
similarities + loss + backward from fixed embeddings (the part WEINCE changes). Timings are
medians over interleaved repetitions (InfoNCE and WEINCE alternate, so machine load hits both);
``weince_expected`` = InfoNCE full step + measured loss-only difference, the less noisy estimate
of the full-step ratio on a busy machine.

    .venv/bin/python bench/weince_step.py [--batch-sizes 256,1024] [--reps 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from _common import row, write_results

from training.encoder import EncoderConfig, create_encoder
from training.losses import create_loss

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_full_step(encoder, loss_fn, opt, view_a, view_b, tau: float) -> float:
    """Seconds for forward (2B images) + loss + backward + optimizer step."""
    device = view_a.device
    _sync(device)
    t0 = time.perf_counter()
    z = encoder(torch.cat([view_a, view_b]))  # (2B, D)
    b = view_a.shape[0]
    out = loss_fn(z[:b], z[b:], tau)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    opt.step()
    _sync(device)
    return time.perf_counter() - t0


def time_loss_only(loss_fn, z_a, z_b, tau: float) -> float:
    """Seconds for similarities + loss (+ stats) + backward to the embeddings."""
    a, b = z_a.detach().requires_grad_(), z_b.detach().requires_grad_()
    _sync(z_a.device)
    t0 = time.perf_counter()
    out = loss_fn(a, b, tau)
    out.loss.backward()
    _sync(z_a.device)
    return time.perf_counter() - t0


def bench(batch_sizes: list[int], reps: int, device: str, tau: float = 0.1) -> list[dict]:
    dev = torch.device(device)
    rows = []
    for bsz in batch_sizes:
        torch.manual_seed(0)
        encoder = create_encoder(EncoderConfig()).to(dev).train()
        opt = torch.optim.AdamW(encoder.parameters(), lr=1e-4)
        view_a = torch.randn(bsz, 3, 32, 32, device=dev)
        view_b = view_a + 0.1 * torch.randn_like(view_a)
        losses = {
            "infonce": create_loss("infonce"),
            "weince": create_loss("weince"),
            "weince-blend": create_loss("weince", variant="blend"),
        }
        full = {k: [] for k in losses}
        only = {k: [] for k in losses}
        with torch.no_grad():
            z = encoder(torch.cat([view_a, view_b]))
        z_a, z_b = z[:bsz].clone(), z[bsz:].clone()
        for rep in range(reps + 1):  # rep 0 warms up (allocator, kernels)
            for name, fn in losses.items():
                t_full = time_full_step(encoder, fn, opt, view_a, view_b, tau)
                t_only = min(time_loss_only(fn, z_a, z_b, tau) for _ in range(3))
                if rep:
                    full[name].append(t_full)
                    only[name].append(t_only)
            logger.info("batch %d rep %d done", bsz, rep)
        base_full = statistics.median(full["infonce"])
        base_only = statistics.median(only["infonce"])
        rows.append(row(f"full_step/B={bsz}/infonce", base_full, "s", None))
        rows.append(row(f"loss_only/B={bsz}/infonce", base_only, "s", None))
        for name in ("weince", "weince-blend"):
            rows.append(row(f"full_step/B={bsz}/{name}", statistics.median(full[name]), "s", base_full))
            rows.append(row(f"loss_only/B={bsz}/{name}", statistics.median(only[name]), "s", base_only))
            # The full-step difference is the loss difference plus load noise; this row adds the (less
            # noisy) measured loss-only difference to the InfoNCE step: the expected full-step ratio.
            delta = statistics.median(only[name]) - base_only
            rows.append(row(f"full_step/B={bsz}/{name}_expected", base_full + delta, "s", base_full))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="256,1024")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--name", default="weince_step", help="results file bench/results/NAME.json")
    args = p.parse_args(argv)
    sizes = [int(v) for v in args.batch_sizes.split(",") if v.strip()]
    if not sizes or min(sizes) < 4:
        raise ValueError(f"--batch-sizes must be integers >= 4, got {args.batch_sizes!r}")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    rows = bench(sizes, args.reps, args.device)
    command = "python bench/weince_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.name, rows, command.strip())
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(main())
