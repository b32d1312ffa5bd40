"""Design experiment, not a benchmark (issue 29, docs/results.md §12 "Where the pictures differ"): does the worst
local structure similarity of a verified match (verify.local_structure at a detail reading) separate copies from
look-alike originals? Pixel only, design seeds 7 / 9 (dedup_geometry.py's caches: 300 edited copies + 300 copies
without their original each) plus the queries the scan itself asks: every stamp searched without itself and its
pixel twins (the dreidels, l ~ I, O ~ Q are among them). As in the product, every original is in the fit (the
calibration samples the collection itself); copies are fitted on one seed and scored on the other. ~12 min for the
originals on one core, then ~3 min.

    SEEDS=7 PYTHONPATH=.:bench/design .venv/bin/python bench/design/dedup_geometry.py g7.json   # and SEEDS=9 g9.json
    PYTHONPATH=.:bench/design .venv/bin/python bench/design/dedup_structure.py g7.json g9.json originals.json
"""
import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

from search.duplicates import verify as V
from training.images import load_rgb

from dedup_geometry import design, features, files, nll


def originals() -> list:
    """Every stamp as a "none" query: candidates its 8 nearest by the 32 px whole-picture vector, twins left out."""
    rgbs = [load_rgb(p) for p in files]
    thumbs = [V.thumb(a) for a in rgbs]
    key = [(a.shape, a.tobytes()) for a in rgbs]
    base = np.stack([t.base for t in thumbs])
    out = []
    for i in range(len(rgbs)):
        cos = base @ thumbs[i].base
        cos[[j for j in range(len(rgbs)) if key[j] == key[i]]] = -np.inf
        cand = np.argsort(-cos)[:8]
        out.append({"kind": "none", "src": i, "cand": cand.tolist(), "png": True, "jpeg_step": 0.0,
                    "feats": [features(thumbs[i], thumbs[j]) for j in cand]})
    return [q for q in out if any(f is not None for f in q["feats"])]


def main():
    seeds = {}
    for path in sys.argv[1:3]:
        seeds.update(json.loads(Path(path).read_text()))
    cache = Path(sys.argv[3])
    orig = json.loads(cache.read_text()) if cache.is_file() else originals()
    cache.write_text(json.dumps(orig))
    e = lambda v: float(V.evidence(v))
    shipped = lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2]
    readings = {"ncc + stretch + crop^2 (before)": shipped,
                "+ local structure at 48 px (shipped)": lambda f: shipped(f) + [
                    float(-np.log1p(max(0.0, 1.0 - f["s48_c"]) / V.STRUCTURE_EPS))],
                "+ 1 - local structure (linear)": lambda f: shipped(f) + [-(1.0 - f["s48_c"])],
                "+ local structure at 64 px, n/10 windows": lambda f: shipped(f) + [
                    float(-np.log1p(max(0.0, 1.0 - f["s64_b"]) / V.STRUCTURE_EPS))]}
    for name, reading in readings.items():
        for fit_seed, test_seed in (("7", "9"), ("9", "7")):
            fit_d = design(seeds[fit_seed] + orig, reading)
            dims = fit_d[0][0].shape[1]
            w = min((minimize(nll, np.r_[b0, [1.0] * dims], args=(fit_d,), method="L-BFGS-B") for b0 in (2.0, 5.0)),
                    key=lambda r: r.fun).x
            test = seeds[test_seed] + orig
            n, copies = len(seeds[test_seed]), np.array([q["kind"] == "copy" for q in test])
            top = []
            for x, answer in design(test, reading):
                logits = np.r_[w[0], x @ w[1:]]
                p = np.exp(logits - logsumexp(logits))
                i = int(np.argmax(p[1:]))
                top.append((p[1 + i], i == answer))
            top = np.array(top, dtype=float)
            cells = [f"{name:42s} {fit_seed}->{test_seed} held-out NLL {nll(w, design(seeds[test_seed], reading)):.4f}"]
            for level in (0.5, 0.9, 0.99):
                kept = top[:, 0] >= level
                cells.append(f"p>={level}: copies {(kept & (top[:, 1] > 0) & copies).sum() / copies.sum():.3f}, "
                             f"originals matched {int(kept[n:].sum())}")
            print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
