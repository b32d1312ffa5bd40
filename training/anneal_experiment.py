"""`softsearch experiment anneal`: Langevin annealing schedules on a planted InfoNCE landscape.

Reproduces the claim of docs/theory.md §3 on a problem whose global minimum is known: a
logarithmic noise schedule 1/T_t = log(t + t_0)/c (c above the barrier depth) reaches the global
basin more often than fast schedules, which freeze in local minima.

Landscape (free unit embeddings x in S^2, no encoder). Each particle is an anchor under a
multi-positive InfoNCE energy against fixed prototypes,

    E(x) = -log sum_{k in P} exp(x.c_k / tau) + log sum_{l in P u N} exp(x.c_l / tau),

with positives P at in-plane angles {-30, 0, 30} degrees (the global well, a cluster of three
aligned positives) and 180 degrees (the planted trap, one positive flanked by negatives at
180 +- ``trap_gap`` degrees), and negatives also at the poles +-e_3 so the trap cannot be left over
the pole. By the reflection symmetries (y -> -y, z -> -z) both wells are critical points on the
equator; the optimum E* = E(e_1) is confirmed by a dense equator search plus a multi-start
Riemannian gradient descent over the sphere (no lower minimum exists), and the barrier depth of
the trap is the lowest saddle found by flooding a latitude-longitude grid.

All particles start in the trap. Each schedule runs Riemannian Langevin dynamics
x <- normalize(x - eta grad_R E + P_x(sqrt(2 eta T_t) xi)) (training/langevin.py) for the same
number of steps with the same noise draws (common random numbers); a particle's basin is the
minimum it reaches by a final zero-temperature gradient quench.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from training.anneal_args import SCHEDULE_NAMES, AnnealConfig, build_parser
from training.langevin import LangevinNoise, sphere_retract, tangent_project
from training.schedules import TemperatureSchedule, create_schedule

logger = logging.getLogger(__name__)


@dataclass
class Landscape:
    """Prototypes of the planted energy; ``energy`` is per particle, rows on S^2."""

    tau: float = 0.25
    trap_gap: float = 40.0  # degrees between the trap positive and its flanking negatives
    cluster: float = 30.0  # degrees between the global cluster's positives

    def prototypes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positives (4, 3), negatives (4, 3)) float64 unit vectors."""
        key = (self.tau, self.trap_gap, self.cluster)
        if getattr(self, "_cache_key", None) != key:
            self._cache = self._build_prototypes()
            self._cache_key = key
        return self._cache

    def _build_prototypes(self) -> tuple[torch.Tensor, torch.Tensor]:
        def equator(deg: list[float]) -> torch.Tensor:
            a = torch.tensor(deg, dtype=torch.float64) * math.pi / 180
            return torch.stack([torch.cos(a), torch.sin(a), torch.zeros_like(a)], dim=1)

        pos = equator([-self.cluster, 0.0, self.cluster, 180.0])
        poles = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]], dtype=torch.float64)
        neg = torch.cat([equator([180.0 - self.trap_gap, 180.0 + self.trap_gap]), poles])
        return pos, neg

    def energy(self, x: torch.Tensor) -> torch.Tensor:
        """E(x) per row: (..., 3) -> (...)."""
        pos, neg = self.prototypes()
        pos, allp = pos.to(x), torch.cat([pos, neg]).to(x)
        return -torch.logsumexp(x @ pos.T / self.tau, dim=-1) + torch.logsumexp(x @ allp.T / self.tau, dim=-1)

    def riemannian_grad(self, x: torch.Tensor) -> torch.Tensor:
        """grad_R E = P_x grad E, rows of x on the sphere: (..., 3).

        grad E = (softmax(A x / tau) @ A - softmax(P x / tau) @ P) / tau, A = P u N.
        """
        pos, neg = self.prototypes()
        pos, allp = pos.to(x), torch.cat([pos, neg]).to(x)
        g = (
            torch.softmax(x @ allp.T / self.tau, dim=-1) @ allp
            - torch.softmax(x @ pos.T / self.tau, dim=-1) @ pos
        ) / self.tau  # (..., 3)
        return tangent_project(x, g)


