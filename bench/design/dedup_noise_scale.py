"""Design experiment, not a benchmark (issue 29, docs/results.md §12 "Tried and not kept"): does reading the
verification distance 1 - v relative to the candidate's own copy noise sigma_j (edited copies of j scored
against j) separate copies from look-alikes better? Pixel only: candidates are the 8 nearest by the
verification's whole-picture 32 px vector; design seeds only (sigma 11, fit 7, scored on 9). ~10 min.

    PYTHONPATH=. .venv/bin/python bench/design/dedup_noise_scale.py      # prints the table
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from search.duplicates import verify
from search.duplicates.edits import edited_copy
from search.duplicates.calibration import scored_candidates, fit, top1, expected_calibration_error
from training.images import load_rgb

from _queries import design_queries

files = sorted(Path("/usr/share/tuxpaint/stamps").rglob("*.png"))
rgbs = [load_rgb(p) for p in files]
thumbs = [verify.thumb(a) for a in rgbs]
n = len(files)
key = [(a.shape, a.tobytes()) for a in rgbs]
twins = {i: {j for j in range(n) if key[j] == key[i]} for i in range(n)}
print(n, "stamps", sum(len(v) > 1 for v in twins.values()), "with twins", flush=True)

t0 = time.time()
rng = np.random.default_rng(11)
sigma = np.zeros(n)
for i in range(n):
    d = [1 - verify.score(verify.thumb(load_rgb(edited_copy(Image.fromarray(rgbs[i]), rng)[0])), thumbs[i]) for _ in range(2)]
    sigma[i] = np.mean(d)
print("sigma done", time.time() - t0, "s; quantiles", np.quantile(sigma, [0.1, 0.5, 0.9, 0.99]), flush=True)

K = 8
def queries(seed, m=300):
    out = []
    for kind, src, cand, th, *_ in design_queries(seed, rgbs, thumbs, twins, m, K):
        out.append((kind, src, cand, np.array([verify.score(th, thumbs[j]) for j in cand])))
    return out

fitq, testq = queries(7), queries(9)
print("queries done", time.time() - t0, flush=True)
if len(sys.argv) > 1:   # optional: keep the raw scores
    Path(sys.argv[1]).write_text(json.dumps({"sigma": sigma.tolist(),
                                             "fit": [(k, s, c.tolist(), v.tolist()) for k, s, c, v in fitq],
                                             "test": [(k, s, c.tolist(), v.tolist()) for k, s, c, v in testq]}))

def evid(v, cand, a, floor):
    return verify.evidence(v) + a * np.log(np.maximum(sigma[cand], floor))

def qs(qq, a, floor):
    out = []
    for kind, src, cand, v in qq:
        src_ok = src if kind == "copy" else -1
        out.append(scored_candidates(evid(v, cand, a, floor), cand, src_ok if src_ok in cand.tolist() else -1))
    return out

for a in (0.0, 0.5, 1.0):
    for floor in (1e-4, 1e-3):
        if a == 0 and floor > 1e-4: continue
        tau, b = fit(qs(fitq, a, floor))
        res = [top1(q, tau, b) for q in qs(testq, a, floor)]
        conf = np.array([c for c, _ in res]); ok = np.array([o for _, o in res])
        ece, _ = expected_calibration_error(conf, ok)
        pos = np.array([k == "copy" for k, *_ in testq])
        row = [f"a={a} floor={floor:g} tau={tau:.3f} ece={ece:.3f}"]
        for P in (0.9, 0.95, 0.99):
            rec = (ok & pos & (conf >= P)).sum() / pos.sum()
            wrong = ((~ok) & (conf >= P)).sum()
            prec = (ok & (conf >= P)).sum() / max((conf >= P).sum(), 1)
            row.append(f"P{P}: rec {rec:.3f} wrong {wrong} prec {prec:.3f}")
        print(" | ".join(row), flush=True)
