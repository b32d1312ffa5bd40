"""Benchmark the streaming cross-entropy gap (search/evaluation/gap.py) against a plain matrix product.

Throughput: time of one (Q, d) x (d, N) fp32 matrix product on the device divided by the time of
`softmax_gap` on the same shapes (the fraction of matmul throughput the exact gap reaches; target
>= 0.5), for the latent generator (log r computed on the device) and the label fast path.
A second baseline runs the same products tile by tile and discards them (no Q x N output
to write: at N = 1e6 the plain product spends most of its time writing 16 GB), the stricter
reference. The default path (fused tile kernels on CPU at these sizes, search/evaluation/fused.py) is also
timed against the eager online-max walk (`fused=False`). Memory: peak memory of `softmax_gap` vs the dense
reference `softmax_gap_dense` at the same shape (GPU: torch peak allocation; CPU: peak RSS growth of a fresh
child process). The dense reference is measured only while its estimated footprint (about 8 float64 Q x N
matrices) fits `--dense-limit-gb`; otherwise its estimate is reported.

    .venv/bin/python bench/gap.py            # GPU: Q=4096, N=1e5; CPU (2 shared cores): Q=1024, N=2e4
    .venv/bin/python bench/gap.py --full     # N = 1e6
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

import numpy as np
import torch
from _common import row, write_results

D, M, KAPPA, N_CLASSES = 128, 3, 4.0, 10


def make_data(q: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    zq = rng.standard_normal((q, D), dtype=np.float32)
    zq /= np.linalg.norm(zq, axis=1, keepdims=True)
    zn = rng.standard_normal((n, D), dtype=np.float32)
    zn /= np.linalg.norm(zn, axis=1, keepdims=True)
    return (
        zq,
        zn,
        rng.uniform(0, 2 * np.pi, (q, M)),
        rng.uniform(0, 2 * np.pi, (n, M)),
        rng.integers(0, N_CLASSES, q),
        rng.integers(0, N_CLASSES, n),
    )


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def best_time(fn, dev, repeats: int) -> float:
    fn()  # warm-up
    _sync(dev)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    """VmHWM of this process (peak resident set since start or the last clear_refs reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child_peak(kind: str, q: int, n: int, conn) -> None:
    """Run one variant in a fresh process and send back its peak RSS growth in bytes."""
    from search.evaluation.gap import softmax_gap, softmax_gap_dense
    from training.generators import create_generator

    zq, zn, lq, ln, _, _ = make_data(q, n)
    gen = create_generator("latent", kappa=KAPPA)
    if kind != "dense":  # compile the full-tile kernel first: inductor's own footprint is not the gap's
        softmax_gap(zq[:512], zn[:8192], lq[:512], ln[:8192], gen, 0.1, device="cpu", fused=True)
    base = _rss_bytes()
    # Reset the high-water mark so data generation's own peak is not counted (Linux: VmHWM := RSS).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if kind == "dense":
        softmax_gap_dense(zq, zn, lq, ln, gen, 0.1)
    else:
        softmax_gap(zq, zn, lq, ln, gen, 0.1, device="cpu")
    conn.send(max(_peak_rss_bytes() - base, 0))
    conn.close()


def cpu_peak(kind: str, q: int, n: int) -> float:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_child_peak, args=(kind, q, n, b))
    p.start()
    value = a.recv()
    p.join()
    return float(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="N = 1e6")
    p.add_argument("--q", type=int, default=None)
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dense-limit-gb", type=float, default=4.0)
    p.add_argument("--name", default="gap", help="results file bench/results/NAME.json")
    p.add_argument("--no-eager", action="store_true", help="skip the eager (fused=False) comparison rows")
    args = p.parse_args(argv)
    from search.evaluation.gap import softmax_gap
    from training.generators import create_generator

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = dev.type == "cuda"
    q = args.q or (4096 if gpu or args.full else 1024)
    n = args.n or (1_000_000 if args.full else (100_000 if gpu else 20_000))
    zq, zn, lq, ln, cq, cn = make_data(q, n)
    latent, label = create_generator("latent", kappa=KAPPA), create_generator("label")
    tq, tn = torch.as_tensor(zq, device=dev), torch.as_tensor(zn, device=dev)

    t_mm = best_time(lambda: tq @ tn.T, dev, args.repeats)

    def blocked_matmul(bq: int = 512, bn: int = 8192) -> None:
        """The same products in the gap's tiles, each tile discarded: compute without the Q x N write."""
        for q0 in range(0, q, bq):
            for n0 in range(0, n, bn):
                tq[q0 : q0 + bq] @ tn[n0 : n0 + bn].T

    t_mm_tiles = best_time(blocked_matmul, dev, args.repeats)
    t_lat = best_time(lambda: softmax_gap(zq, zn, lq, ln, latent, 0.1, device=dev), dev, args.repeats)
    t_lab = best_time(lambda: softmax_gap(zq, zn, cq, cn, label, 0.1, device=dev), dev, args.repeats)
    shape = f"Q={q} N={n} d={D}"
    rows = [
        row(f"matmul {shape}", t_mm, "s", None),
        row(f"gap latent {shape} (matmul time / gap time)", t_mm / t_lat, "fraction", None),
        row(f"gap latent {shape}", t_lat, "s", t_mm),
        row(f"gap label {shape} (matmul time / gap time)", t_mm / t_lab, "fraction", None),
        row(f"gap label {shape}", t_lab, "s", t_mm),
        row(f"matmul in 512 x 8192 tiles, output discarded {shape}", t_mm_tiles, "s", t_mm),
        row(f"gap latent {shape} (tiled matmul time / gap time)", t_mm_tiles / t_lat, "fraction", None),
        row(f"gap label {shape} (tiled matmul time / gap time)", t_mm_tiles / t_lab, "fraction", None),
    ]
    if not args.no_eager:  # the eager online-max walk (fused=False), for the record
        t_lat_e = best_time(
            lambda: softmax_gap(zq, zn, lq, ln, latent, 0.1, device=dev, fused=False), dev, args.repeats
        )
        t_lab_e = best_time(
            lambda: softmax_gap(zq, zn, cq, cn, label, 0.1, device=dev, fused=False), dev, args.repeats
        )
        rows += [
            row(f"gap latent eager {shape} (matmul time / gap time)", t_mm / t_lat_e, "fraction", None),
            row(f"gap latent default vs eager {shape}", t_lat, "s", t_lat_e),
            row(f"gap label eager {shape} (matmul time / gap time)", t_mm / t_lab_e, "fraction", None),
            row(f"gap label default vs eager {shape}", t_lab, "s", t_lab_e),
        ]
    dense_est = 8.0 * 8 * q * n
    if gpu:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        softmax_gap(zq, zn, lq, ln, latent, 0.1, device=dev)
        stream_peak = float(torch.cuda.max_memory_allocated() - base)
    else:
        stream_peak = cpu_peak("stream", q, n)
    if dense_est <= args.dense_limit_gb * 2**30:
        dense_peak, dense_case = cpu_peak("dense", q, n), "dense reference peak (measured, CPU)"
    else:
        dense_peak, dense_case = dense_est, "dense reference peak (estimate 8 x Q x N float64)"
    rows += [
        row(f"{dense_case} {shape}", dense_peak / 2**20, "MiB", None),
        row(
            f"streaming gap peak ({'GPU' if gpu else 'CPU'}) {shape}",
            stream_peak / 2**20,
            "MiB",
            dense_peak / 2**20,
        ),
    ]
    write_results(args.name, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
