"""`softsearch dedup`'s scan end to end at 10^3 and 10^4 images: seconds per stage and peak memory.

Generated pictures (random shapes in random colours, 160 x 120 PNG, held in memory) with 1 % of them given an
edited copy (search/duplicates/edits.py); each size is scanned in a child process by
search.duplicates.scan.scan_collection at its defaults (thumbnails, candidate pairs, alignment, synthetic
copies, the positive-unlabelled fit of search/duplicates/model.py), which reports its seconds per
stage, its CPU seconds (the machine's load beside it), its peak RSS and the planted pairs it found.
Targets: 10^3 in <= 60 s and 10^4 in <= 300 s on the 2-core machine.

    .venv/bin/python bench/dedup_scale.py [--sizes 1000 10000] [--verifier pixels|encoder|both]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
from _common import row, write_results
from PIL import Image, ImageDraw

PLANTED = 0.01
TARGET_S = {1000: 60.0, 10000: 300.0}


def generate(n: int, seed: int = 0) -> tuple[list[bytes], list[tuple[int, int]]]:
    """n PNG pictures, the last PLANTED * n of them edited copies of random earlier ones."""
    from search.duplicates.edits import edited_copy

    rng = np.random.default_rng(seed)
    copies = int(PLANTED * n)
    out = []
    for _ in range(n - copies):
        im = Image.new("RGB", (160, 120), tuple(int(c) for c in rng.integers(0, 256, 3)))
        d = ImageDraw.Draw(im)
        for _ in range(int(rng.integers(4, 9))):
            x0, y0 = int(rng.integers(0, 140)), int(rng.integers(0, 100))
            box = (x0, y0, x0 + int(rng.integers(10, 60)), y0 + int(rng.integers(10, 60)))
            (d.ellipse if rng.random() < 0.5 else d.rectangle)(
                box, fill=tuple(int(c) for c in rng.integers(0, 256, 3))
            )
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        out.append(buf.getvalue())
    pairs = []
    for src in rng.choice(n - copies, size=copies, replace=False):
        data, _ = edited_copy(Image.open(io.BytesIO(out[src])), rng)
        out.append(data)
        pairs.append((int(src), len(out) - 1))
    return out, pairs


def child(n: int, verifier: str = "pixels") -> dict:
    from search.duplicates.config import DedupConfig
    from search.duplicates.scan import scan_collection

    sources, pairs = generate(n)
    t0, c0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    scan = scan_collection(lambda r: sources[r], n, DedupConfig(verifier=verifier), progress=True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    found = {(int(a), int(b)) for a, b, p in zip(scan.a, scan.b, scan.p) if p >= 0.5}
    hits = sum((a, b) in found for a, b in pairs)
    return {
        "n": n,
        "seconds": seconds,
        "cpu_seconds": cpu,  # this process's CPU time, which load inflates less than wall time
        "load": [load0, os.getloadavg()[0]],
        "stages": scan.seconds,
        "pairs_scored": int(scan.p.size),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "planted_found": hits / max(len(pairs), 1),
        "pairs_kept": len(found),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--name", default="dedup_scale", help="results file name (bench/results/NAME.json)")
    ap.add_argument("--verifier", default="pixels", choices=("pixels", "encoder", "both"))
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.verifier)))
        return 0
    rows = []
    for n in args.sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(n), "--verifier", args.verifier],
            capture_output=True,
            text=True,
            env=os.environ,
            check=True,
        )
        sys.stderr.write(out.stderr[-2000:])
        res = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        rows.append(row(f"{n} images: seconds end to end", res["seconds"], "s", TARGET_S.get(n)))
        rows.append(row(f"{n} images: CPU seconds of the scan", res["cpu_seconds"], "s", TARGET_S.get(n)))
        rows.append(row(f"{n} images: load average at start", res["load"][0], "load", None))
        rows.append(row(f"{n} images: load average at end", res["load"][1], "load", None))
        rows += [row(f"{n} images: {stage}", s, "s", None) for stage, s in res["stages"].items()]
        rows += [
            row(f"{n} images: pairs aligned", float(res["pairs_scored"]), "pairs", None),
            row(f"{n} images: peak RSS", res["peak_rss_mib"], "MiB", None),
            row(f"{n} images: planted copies found", res["planted_found"], "ratio", None),
            row(f"{n} images: pairs kept", float(res["pairs_kept"]), "pairs", None),
        ]
    write_results(args.name, rows, machine_note=f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