def quench(land: Landscape, x: torch.Tensor, steps: int = 400, lr: float = 0.2) -> torch.Tensor:
    """Zero-temperature Riemannian gradient descent: the local minimum each row flows to."""
    x = x.detach().clone()
    for _ in range(steps):
        x = sphere_retract(x, -lr * land.riemannian_grad(x))
    return x


def _fibonacci_sphere(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64) + 0.5
    z = 1 - 2 * i / n
    phi = i * math.pi * (3 - math.sqrt(5))
    r = torch.sqrt(1 - z * z)
    return torch.stack([r * torch.cos(phi), r * torch.sin(phi), z], dim=1)


def saddle_height(land: Landscape, n_lon: int = 480, n_lat: int = 241) -> float:
    """Lowest energy level at which the trap and the global well connect (grid flooding)."""
    from scipy import ndimage

    lon = torch.linspace(-math.pi, math.pi, n_lon + 1, dtype=torch.float64)[:-1]
    lat = torch.linspace(-math.pi / 2, math.pi / 2, n_lat, dtype=torch.float64)
    la, lo = torch.meshgrid(lat, lon, indexing="ij")
    grid = torch.stack([torch.cos(la) * torch.cos(lo), torch.cos(la) * torch.sin(lo), torch.sin(la)], dim=-1)
    e = land.energy(grid).numpy()  # (n_lat, n_lon)
    eq = n_lat // 2
    i_glob, i_trap = (eq, n_lon // 2), (eq, 0)  # lon 0 and lon -pi on the equator

    def connected(level: float) -> bool:
        lab, _ = ndimage.label(e < level)
        # longitude wraps: merge labels that touch across the seam
        parent: dict[int, int] = {}

        def find(a: int) -> int:
            while parent.get(a, a) != a:
                a = parent[a]
            return a

        for r in range(n_lat):
            a, b = lab[r, 0], lab[r, -1]
            if a and b:
                parent[find(a)] = find(b)
        for r in (0, n_lat - 1):  # each pole row is one point
            row = [v for v in lab[r] if v]
            for v in row[1:]:
                parent[find(v)] = find(row[0])
        a, b = lab[i_glob], lab[i_trap]
        return bool(a and b and find(a) == find(b))

    lo_l, hi_l = float(e.min()), float(e.max()) + 1e-9
    for _ in range(30):
        mid = 0.5 * (lo_l + hi_l)
        lo_l, hi_l = (lo_l, mid) if connected(mid) else (mid, hi_l)
    return hi_l


def landscape_facts(land: Landscape) -> dict:
    """Optimum, trap energy, saddle and barrier depth, verified numerically."""
    with _single_thread():
        return _landscape_facts(land)


def _landscape_facts(land: Landscape) -> dict:
    e1 = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    trap = torch.tensor([[-1.0, 0.0, 0.0]], dtype=torch.float64)
    e_star = float(land.energy(e1))
    e_trap = float(land.energy(trap))
    # confirmations: dense equator scan and multi-start descent find nothing below E(e_1)
    th = torch.linspace(-math.pi, math.pi, 200_001, dtype=torch.float64)
    ring = torch.stack([torch.cos(th), torch.sin(th), torch.zeros_like(th)], dim=1)
    ring_min = float(land.energy(ring).min())
    starts = quench(land, _fibonacci_sphere(2000))
    multi_min = float(land.energy(starts).min())
    assert ring_min >= e_star - 1e-9 and multi_min >= e_star - 1e-6, (
        f"planted optimum is not global: E(e1)={e_star}, ring {ring_min}, multistart {multi_min}"
    )
    grad_trap = float(land.riemannian_grad(trap).norm())
    assert grad_trap < 1e-9, f"trap is not a critical point (|grad|={grad_trap})"
    basin_glob = float((starts @ e1[0] > 0.99).double().mean())
    saddle = saddle_height(land)
    return {
        "optimum_energy": e_star,
        "trap_energy": e_trap,
        "saddle_energy": saddle,
        "barrier_depth": saddle - e_trap,
        "global_basin_volume_fraction": basin_glob,
    }


def make_noise_schedule(name: str, steps: int, c: float, t0: float, lr: float) -> TemperatureSchedule | None:
    """The compared noise schedules, all starting at T_0 = c / log(t0) (energy units).

    log: the paper's 1/T = log(s + t0)/c in continuous time s = lr * step, i.e. the ``log`` schedule
    with tau_0 = c/log(t0), t_0 = t0/lr steps; exp: T_0 gamma^t reaching 1e-3 T_0 at 20 % of the
    budget (fast); cosine: Kukleva et al. with tau_max = T_0, tau_min = 0.1 T_0, 1.5 periods over the
    budget so it ends at its minimum; none: no noise.
    """
    t_hot = c / math.log(t0)
    if name == "log":
        return create_schedule("log", tau_0=t_hot, t_0=t0 / lr, c=c, tau_min=0.0)
    if name == "exp":
        gamma = math.exp(math.log(1e-3) / max(1.0, 0.2 * steps))
        return create_schedule("exp", tau_0=t_hot, gamma=gamma, tau_min=0.0)
    if name == "cosine":
        return create_schedule("cosine", tau_min=0.1 * t_hot, tau_max=t_hot, period=steps / 1.5)
    if name == "none":
        return None
    raise ValueError(f"unknown noise schedule {name!r}; choose from {SCHEDULE_NAMES}")


def run_schedule(land: Landscape, name: str, cfg: AnnealConfig, c: float, e_star: float) -> dict:
    """Run all seeds of one schedule (batched): energies, basin fractions and a trajectory."""
    sched = make_noise_schedule(name, cfg.steps, c, cfg.t0, cfg.lr)
    glob = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    # All seeds at once: (S, n, 3); one generator, so every schedule sees the same noise draws.
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64).repeat(cfg.seeds, cfg.particles, 1)
    x = sphere_retract(x, 1e-3 * torch.randn(x.shape, generator=gen, dtype=torch.float64))
    noise = LangevinNoise(sched, riemannian_params=[x], generator=gen)
    traj = []
    for t in range(cfg.steps):
        x.copy_(sphere_retract(x, -cfg.lr * land.riemannian_grad(x)))  # drift
        noise.apply([x], cfg.lr, t)  # + P_x sqrt(2 eta T_t) xi, retracted
        if t % cfg.record_every == 0 or t == cfg.steps - 1:
            traj.append(float((x @ glob > 0).double().mean()))
    xq = quench(land, x)
    in_glob = (xq @ glob > 0.99).double()  # (S, n)
    per_seed = in_glob.mean(dim=1).tolist()
    final_e = (land.energy(x).mean(dim=1) - e_star).tolist()
    quench_e = (land.energy(xq).mean(dim=1) - e_star).tolist()
    temps = [
        0.0 if sched is None else float(sched.temperature(t)) for t in range(0, cfg.steps, cfg.record_every)
    ]
    fr = np.array(per_seed)
    return {
        "schedule": name,
        "options": None if sched is None else sched.describe(),
        "global_basin_fraction": float(fr.mean()),
        "global_basin_fraction_std": float(fr.std(ddof=1)) if len(fr) > 1 else 0.0,
        "runs_majority_global": float((fr > 0.5).mean()),
        "final_energy_gap": float(np.mean(final_e)),
        "quenched_energy_gap": float(np.mean(quench_e)),
        "per_seed_global_fraction": per_seed,
        "trajectory_global_half": traj,
        "temperature": temps,
        "final_temperature": 0.0 if sched is None else float(sched.temperature(cfg.steps - 1)),
    }


