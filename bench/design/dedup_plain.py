"""Design experiment, not a benchmark (issue 29, docs/results.md §12 "A stretch the copies never had"): should a
verified match prefer a window WITHOUT stretch (verify._plain) when it is nearly as good as the free window, and
within what factor of the distance 1 - ncc + EPS (verify.PLAIN_RATIO; 0: never, the reading before 2026-12-07)?

On pictures with flat regions (filled letters) many windows match a copy equally well and the free search may
settle on a stretched one: edited copies then carry a stretch they never had, and the calibrated stretch weight
has to stay small to keep them, which lets a look-alike that needs its stretch (l_outline ~ I_outline, two
rectangle outlines 4 % apart in aspect) through. The queries are the product's own verified calibration queries
(search/duplicates/job.py) on the folder indexed with --checkpoint, at design seeds only (never the bench's 0, 5, 21,
33 nor their calibration seeds 1, 6, 22, 34); fitted on one seed, scored on the other. ~1 min per seed and ratio.

    PYTHONPATH=. .venv/bin/python bench/design/dedup_plain.py --checkpoint CKPT [--seeds 7 9] [--ratios 0 2 4 8]
"""
import argparse
import pickle
import tempfile
from pathlib import Path

import numpy as np
from scipy.special import logsumexp

from index.build import BuildOptions, build_index
from search.duplicates import verify as V
from search.duplicates.calibration import fit_with_geometry, top1
from search.duplicates.job import verified_calibration_queries
from search.serving.searcher import Searcher
from training.checkpoint import read_checkpoint_metadata
from training.datasets import create_dataset
from training.images import load_rgb

LOOK_ALIKE = ("symbols/alphabets/english/outlined/lowercase/l_outline.png",
              "symbols/alphabets/english/outlined/uppercase/I_outline.png")


def held_out(queries, tau, bias, weights) -> tuple[float, float, float, float]:
    """(weighted NLL, copies whose top-1 is their original at p >= 0.9, at p >= 0.99, weighted "none" queries
    whose top-1 has p >= 0.9) of `queries` under a fit."""
    nll = total = recalled9 = recalled99 = copies = false9 = 0.0
    for q in queries:
        scored = q.weighed(weights)
        logits = np.r_[bias / tau, scored.top / tau]
        at = np.flatnonzero(scored.top_rows == q.source) if q.source >= 0 else np.array([], int)
        nll -= q.weight * (logits[at[0] + 1] if at.size else logits[0]) - q.weight * logsumexp(logits)
        total += q.weight
        p, right = top1(scored, tau, bias)
        if q.source >= 0:
            copies += 1
            recalled9 += right and p >= 0.9
            recalled99 += right and p >= 0.99
        elif p >= 0.9:
            false9 += q.weight
    return nll / total, recalled9 / copies, recalled99 / copies, false9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--folder", default="/usr/share/tuxpaint/stamps")
    p.add_argument("--seeds", type=int, nargs=2, default=(7, 9))
    p.add_argument("--ratios", type=float, nargs="+", default=(0.0, 2.0, 4.0, 8.0))
    p.add_argument("--cache", default=None, help="folder for the index and the queries (default: a temporary one)")
    args = p.parse_args()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="dedup-plain-"))
    root = cache / "index"
    if not root.exists():
        size = int(read_checkpoint_metadata(args.checkpoint)["encoder"]["image_size"])
        build_index(args.checkpoint, create_dataset("folder", split="all", root=args.folder, image_size=size), root,
                    BuildOptions(progress=False))
    searcher = Searcher(root)
    searcher.load()
    snap = searcher.snapshot()
    pair = [V.thumb(load_rgb((Path(args.folder) / f).read_bytes())) for f in LOOK_ALIKE]
    print(f"{'ratio':>5} {'fit':>3} {'test':>4} | {'NLL':>6} {'copies p>=.9':>12} {'p>=.99':>6} "
          f"{'none p>=.9':>10} | tau, w | l ~ I: 1-ncc, stretch, p vs none")
    for ratio in args.ratios:
        V.PLAIN_RATIO = ratio
        queries = {}
        for seed in args.seeds:
            path = cache / f"queries_r{ratio:g}_s{seed}.pkl"
            if not path.exists():
                path.write_bytes(pickle.dumps(verified_calibration_queries(snap, 300, seed, progress=False)[0]))
            queries[seed] = pickle.loads(path.read_bytes())
        look = V.match(*pair)
        for fit_seed, test_seed in (args.seeds, args.seeds[::-1]):
            tau, bias, weights = fit_with_geometry(queries[fit_seed])
            nll, r9, r99, f9 = held_out(queries[test_seed], tau, bias, weights)
            s = float(V.evidence(look.ncc)) - float(np.dot(weights, look.penalties()))
            p_look = 1.0 / (1.0 + np.exp((bias - s) / tau))
            print(f"{ratio:5g} {fit_seed:3d} {test_seed:4d} | {nll:6.4f} {r9:12.3f} {r99:6.3f} {f9:10.2f} | "
                  f"{tau:.3g}, {np.round(weights, 1).tolist()} | {1 - look.ncc:.1e}, {look.distortion:.3f}, "
                  f"{p_look:.3f}", flush=True)


if __name__ == "__main__":
    main()
