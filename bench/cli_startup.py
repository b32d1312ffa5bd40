"""How long `softsearch CMD --help` and a mistyped flag take, against the import the parsers used to pay
first.

Each case runs in a fresh interpreter (`python -m api.cli ...`), median of --repeats runs. The baseline is a
fresh interpreter importing torch and FAISS and the modules each command's code needs (what every one of these
paid before it parsed its arguments, before issue 44), timed the same way, so the ratio is what the
parse-first order saves on this machine at its current load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import row, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # argv -> the heavy module the command's code loads once it runs
    "train --help": "training.trainer",
    "train --confg x": "training.trainer",
    "dedup --help": "search.duplicates.job",
    "dedup --index x --bogus": "search.duplicates.job",
    "eval --bogus": "search.evaluation.evaluate",
    "experiment anneal --help": "training.anneal_experiment",
    "index build --help": "index.build",
    "index build --bogus": "index.build",
}


def timed(cmd: list[str], repeats: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = []
    for case, heavy in CASES.items():
        value = timed([sys.executable, "-m", "api.cli", *case.split()], args.repeats)
        base = timed([sys.executable, "-c", f"import torch, faiss, {heavy}"], args.repeats)
        rows.append(row(case, value, "s", base))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    write_results("cli_startup", rows, machine_note=f"load average {load:.1f} at the end")


if __name__ == "__main__":
    main()
