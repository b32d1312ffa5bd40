"""`softsearch eval` on an index of 10^6 items: wall time and peak resident memory.

The store is bench/_scale.py's (synthetic latents, d = 128, IVF-PQ; embeddings.npy 488 MiB). The
eval reads the database embeddings from the version's memory map (search/evaluation/evaluate.py), streams
the exact gap, the calibration and the neighbour search over row blocks, and never holds a second
N x d copy. Each eval runs in a child process (`python -m api.cli eval ...`); its peak RSS is the
child's VmHWM (getrusage of the waited child).

Baselines: the same command on a 10^5-item store built the same way (time and memory should grow
about 10x and far less than 10x); for memory also the N x d float32 matrix a plain `np.load` of
the embeddings would hold on top of the model.

    .venv/bin/python bench/eval_scale.py [--root /tmp/softsearch-million] [--max-queries 256]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import row, write_results
from _scale import MILLION, encoder_checkpoint, synthetic_store

logger = logging.getLogger("bench.eval_scale")
ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def run_eval(root: Path, out: Path, max_queries: int, extra: list[str]) -> dict:
    """Run `softsearch eval --index root` in a fresh child: {seconds, peak_bytes, report}."""
    cmd = [
        sys.executable,
        "-m",
        "api.cli",
        "eval",
        "--index",
        str(root),
        "--out",
        str(out),
        "--max-queries",
        str(max_queries),
        "--device",
        "cpu",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"eval failed ({proc.returncode}): {proc.stderr[-3000:]}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # max over waited children, KiB
    if peak_kib <= before:
        logger.warning(
            "child peak not above an earlier child's (%d <= %d KiB): order the runs small to large",
            peak_kib,
            before,
        )
    report = json.loads((out / "report.json").read_text())
    return {"seconds": seconds, "peak_bytes": peak_kib * 1024, "report": report}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "softsearch-million")
    p.add_argument("--max-queries", type=int, default=256)
    p.add_argument("--no-k-law", action="store_true", help="pass --no-k-law to both evals")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.root.mkdir(parents=True, exist_ok=True)
    ck = encoder_checkpoint(args.root / "scale_encoder.safetensors")
    tenth, _ = synthetic_store(args.root / "tenth", MILLION // 10, checkpoint=ck, params={"nlist": 256})
    big, version = synthetic_store(args.root / "million", MILLION, checkpoint=ck)
    extra = ["--no-k-law"] if args.no_k_law else []
    emb_bytes = (big / "versions" / version / "embeddings.npy").stat().st_size
    with tempfile.TemporaryDirectory(prefix="eval_scale_") as tmp:
        small = run_eval(tenth, Path(tmp) / "tenth", args.max_queries, extra)  # smaller first (see run_eval)
        large = run_eval(big, Path(tmp) / "million", args.max_queries, extra)
    n_small = small["report"]["database"]["count"]
    n_large = large["report"]["database"]["count"]
    rows = [
        row(f"eval N={n_large:.0e} wall time", large["seconds"], "s", small["seconds"]),
        row(f"eval N={n_large:.0e} peak RSS", large["peak_bytes"] / MIB, "MiB", small["peak_bytes"] / MIB),
        row(
            f"eval N={n_large:.0e} peak RSS vs N=1e5 peak + a resident N x d float32 copy",
            large["peak_bytes"] / MIB,
            "MiB",
            small["peak_bytes"] / MIB + emb_bytes / MIB,
        ),
        row(f"eval N={n_small:.0e} wall time", small["seconds"], "s", None),
        row(f"eval N={n_small:.0e} peak RSS", small["peak_bytes"] / MIB, "MiB", None),
        row("embeddings.npy at N=1e6 (d=128)", emb_bytes / MIB, "MiB", None),
        row(
            f"eval N={n_large:.0e} gap KL at the serving tau",
            large["report"]["gap"]["serving"]["kl"],
            "nats",
            small["report"]["gap"]["serving"]["kl"],
        ),
    ]
    note = (
        f"1-min load average {os.getloadavg()[0]:.1f} at the end; {args.max_queries} queries; "
        f"{'no ' if args.no_k_law else ''}k-law"
    )
    write_results("eval_scale", rows, machine_note=note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
