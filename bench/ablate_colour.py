"""What the served embedding's anchor carries: tower + grey pixels + a colour part, scored after the fact.

Loads the screen checkpoints that bench/ablate_folder.py trained (tower alone) and scores, on the same
held-out queries, the cosine of [sqrt(a) tower, sqrt(b) grey, sqrt(c) colour] for a grid of weights
(a + b + c = 1) and colour descriptors (a small RGB thumbnail or a joint RGB histogram, both centred on
the indexed images' mean and unit), paired against the shipped anchor (tower 0.5, grey 0.5) and pixels.

    ABLATE_WORK=/path python bench/ablate_colour.py --collections stamps,oxygen --configs encnb,label
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _common import row, write_results  # noqa: E402
from ablate_folder import WORK, _embed, split_collection  # noqa: E402

OUT = REPO / "bench" / "results" / "ablate_colour_runs.json"  # per run; the summary: ablate_colour.json
# (tower, grey, colour) weights; (0.5, 0.5, 0) is the shipped anchor
GRID = [
    (0.5, 0.5, 0.0),
    (0.5, 0.4, 0.1),
    (0.5, 0.3, 0.2),
    (0.4, 0.4, 0.2),
    (0.4, 0.3, 0.3),
    (0.6, 0.3, 0.1),
    (0.3, 0.5, 0.2),
    (0.5, 0.25, 0.25),
    (0.0, 0.8, 0.2),
    (0.0, 0.5, 0.5),
    (0.2, 0.4, 0.4),
    (0.2, 0.5, 0.3),
    (0.3, 0.35, 0.35),
    (0.1, 0.45, 0.45),
    (0.0, 0.6, 0.4),
    (0.0, 0.4, 0.6),
]


def rgb_thumbnail(x, side: int) -> np.ndarray:
    """(B, 3 side^2) area-resized RGB of preprocessed images."""
    import torch.nn.functional as F

    return F.interpolate(x.float(), size=(side, side), mode="area").flatten(1).numpy()


def rgb_histogram(x, bins: int = 4, grid: int = 1) -> np.ndarray:
    """(B, grid^2 bins^3) joint RGB histograms (fractions of pixels) of each cell of a grid x grid
    layout, square-rooted (a Hellinger embedding)."""
    p = ((x.float().clamp(-1, 1) + 1) / 2 * bins).long().clamp(max=bins - 1)  # (B, 3, S, S)
    code = ((p[:, 0] * bins + p[:, 1]) * bins + p[:, 2]).numpy()  # (B, S, S)
    b, s = code.shape[0], code.shape[1]
    cells = []
    for gy in range(grid):
        for gx in range(grid):
            c = code[:, gy * s // grid : (gy + 1) * s // grid, gx * s // grid : (gx + 1) * s // grid]
            c = c.reshape(b, -1)
            h = np.stack([np.bincount(c[i], minlength=bins**3) for i in range(b)]).astype(np.float64)
            cells.append(np.sqrt(h / h.sum(1, keepdims=True)))
    return np.hstack(cells) / np.sqrt(grid * grid)


def centred(db: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = db.mean(0)

    def unit(a):
        a = a - m
        return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)

    return unit(db).astype(np.float32), unit(q).astype(np.float32)


def score(ckpt: Path, classes_root: Path, cache_dir: Path, only: str = "") -> dict:
    from search.evaluation.baselines import paired_difference, per_query_precision, raw_pixel_features
    from training.checkpoint import load_checkpoint
    from training.datasets import create_dataset

    enc, _ = load_checkpoint(ckpt)
    enc.eval()
    kw = dict(root=str(classes_root), image_size=enc.image_size, cache_dir=str(cache_dir), progress=False)
    db, q = create_dataset("folder", "train", **kw), create_dataset("folder", "test", **kw)
    xdb, xq = db.tensors(np.arange(len(db))), q.tensors(np.arange(len(q)))
    t = (_embed(enc, db, anchored=False), _embed(enc, q, anchored=False))
    g = centred(raw_pixel_features(xdb), raw_pixel_features(xq))
    colours = {
        "rgb8": centred(rgb_thumbnail(xdb, 8), rgb_thumbnail(xq, 8)),
        "rgb4": centred(rgb_thumbnail(xdb, 4), rgb_thumbnail(xq, 4)),
        "hist4": centred(rgb_histogram(xdb), rgb_histogram(xq)),
        "hist3": centred(rgb_histogram(xdb, 3), rgb_histogram(xq, 3)),
        "hist8": centred(rgb_histogram(xdb, 8), rgb_histogram(xq, 8)),
        "hist4g2": centred(rgb_histogram(xdb, 4, 2), rgb_histogram(xq, 4, 2)),
    }

    def p10(parts):
        zdb = np.hstack([np.sqrt(w) * a for w, (a, _) in parts if w > 0])
        zq = np.hstack([np.sqrt(w) * b for w, (_, b) in parts if w > 0])
        return per_query_precision(zq, zdb, q.labels, db.labels, 10)

    if only:
        colours = {k: v for k, v in colours.items() if k in only.split(",")}
    per = {"pixels": p10([(1.0, g)]), "tower": p10([(1.0, t)]), "anchor": p10([(0.5, t), (0.5, g)])}
    for cname, c in colours.items():
        for a, b, cw in GRID:
            if cw == 0:
                continue
            key = "anchor" if cw == 0 else f"{cname} t{a:g} g{b:g} c{cw:g}"
            per[key] = p10([(a, t), (b, g), (cw, c)])
    ref = per["anchor"]
    return {
        "n_db": len(db),
        "n_queries": len(q),
        "p10": {k: float(v.mean()) for k, v in per.items()},
        "vs_anchor": {k: paired_difference(v, ref) for k, v in per.items() if k != "anchor"},
        "vs_pixels": {k: paired_difference(v, per["pixels"]) for k, v in per.items() if k != "pixels"},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collections", default="stamps,oxygen")
    p.add_argument("--configs", default="encnb,label")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tag", default="screen")
    p.add_argument("--redo", action="store_true", help="score runs already in the results again")
    p.add_argument("--colours", default="", help="only these colour descriptors (comma-separated)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("ABLATE_THREADS", "1")))
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    for coll in args.collections.split(","):
        for cfg in args.configs.split(","):
            for seed in [int(s) for s in args.seeds.split(",")]:
                name = f"{coll}--{cfg}--s{seed}" + (f"--{args.tag}" if args.tag else "")
                ck = WORK / "runs" / name / "checkpoint.safetensors"
                if not ck.exists() or (name in res and not args.redo):
                    continue
                classes, _ = split_collection(coll, seed)
                res[name] = score(ck, classes, WORK / "cache", args.colours)
                OUT.write_text(json.dumps(res, indent=1) + "\n")
                r = res[name]["p10"]
                print(
                    name,
                    f"pixels {r['pixels']:.3f} tower {r['tower']:.3f} anchor {r['anchor']:.3f}",
                    flush=True,
                )
    summary(res)
    return 0


def summary(res: dict) -> None:
    """Mean over seeds of each combination minus pixels, per collection x config (and run tag); rows of
    bench/results/ablate_colour.json: each mix's mean p@10 against the pixels' mean."""
    groups: dict = {}
    for name, r in res.items():
        coll, cfg, _seed, *tag = name.split("--")
        groups.setdefault((coll, cfg + (f" [{tag[0]}]" if tag else "")), []).append(r)
    rows = []
    for (coll, cfg), rs in sorted(groups.items()):
        px = float(np.mean([r["p10"]["pixels"] for r in rs]))
        for k in rs[0]["p10"]:
            if k != "pixels" and all(k in r["p10"] for r in rs):
                v = float(np.mean([r["p10"][k] for r in rs]))
                rows.append(row(f"{coll} {cfg} {k} p@10 ({len(rs)} seeds; baseline pixels)", v, "p@10", px))
    write_results("ablate_colour", rows)
    for (coll, cfg), rs in sorted(groups.items()):
        print(f"== {coll} {cfg} ({len(rs)} seeds)")
        for k in rs[0]["p10"]:
            d = [r["p10"][k] - r["p10"]["pixels"] for r in rs]
            va = [r["vs_anchor"].get(k) for r in rs]
            va_s = " ".join(f"{v['mean']:+.3f}[{v['low']:+.3f},{v['high']:+.3f}]" for v in va if v)
            print(f"  {k:26s} -pix {np.mean(d):+.3f}   vs anchor {va_s}")


if __name__ == "__main__":
    sys.exit(main())