def run_experiment(cfg: AnnealConfig) -> dict:
    """Landscape facts plus one result row per schedule.

    The tensors are tiny, so torch runs single-threaded here (thread hand-offs would dominate on a
    busy machine); the previous thread count is restored afterwards.
    """
    with _single_thread():
        return _run_experiment(cfg)


@contextlib.contextmanager
def _single_thread():
    """Run tiny-tensor loops on one torch thread (thread hand-offs dominate on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run_experiment(cfg: AnnealConfig) -> dict:
    for name in cfg.schedules:
        if name not in SCHEDULE_NAMES:
            raise ValueError(f"unknown noise schedule {name!r}; choose from {SCHEDULE_NAMES}")
    if cfg.steps < 10 or cfg.seeds < 1 or cfg.particles < 1:
        raise ValueError(
            f"need steps >= 10, seeds >= 1, particles >= 1; got {cfg.steps}, {cfg.seeds}, {cfg.particles}"
        )
    if not cfg.lr > 0 or not cfg.tau > 0:
        raise ValueError(f"lr and tau must be positive, got lr={cfg.lr}, tau={cfg.tau}")
    if not 10.0 <= cfg.trap_gap <= 80.0:
        raise ValueError(f"trap_gap must be in [10, 80] degrees, got {cfg.trap_gap}")
    land = Landscape(tau=cfg.tau, trap_gap=cfg.trap_gap)
    facts = landscape_facts(land)
    c = cfg.c if cfg.c is not None else 1.2 * facts["barrier_depth"]
    if not c > 0:
        raise ValueError(f"c must be positive, got {c}")
    if not cfg.t0 > 1:
        raise ValueError(f"t0 must be > 1 (T_0 = c / log t0), got {cfg.t0}")
    t_hot = c / math.log(cfg.t0)  # every schedule starts at the log schedule's T_0
    logger.info("landscape: %s; c=%.3f, T_0=%.3f", facts, c, t_hot)
    rows = []
    for name in tqdm(cfg.schedules, desc="schedules", disable=None):
        start = time.perf_counter()
        rows.append(run_schedule(land, name, cfg, c, facts["optimum_energy"]))
        rows[-1]["seconds"] = time.perf_counter() - start
    return {
        "config": {**asdict(cfg), "schedules": list(cfg.schedules), "c_used": c, "t_hot": t_hot},
        "landscape": facts,
        "results": rows,
    }


def plot_results(result: dict, path: Path) -> Path:
    """Two panels: the noise temperatures, and the fraction of particles on the global side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for row in result["results"]:
        t_temp = np.arange(len(row["temperature"])) * cfg["record_every"]
        ax1.plot(t_temp, row["temperature"], label=row["schedule"])
        t_traj = np.minimum(
            np.arange(len(row["trajectory_global_half"])) * cfg["record_every"], cfg["steps"] - 1
        )
        ax2.plot(
            t_traj,
            row["trajectory_global_half"],
            label=f"{row['schedule']} (basin {row['global_basin_fraction']:.2f})",
        )
    ax1.set_xlabel("step")
    ax1.set_ylabel("noise temperature T_t (energy units)")
    ax1.set_yscale("symlog", linthresh=1e-3)
    ax1.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("fraction of particles in the global hemisphere")
    ax2.set_ylim(-0.02, 1.02)
    ax2.legend()
    land = result["landscape"]
    fig.suptitle(
        f"Riemannian Langevin on a planted InfoNCE landscape: barrier {land['barrier_depth']:.2f}, "
        f"c = {cfg['c_used']:.2f}, {cfg['seeds']} seeds x {cfg['particles']} particles, {cfg['steps']} steps"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(result: dict) -> str:
    # every particle is an independent run; +- is the std over the seed batches
    lines = [
        f"{'schedule':<8} {'runs in global basin':>21} {'E - E* (final)':>15} "
        f"{'E - E* (quenched)':>18} {'T_end':>8}"
    ]
    for r in result["results"]:
        lines.append(
            f"{r['schedule']:<8} {r['global_basin_fraction']:>14.3f} +-{r['global_basin_fraction_std']:.2f} "
            f"{r['final_energy_gap']:>15.4f} {r['quenched_energy_gap']:>18.4f} {r['final_temperature']:>8.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`softsearch experiment anneal [--steps N --seeds S --particles P --out DIR ...]`."""
    args = build_parser().parse_args(argv)
    cfg = AnnealConfig(
        steps=args.steps,
        seeds=args.seeds,
        particles=args.particles,
        lr=args.lr,
        tau=args.tau,
        trap_gap=args.trap_gap,
        c=args.c,
        t0=args.t0,
        seed=args.seed,
        schedules=tuple(s.strip() for s in args.schedules.split(",") if s.strip()),
    )
    result = run_experiment(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "anneal.json").write_text(json.dumps(result, indent=2) + "\n")
    land = result["landscape"]
    print(
        f"optimum E* = {land['optimum_energy']:.4f}, trap E = {land['trap_energy']:.4f}, "
        f"barrier depth = {land['barrier_depth']:.4f}, c = {result['config']['c_used']:.3f}, "
        f"T_0 = {result['config']['t_hot']:.3f}"
    )
    print(format_table(result))
    print(f"wrote {out / 'anneal.json'}")
    if not args.no_plot:
        print(f"wrote {plot_results(result, out / 'anneal.png')}")
    return 0
