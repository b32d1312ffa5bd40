"""Duplicate scan memory at 10^4 and 10^5 stored embeddings: bounded, not N^2.

Generated unit vectors (d = 64): items in tight clusters (look-alikes at cosine ~0.9) and a planted
near-copy (cosine ~0.99) of 1 % of them, stored as an index version built from vectors
(`index.build.build_from_vectors`, flat). Each size is scanned in a child process -- the calibration
fitted by `search.duplicates.calibration.calibrate` on copies made in embedding space by the planting
generator (a version built from vectors has no images to edit), then `find_duplicates` over every item
with its progress bar -- and the child reports its peak RSS (ru_maxrss), the RSS before the scan and
the scan's time. Baseline: an all-pairs scan's N x N float32 similarity matrix, measured at 10^4 (a
child that computes it) and stated at 10^5 (40 GB; not run).

    .venv/bin/python bench/dedup_scale.py [--sizes 10000 100000]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import row, write_results

DIM = 64
CLUSTER = 20            # items per cluster of look-alikes
LOOKALIKE_NOISE = 0.045  # per-coordinate noise around a cluster centre (cosine ~0.9 between members)
COPY_NOISE = 0.012       # per-coordinate noise of a planted copy (cosine ~0.99 to its original)
PLANTED = 0.01


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def generate(n: int, seed: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """n unit vectors: clusters of look-alikes, the last PLANTED * n rows copies of random earlier rows."""
    rng = np.random.default_rng(seed)
    copies = int(PLANTED * n)
    base = n - copies
    centres = rng.normal(size=(base // CLUSTER + 1, DIM)) / np.sqrt(DIM)
    x = centres[np.arange(base) // CLUSTER] + LOOKALIKE_NOISE * rng.normal(size=(base, DIM))
    x = _unit(x)
    sources = rng.choice(base, size=copies, replace=False)
    planted = _unit(x[sources] + COPY_NOISE * rng.normal(size=(copies, DIM)))
    return np.concatenate([x, planted]), [(int(s), base + i) for i, s in enumerate(sources)]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_scan(root: Path, truth_file: Path) -> dict:
    """In the child: calibrate in embedding space, scan every item, report memory and quality."""
    from search.duplicates.calibration import calibrate, query_scores
    from search.duplicates.job import find_duplicates
    from search.serving.searcher import Searcher

    searcher = Searcher(root)
    searcher.load()
    snap = searcher.snapshot()
    emb = snap.index.embeddings
    n = emb.shape[0]
    rng = np.random.default_rng(1)
    picked = rng.permutation(n)
    queries = []
    for r in picked[:300]:   # copies made by the planting generator: the original is the answer
        z = _unit(np.asarray(emb[r], dtype=np.float64) + COPY_NOISE * rng.normal(size=DIM))
        queries.append(query_scores(np.asarray(emb @ z), source=int(r)))
    for r in picked[300:600]:   # items searched without themselves: "none"
        queries.append(query_scores(np.asarray(emb @ emb[r]), source=-1, exclude=int(r)))
    calib = calibrate(queries, target_precision=0.99)
    # a diagnosis, not used by the scan: "none" queries whose planted partner is indexed are wrong negatives
    # (the item finds its near-copy at cosine ~0.995); their number in the sample moves the fit
    truth_pairs = json.loads(truth_file.read_text())
    partnered = {int(i) for pair in truth_pairs for i in pair}
    wrong_negatives = sum(int(r) in partnered for r in picked[300:600])
    before = rss_mib()
    t0 = time.perf_counter()
    found = find_duplicates(snap, calib, progress=True)
    seconds = time.perf_counter() - t0
    truth = {frozenset(map(str, p)) for p in truth_pairs}
    pairs = {frozenset((a, b)) for g in found["groups"] for i, a in enumerate(g["ids"]) for b in g["ids"][i + 1:]}
    tp = len(pairs & truth)
    return {"n": n, "rss_before_scan_mib": before, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": seconds, "groups": len(found["groups"]), "threshold": found["threshold"],
            "exact_log_z": found["exact_log_z"], "precision": tp / len(pairs) if pairs else 1.0,
            "recall": tp / len(truth), "ece": calib.ece, "wrong_negatives": wrong_negatives,
            "temperature": calib.temperature, "bias": calib.bias, "max_probability": calib.max_probability}


def child_all_pairs(root: Path) -> dict:
    """The baseline in a child: every pair's cosine as one N x N matrix, pairs above a cut."""
    from search.serving.searcher import Searcher

    searcher = Searcher(root)
    searcher.load()
    emb = np.asarray(searcher.snapshot().index.embeddings, dtype=np.float32)
    t0 = time.perf_counter()
    s = emb @ emb.T
    np.fill_diagonal(s, -1)
    count = int((s >= 0.98).sum()) // 2
    return {"n": emb.shape[0], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": time.perf_counter() - t0, "pairs": count}


def run_child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, *map(str, args)], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-all-pairs", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child_scan(Path(args.child[0]), Path(args.child[1]))))
        return 0
    if args.child_all_pairs:
        print(json.dumps(child_all_pairs(Path(args.child_all_pairs))))
        return 0
    from index.build import build_from_vectors

    work = Path(tempfile.mkdtemp(prefix="dedup-scale-"))
    rows = []
    try:
        for n in args.sizes:
            x, truth = generate(n)
            np.save(work / f"v{n}.npy", x)
            (work / f"t{n}.json").write_text(json.dumps(truth))
            root = work / f"index{n}"
            build_from_vectors(work / f"v{n}.npy", root, kind="flat", progress=False, force=True)
            got = run_child("--child", root, work / f"t{n}.json")
            all_pairs_mib = n * n * 4 / 2 ** 20
            if n <= 20_000:
                measured = run_child("--child-all-pairs", root)
                all_pairs_mib = measured["peak_rss_mib"]
                note = "measured: a child holding the N x N float32 matrix"
            else:
                note = "N x N float32 matrix alone, computed (not run)"
            rows.append(row(f"N={n}: dedup scan peak RSS, MiB (baseline: all-pairs, {note})",
                            got["peak_rss_mib"], "MiB", all_pairs_mib))
            rows.append(row(f"N={n}: RSS before the scan (store loaded, calibrated), MiB", got["rss_before_scan_mib"],
                            "MiB", None))
            rows.append(row(f"N={n}: scan seconds (candidates + groups)", got["seconds"], "s", None))
            rows.append(row(f"N={n}: groups at p >= {got['threshold']:.3g}", float(got["groups"]), "groups", None))
            rows.append(row(f"N={n}: planted pairs found (recall)", got["recall"], "recall", None))
            rows.append(row(f"N={n}: pair precision", got["precision"], "precision", None))
            rows.append(row(f"N={n}: rows that needed an exact log Z", float(got["exact_log_z"]), "rows", None))
            rows.append(row(f"N={n}: calibration 'none' queries whose planted near-copy is indexed (wrong negatives)",
                            float(got["wrong_negatives"]), "queries", None))
            rows.append(row(f"N={n}: fitted temperature (bias {got['bias']:.4f})", got["temperature"], "tau", None))
            rows.append(row(f"N={n}: most sure the model can be", got["max_probability"], "p", None))
            shutil.rmtree(root, ignore_errors=True)
        write_results("dedup_scale", rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
