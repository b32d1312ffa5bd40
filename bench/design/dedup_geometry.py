"""Design experiment, not a benchmark (issue 29, docs/results.md §12 "The match's geometry"): which reading
of a verified match separates edited copies from look-alikes? Pixel only, design seeds only (queries made
with seed 7, scored on 9, and the reverse): 300 edited copies of stamps (their original is the answer) and
300 copies searched without their original ("none"), candidates the 8 nearest by the verification's 32 px
whole-picture vector; each variant's (b, weights) fitted by maximum likelihood of the softmax with a "none"
option, then recall / wrong answers at p levels on the other seed. ~10 min on one core per seed.

    PYTHONPATH=. .venv/bin/python bench/design/dedup_geometry.py [CACHE.json]
"""
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter
from scipy.ndimage import gaussian_filter, uniform_filter
from scipy.optimize import minimize
from scipy.special import logsumexp

from search.duplicates import verify as V
from search.duplicates.calibration import expected_calibration_error
from training.images import load_rgb

from _queries import design_queries

files = sorted(Path("/usr/share/tuxpaint/stamps").rglob("*.png"))


def _win(work, params, m, blur):
    w, h = work.size
    x0, y0, sx, sy = params
    box = (min(max(x0 * w, 0.0), w), min(max(y0 * h, 0.0), h), min((x0 + sx) * w, w), min((y0 + sy) * h, h))
    im = work.resize((m, m), Image.BILINEAR, box=box)
    return im.filter(ImageFilter.GaussianBlur(blur)) if blur else im


def _ncc(u, v):
    u, v = u - u.mean(), v - v.mean()
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    return float(u @ v / (nu * nv)) if nu > 1e-3 and nv > 1e-3 else 0.0


