"""`softsearch experiment anneal`'s configuration and command line, apart from the experiment so that
`--help` and a mistyped flag load no torch (the experiment is training/anneal_experiment.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from training.cli_parser import CommandParser

SCHEDULE_NAMES = ("log", "exp", "cosine", "none")
DESCRIPTION = "Langevin annealing schedules on a planted InfoNCE landscape (docs/theory.md §3)."


@dataclass
class AnnealConfig:
    steps: int = 3000
    seeds: int = 8
    particles: int = 64
    lr: float = 0.05
    tau: float = 0.25
    trap_gap: float = 40.0
    c: float | None = None  # None -> 1.2 x barrier depth
    t0: float = 2.0
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    record_every: int = 25
    seed: int = 1000  # the noise generator's seed


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="softsearch experiment anneal",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = AnnealConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="Langevin steps per run")
    p.add_argument(
        "--seeds", type=int, default=d.seeds, help="number of independent runs (seed batches) per schedule"
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="random seed of the start jitter and the noise draws"
    )
    p.add_argument("--particles", type=int, default=d.particles, help="particles per run")
    p.add_argument("--lr", type=float, default=d.lr, help="step size eta")
    p.add_argument("--tau", type=float, default=d.tau, help="InfoNCE temperature of the energy")
    p.add_argument(
        "--trap-gap", type=float, default=d.trap_gap, help="degrees between the trap and its negatives"
    )
    p.add_argument(
        "--c", type=float, default=None, help="log-schedule constant (None: 1.2 x the barrier depth)"
    )
    p.add_argument("--t0", type=float, default=d.t0, help="log-schedule offset; T_0 = c / log t0")
    p.add_argument("--schedules", default=",".join(d.schedules), help="comma-separated noise schedules")
    p.add_argument("--out", default="runs/anneal", help="output directory for anneal.json and anneal.png")
    p.add_argument("--no-plot", action="store_true")
    return p
