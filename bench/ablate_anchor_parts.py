"""Training-free parts beside the tower in the served embedding: which ones lift folders without classes.

Loads screen checkpoints that bench/ablate_folder.py trained (tower alone) and scores, on the same held-out
queries, label precision@10 of the cosine of weighted unit parts: the tower, 32x32 grey pixels (the baseline),
the shipped 8x8x8 colour histogram, and candidates a fixed function of the pixels can give: coarser grey
thumbnails (16x16, 8x8) and a gradient-orientation grid (a HOG: magnitude-weighted orientation histograms
of the 32x32 grey image in a grid of cells, square-rooted). Each mix is paired against the shipped one
(tower 0.4, grey 0.3, colour 0.3) and against pixels.

    ABLATE_WORK=/path python bench/ablate_anchor_parts.py --collections elementary,mate --configs encnb
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
from ablate_colour import centred, rgb_histogram  # noqa: E402
from ablate_folder import WORK, _embed, split_collection  # noqa: E402

OUT = (
    REPO / "bench" / "results" / "ablate_anchor_parts_runs.json"
)  # per run; summary: ablate_anchor_parts.json

# name -> {part: weight}; parts: t (tower), g32 / g16 / g8 (grey thumbnails), c (colour histogram),
# h4 / h2 (HOG on a 4x4 / 2x2 grid of cells, 8 unsigned orientations), hs4 (4x4 grid, 16 signed orientations)
MIXES: dict[str, dict[str, float]] = {
    "pixels": {"g32": 1.0},
    "tower": {"t": 1.0},
    "shipped": {"t": 0.4, "g32": 0.3, "c": 0.3},
    "g16": {"g16": 1.0},
    "g8": {"g8": 1.0},
    "h4": {"h4": 1.0},
    "h2": {"h2": 1.0},
    "hs4": {"hs4": 1.0},
    "g32+c": {"g32": 0.5, "c": 0.5},
    "g16+c": {"g16": 0.5, "c": 0.5},
    "g32+h4": {"g32": 0.5, "h4": 0.5},
    "g32+h4+c": {"g32": 0.34, "h4": 0.33, "c": 0.33},
    "g16+h4+c": {"g16": 0.34, "h4": 0.33, "c": 0.33},
    "t.4 g16.3 c.3": {"t": 0.4, "g16": 0.3, "c": 0.3},
    "t.4 g.2 h.2 c.2": {"t": 0.4, "g32": 0.2, "h4": 0.2, "c": 0.2},
    "t.3 g.25 h.2 c.25": {"t": 0.3, "g32": 0.25, "h4": 0.2, "c": 0.25},
    "t.4 g16.2 h.2 c.2": {"t": 0.4, "g16": 0.2, "h4": 0.2, "c": 0.2},
    "t.25 g.25 h.25 c.25": {"t": 0.25, "g32": 0.25, "h4": 0.25, "c": 0.25},
    "t.4 g.3 hs.1 c.2": {"t": 0.4, "g32": 0.3, "hs4": 0.1, "c": 0.2},
    "hs2": {"hs2": 1.0},
    "hs8": {"hs8": 1.0},
    "hs4b8": {"hs4b8": 1.0},
    "o4p1": {"o4p1": 1.0},
    "o4p4": {"o4p4": 1.0},
    "o4p8": {"o4p8": 1.0},
    "o4p4d8": {"o4p4d8": 1.0},
    "o8p4": {"o8p4": 1.0},
    "g32+hs4+c": {"g32": 0.34, "hs4": 0.33, "c": 0.33},
    "g32+o4p4+c": {"g32": 0.34, "o4p4": 0.33, "c": 0.33},
    "t.25 g.25 hs.25 c.25": {"t": 0.25, "g32": 0.25, "hs4": 0.25, "c": 0.25},
    "t.25 g.25 o4p4.25 c.25": {"t": 0.25, "g32": 0.25, "o4p4": 0.25, "c": 0.25},
    "t.25 g.25 o8p4.25 c.25": {"t": 0.25, "g32": 0.25, "o8p4": 0.25, "c": 0.25},
    "t.3 g.2 o4p4.25 c.25": {"t": 0.3, "g32": 0.2, "o4p4": 0.25, "c": 0.25},
    "t.2 g.2 o4p4.3 c.3": {"t": 0.2, "g32": 0.2, "o4p4": 0.3, "c": 0.3},
    "t.35 g.2 o4p4.25 c.2": {"t": 0.35, "g32": 0.2, "o4p4": 0.25, "c": 0.2},
    "t.4 g.2 o4p4.2 c.2": {"t": 0.4, "g32": 0.2, "o4p4": 0.2, "c": 0.2},
    "t.5 g.15 o4p4.2 c.15": {"t": 0.5, "g32": 0.15, "o4p4": 0.2, "c": 0.15},
    "t.25 g.15 o4p4.35 c.25": {"t": 0.25, "g32": 0.15, "o4p4": 0.35, "c": 0.25},
    # the shipped gradient part (encoder.gradient_histogram: nearest of 16 signed directions, 4x4 cells)
    "e4": {"e4": 1.0},
    "e8": {"e8": 1.0},
    "e4b8": {"e4b8": 1.0},
    "g.34 c.33 e.33": {"g32": 0.34, "c": 0.33, "e4": 0.33},
    "t.25 g.25 c.25 e.25": {"t": 0.25, "g32": 0.25, "c": 0.25, "e4": 0.25},
    "t.3 g.2 c.25 e.25": {"t": 0.3, "g32": 0.2, "c": 0.25, "e4": 0.25},
    "t.3 g.25 c.2 e.25": {"t": 0.3, "g32": 0.25, "c": 0.2, "e4": 0.25},
    "t.2 g.2 c.3 e.3": {"t": 0.2, "g32": 0.2, "c": 0.3, "e4": 0.3},
    "t.2 g.25 c.25 e.3": {"t": 0.2, "g32": 0.25, "c": 0.25, "e4": 0.3},
    "t.3 g.2 c.2 e.3": {"t": 0.3, "g32": 0.2, "c": 0.2, "e4": 0.3},
    "t.35 g.2 c.2 e.25": {"t": 0.35, "g32": 0.2, "c": 0.2, "e4": 0.25},
    "t.4 g.2 c.2 e.2": {"t": 0.4, "g32": 0.2, "c": 0.2, "e4": 0.2},
    "t.5 g.15 c.15 e.2": {"t": 0.5, "g32": 0.15, "c": 0.15, "e4": 0.2},
    "t.6 g.1 c.1 e.2": {"t": 0.6, "g32": 0.1, "c": 0.1, "e4": 0.2},
    "t.25 g.15 c.25 e.35": {"t": 0.25, "g32": 0.15, "c": 0.25, "e4": 0.35},
    "t.25 g.25 c.25 e8.25": {"t": 0.25, "g32": 0.25, "c": 0.25, "e8": 0.25},
    "t.3 g.2 c.25 e8.25": {"t": 0.3, "g32": 0.2, "c": 0.25, "e8": 0.25},
    "t.25 g.25 c.25 e4b8.25": {"t": 0.25, "g32": 0.25, "c": 0.25, "e4b8": 0.25},
}


def grey(x, side: int) -> np.ndarray:
    import torch.nn.functional as F

    g = x.float().mean(1, keepdim=True)
    if g.shape[-1] != side:
        g = F.interpolate(g, size=(side, side), mode="area")
    return g


def hog(x, grid: int = 4, bins: int = 8, signed: bool = False) -> np.ndarray:
    """(B, grid^2 bins) gradient-orientation histograms of the 32x32 grey image, magnitude-weighted, one per
    cell of a grid x grid layout, L2-normalised over the whole descriptor, square-rooted."""
    g = grey(x, 32)[:, 0].numpy().astype(np.float64)  # (B, 32, 32)
    gx = np.zeros_like(g)
    gy = np.zeros_like(g)
    gx[:, :, 1:-1] = g[:, :, 2:] - g[:, :, :-2]
    gy[:, 1:-1, :] = g[:, 2:, :] - g[:, :-2, :]
    mag = np.hypot(gx, gy)
    ang = np.arctan2(gy, gx)  # (-pi, pi]
    period = 2 * np.pi if signed else np.pi
    o = ((np.mod(ang, period) / period) * bins).astype(int).clip(max=bins - 1)
    b, s = g.shape[0], g.shape[1]
    out = np.zeros((b, grid, grid, bins))
    cell = s // grid
    for cy in range(grid):
        for cx in range(grid):
            sl = (slice(None), slice(cy * cell, (cy + 1) * cell), slice(cx * cell, (cx + 1) * cell))
            oo, mm = o[sl].reshape(b, -1), mag[sl].reshape(b, -1)
            for k in range(bins):
                out[:, cy, cx, k] = (mm * (oo == k)).sum(1)
    out = out.reshape(b, -1)
    out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return np.sqrt(out)


def oriented(x, grid: int = 4, dirs: int = 16, power: float = 4.0) -> np.ndarray:
    """The HOG's orientation binning as projections (convolutions and a ReLU, no angle): per direction
    theta_k, relu(gx cos theta_k + gy sin theta_k)^p / |g|^(p-1) (|g| times a cosine lobe of width set by p),
    averaged over each cell of a grid x grid layout, L2-normalised, square-rooted."""
    import torch
    import torch.nn.functional as F

    g = grey(x, 32)
    gp = F.pad(g, (1, 1, 1, 1), mode="replicate")
    gx = (gp[:, :, 1:-1, 2:] - gp[:, :, 1:-1, :-2]).double()
    gy = (gp[:, :, 2:, 1:-1] - gp[:, :, :-2, 1:-1]).double()
    th = torch.arange(dirs, dtype=torch.float64) * (2 * np.pi / dirs)
    proj = gx * th.cos().view(1, -1, 1, 1) + gy * th.sin().view(1, -1, 1, 1)  # (B, dirs, 32, 32)
    mag = torch.sqrt(gx**2 + gy**2) + 1e-6
    r = F.relu(proj) ** power / mag ** (power - 1)
    h = F.adaptive_avg_pool2d(r, grid).flatten(1)
    h = h / h.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return h.sqrt().numpy()


def encoder_gradient(x, grid: int = 4, bins: int = 16) -> np.ndarray:
    """The shipped gradient part (training/encoder.py's gradient_histogram) of preprocessed images."""
    from training.encoder import EncoderConfig, create_encoder

    cfg = EncoderConfig(
        width=8,
        layers=(1, 1, 1, 1),
        heads=2,
        embed_dim=8,
        image_size=x.shape[-1],
        gradient_weight=0.1,
        gradient_grid=grid,
        gradient_bins=bins,
    )
    return create_encoder(cfg).gradient_histogram(x).numpy()


def parts_of(x) -> dict[str, np.ndarray]:
    return {
        "e4": encoder_gradient(x, 4, 16),
        "e8": encoder_gradient(x, 8, 16),
        "e4b8": encoder_gradient(x, 4, 8),
        "g32": grey(x, 32).flatten(1).numpy(),
        "g16": grey(x, 16).flatten(1).numpy(),
        "g8": grey(x, 8).flatten(1).numpy(),
        "c": rgb_histogram(x, 8),
        "h4": hog(x, 4, 8),
        "h2": hog(x, 2, 8),
        "hs4": hog(x, 4, 16, signed=True),
        "hs2": hog(x, 2, 16, signed=True),
        "hs8": hog(x, 8, 16, signed=True),
        "hs4b8": hog(x, 4, 8, signed=True),
        "o4p1": oriented(x, 4, 16, 1.0),
        "o4p4": oriented(x, 4, 16, 4.0),
        "o4p8": oriented(x, 4, 16, 8.0),
        "o4p4d8": oriented(x, 4, 8, 4.0),
        "o8p4": oriented(x, 8, 16, 4.0),
    }


def score(ckpt: Path, classes_root: Path, cache_dir: Path) -> dict:
    from search.evaluation.baselines import paired_difference, per_query_precision
    from training.checkpoint import load_checkpoint
    from training.datasets import create_dataset

    enc, _ = load_checkpoint(ckpt)
    enc.eval()
    kw = dict(root=str(classes_root), image_size=enc.image_size, cache_dir=str(cache_dir), progress=False)
    db, q = create_dataset("folder", "train", **kw), create_dataset("folder", "test", **kw)
    xdb, xq = db.tensors(np.arange(len(db))), q.tensors(np.arange(len(q)))
    pdb, pq = parts_of(xdb), parts_of(xq)
    parts = {k: centred(pdb[k], pq[k]) for k in pdb}
    parts["t"] = (_embed(enc, db, anchored=False), _embed(enc, q, anchored=False))

    def p10(mix):
        zdb = np.hstack([np.sqrt(w) * parts[k][0] for k, w in mix.items()])
        zq = np.hstack([np.sqrt(w) * parts[k][1] for k, w in mix.items()])
        return per_query_precision(zq, zdb, q.labels, db.labels, 10)

    per = {name: p10(mix) for name, mix in MIXES.items()}
    return {
        "n_db": len(db),
        "n_queries": len(q),
        "p10": {k: float(v.mean()) for k, v in per.items()},
        "vs_shipped": {k: paired_difference(v, per["shipped"]) for k, v in per.items() if k != "shipped"},
        "vs_pixels": {k: paired_difference(v, per["pixels"]) for k, v in per.items() if k != "pixels"},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collections", default="elementary,mate")
    p.add_argument("--configs", default="encnb")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--tag", default="screen")
    p.add_argument("--redo", action="store_true", help="score runs already in the results again")
    p.add_argument(
        "--checkpoint",
        nargs=3,
        metavar=("NAME", "CHECKPOINT", "CLASSES_ROOT"),
        action="append",
        default=[],
        help="also score this checkpoint on the class layout's train/ + test/ (run NAME: coll--cfg--sN--tag)",
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("ABLATE_THREADS", "1")))
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name, ck, root in args.checkpoint:
        if name not in res or args.redo:
            res[name] = score(Path(ck), Path(root), WORK / "cache")
            OUT.write_text(json.dumps(res, indent=1) + "\n")
            print(name, " ".join(f"{k} {v:.3f}" for k, v in list(res[name]["p10"].items())[:3]), flush=True)
    for coll in args.collections.split(","):
        for cfg in args.configs.split(","):
            for seed in [int(s) for s in args.seeds.split(",")]:
                name = f"{coll}--{cfg}--s{seed}" + (f"--{args.tag}" if args.tag else "")
                ck = WORK / "runs" / name / "checkpoint.safetensors"
                if not ck.exists() or (name in res and not args.redo):
                    continue
                classes, _ = split_collection(coll, seed)
                res[name] = score(ck, classes, WORK / "cache")
                OUT.write_text(json.dumps(res, indent=1) + "\n")
                print(
                    name, " ".join(f"{k} {v:.3f}" for k, v in list(res[name]["p10"].items())[:3]), flush=True
                )
    summary(res)
    return 0


def summary(res: dict) -> None:
    """Mean over seeds of each mix minus pixels per collection x config: ablate_anchor_parts.json."""
    groups: dict = {}
    for name, r in res.items():
        coll, cfg, _seed, *tag = name.split("--")
        groups.setdefault((coll, cfg + (f" [{tag[0]}]" if tag else "")), []).append(r)
    rows = []
    for (coll, cfg), rs in sorted(groups.items()):
        px = float(np.mean([r["p10"]["pixels"] for r in rs]))
        print(f"== {coll} {cfg} ({len(rs)} seeds) pixels {px:.3f}")
        for k in rs[0]["p10"]:
            if not all(k in r["p10"] for r in rs):
                continue
            v = float(np.mean([r["p10"][k] for r in rs]))
            if k != "pixels":
                rows.append(row(f"{coll} {cfg} {k} p@10 ({len(rs)} seeds; baseline pixels)", v, "p@10", px))
            vs = [r["vs_shipped"].get(k) for r in rs]
            vs_s = " ".join(f"{x['mean']:+.3f}[{x['low']:+.3f},{x['high']:+.3f}]" for x in vs if x)
            print(f"  {k:22s} {v:.3f} -pix {v - px:+.3f}   vs shipped {vs_s}")
    if rows:
        write_results("ablate_anchor_parts", rows)


if __name__ == "__main__":
    sys.exit(main())