def features(a, b):
    """The shipped match (ncc, distortion, cropped) and other readings at its window: luminance only, RGB at
    12 px, RGB at min(64, the smaller picture's longest side) px with a 1 px low-pass, where the residual lies, and
    the largest local energy of the low-passed signed residual at that reading (a coherent difference)."""
    if a.blank or b.blank:
        return None
    m = V.fine_size(a, b)
    best = None
    for s, d in ((a, b), (b, a)):
        v, params = V._fine(s, d, V._one_way(s, d)[1], m)
        if best is None or v > best[0]:
            best = (v, params, s, d)
    v, params, s, d = best
    distortion, cropped = V._geometry(s, d, params)
    full = (0.0, 0.0, 1.0, 1.0)
    lum = np.array([0.299, 0.587, 0.114], np.float32)
    grey = lambda im: (np.asarray(im, np.float32) @ lum).ravel()
    rgb = lambda im: np.asarray(im, np.float32).ravel()
    # where the residual lies: u - (u.w) w of the two unit vectors at n x n, its energy per block of a 4 x 4 grid;
    # the share of the largest block (1/16 when spread like JPEG noise, near 1 when one part differs)
    u, w = V._window(s.work, params, m, V.BLUR), V._whole(d, m)
    r = ((u - (u @ w) * w).reshape(m, m, 3) ** 2).sum(axis=2)
    edges = np.linspace(0, m, 5).round().astype(int)
    blocks = np.array([r[edges[i]:edges[i + 1], edges[j]:edges[j + 1]].sum() for i in range(4) for j in range(4)])
    # a finer reading of the same window: n = min(64, the smaller picture's longest side), 1 px low-pass
    fine = int(max(8, min(64, max(s.work.size), max(d.work.size))))
    whole = V._window(d.work, None, fine, 1.0)
    v64, p64 = V._compass(lambda p: float(V._window(s.work, p, fine, 1.0) @ whole), V._clipped(params), V.FINE_STEP)
    # a coherent difference (a stroke one picture has) survives a low-pass of the SIGNED residual; JPEG noise and
    # edge misregistration alternate in sign and cancel: the largest energy of G_1.5 * r in a window of n/8 px
    u64 = V._window(s.work, p64, fine, 1.0)
    res = (u64 - (u64 @ whole) * whole).reshape(fine, fine, 3)
    smooth = gaussian_filter(res, sigma=(1.5, 1.5, 0))
    side = max(2, fine // 8)
    local = uniform_filter((smooth ** 2).sum(axis=2), size=side) * side ** 2
    coherent_peak = float(local.max())
    # the worst local structure similarity (SSIM's s-term) at that reading, and at n = min(48, ...): Gaussian
    # windows of n/16 or n/10 px, a floor c times the mean per-pixel energy (flat windows read as similar)
    structure = {f"s64_{k}": V.local_structure(u64, whole, fine, *cfg) for k, cfg in STRUCTURE_CFGS.items()}
    n48 = V.fine_size(s, d, 48)
    whole48 = V._window(d.work, None, n48, 1.0)
    _, p48 = V._compass(lambda p: float(V._window(s.work, p, n48, 1.0) @ whole48), V._clipped(params), V.FINE_STEP)
    u48 = V._window(s.work, p48, n48, 1.0)
    structure.update({f"s48_{k}": V.local_structure(u48, whole48, n48, *cfg) for k, cfg in STRUCTURE_CFGS.items()})
    return {**structure, "v": v, "v64": v64, "coherent_peak": coherent_peak, "distortion": distortion, "cropped": cropped,
            "block_share": float(blocks.max() / max(r.sum(), 1e-12)),
            "block_residual": float(blocks.max()),
            "lum": _ncc(grey(_win(s.work, params, m, V.BLUR)), grey(_win(d.work, full, m, V.BLUR))),
            "rgb12": _ncc(rgb(_win(s.work, params, 12, V.BLUR)), rgb(_win(d.work, full, 12, V.BLUR)))}


STRUCTURE_CFGS = {"a": (1 / 16, 0.5), "b": (1 / 10, 0.5), "c": (1 / 16, 0.1)}


def collect(seed, rgbs, thumbs, twins, m=300, k=8):
    out = []
    for kind, src, cand, th, png, step in design_queries(seed, rgbs, thumbs, twins, m, k):
        out.append({"kind": kind, "src": src, "cand": cand.tolist(), "png": png, "jpeg_step": step,
                    "feats": [features(th, thumbs[j]) for j in cand]})
        if len(out) in (m, 2 * m):
            print(f"seed {seed}: {kind} queries done", flush=True)
    return out


def design(queries, reading):
    out = []
    for q in queries:
        kept = [(c, f) for c, f in zip(q["cand"], q["feats"]) if f is not None]
        per_query = {"lossless": float(q["png"]), "jpeg_step": q.get("jpeg_step", 0.0)}
        x = np.array([reading({**f, **per_query}) for _, f in kept], dtype=np.float64).reshape(len(kept), -1)
        answer = next((i for i, (c, _) in enumerate(kept) if q["kind"] == "copy" and c == q["src"]), -1)
        out.append((x, answer))
    return out


def nll(w, data):
    total = 0.0
    for x, answer in data:
        logits = np.r_[w[0], x @ w[1:]]
        total += logsumexp(logits) - logits[answer + 1]
    return total / len(data)


def evaluate(name, reading, fit_q, test_q):
    fit_d, test_d = design(fit_q, reading), design(test_q, reading)
    dims = fit_d[0][0].shape[1]
    w = min((minimize(nll, np.r_[b0, [1.0] * dims], args=(fit_d,), method="L-BFGS-B") for b0 in (2.0, 5.0)),
            key=lambda r: r.fun).x
    conf, ok = [], []
    for x, answer in test_d:
        logits = np.r_[w[0], x @ w[1:]]
        p = np.exp(logits - logsumexp(logits))
        i = int(np.argmax(p[1:])) if x.size else -1
        conf.append(p[1 + i] if i >= 0 else 0.0)
        ok.append(i >= 0 and i == answer)
    conf, ok = np.array(conf), np.array(ok)
    copies = np.array([q["kind"] == "copy" for q in test_q])
    cells = [f"{name:34s} nll {nll(w, test_d):.4f}  ECE {expected_calibration_error(conf, ok)[0]:.3f}"]
    for level in (0.9, 0.95, 0.99):
        kept = conf >= level
        cells.append(f"p>={level}: {(ok & copies & kept).sum() / copies.sum():.3f} / {((~ok) & kept).sum()}")
    print(" | ".join(cells), flush=True)


def main():
    V.MIN_SCALE = float(__import__("os").environ.get("MIN_SCALE", V.MIN_SCALE))   # a design variant of the crop limit
    cache = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if cache and cache.is_file():
        data = json.loads(cache.read_text())
    else:
        rgbs = [load_rgb(p) for p in files]
        thumbs = [V.thumb(a) for a in rgbs]
        key = [(a.shape, a.tobytes()) for a in rgbs]
        twins = {i: {j for j in range(len(rgbs)) if key[j] == key[i]} for i in range(len(rgbs))}
        seeds = [int(v) for v in __import__("os").environ.get("SEEDS", "7,9").split(",")]
        data = {str(s): collect(s, rgbs, thumbs, twins) for s in seeds}
        if len(seeds) < 2:   # one seed per process: merge the caches afterwards
            cache.write_text(json.dumps(data))
            return
        if cache:
            cache.write_text(json.dumps(data))
    e = lambda v: float(V.evidence(v))
    readings = {
        "ncc (the reading before)": lambda f: [e(f["v"])],
        "luminance ncc": lambda f: [e(f["lum"])],
        "ncc + stretch": lambda f: [e(f["v"]), f["distortion"]],
        "ncc + crop^2": lambda f: [e(f["v"]), f["cropped"] ** 2],
        "ncc + stretch + crop (linear)": lambda f: [e(f["v"]), f["distortion"], f["cropped"]],
        "ncc + stretch + crop^2 (shipped)": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2],
        "luminance + stretch + crop^2": lambda f: [e(f["lum"]), f["distortion"], f["cropped"] ** 2],
        "ncc + 12 px + stretch + crop^2": lambda f: [e(f["v"]), e(f["rgb12"]), f["distortion"], f["cropped"] ** 2],
        "shipped + 64 px reading": lambda f: [e(f["v"]), e(f["v64"]), f["distortion"], f["cropped"] ** 2],
        "shipped + what the 64 px reading loses": lambda f: [e(f["v"]), max(0.0, e(f["v"]) - e(f["v64"])),
                                                             f["distortion"], f["cropped"] ** 2],
        "shipped + coherent residual peak": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2,
                                                      float(np.log(f["coherent_peak"] + 1e-6))],
        "shipped + lossless pair": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2, f["lossless"]],
        "shipped + lossless pair + its own slope": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2,
                                                             f["lossless"], f["lossless"] * e(f["v"])],
        "shipped + the copy's JPEG step": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2, f["jpeg_step"]],
        "shipped + JPEG step + its own slope": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2,
                                                         f["jpeg_step"], f["jpeg_step"] * e(f["v"])],
        "64 px reading + stretch + crop^2": lambda f: [e(f["v64"]), f["distortion"], f["cropped"] ** 2],
        "shipped + largest block's share": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2, f["block_share"]],
        "shipped + largest block's residual": lambda f: [e(f["v"]), f["distortion"], f["cropped"] ** 2,
                                                         e(1.0 - f["block_residual"])],
    }
    for fit_seed, test_seed in (("7", "9"), ("9", "7")):
        print(f"fitted on seed {fit_seed}, scored on seed {test_seed}: recall / wrong answers at each level")
        for name, reading in readings.items():
            evaluate(name, reading, data[fit_seed], data[test_seed])


if __name__ == "__main__":
    main()
