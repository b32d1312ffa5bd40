"""Near-duplicates on a real folder with planted edited copies: softsearch's scan against dHash, pHash
(imagehash), PDQ (pdqhash) and, with --checkpoint, cosine >= 0.99 on the encoder's embeddings (immich's rule).

A random --planted share of the folder's images (at most --max-items of them) gets one or two edited copies
(search/duplicates/edits.py: JPEG, resize, crop <= 20 %, rotation <= 5 degrees, brightness/contrast/colour,
overlay, format change). Truth: the planted pairs, plus files whose decoded pixels are identical, closed
transitively. The scan runs at its label-free defaults (search/duplicates/scan.py). Reported: pair precision,
recall, F1 over the pairs inside its groups (what a user gets), and over the kept pairs alone; the hashes at
their usual cut-off and at their best cut-off in hindsight (chosen on the truth); ECE of the scan's pair
probabilities (all aligned pairs, the pairs at p >= 0.05, and the pairs that hold a planted copy); recall
per edit; the estimated share of items with a duplicate against the true one; seconds.

    .venv/bin/python bench/dedup.py --folder DIR --name NAME [--planted 0.2] [--max-items 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections import defaultdict
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import numpy as np
from _common import row, write_results
from PIL import Image

from search.duplicates.config import DedupConfig
from search.duplicates.edits import edited_copy
from search.duplicates.model import expected_calibration_error
from search.duplicates.scan import scan_collection
from training.images import load_rgb

SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
USUAL = {"dHash": 8, "pHash": 8, "PDQ": 31}  # the cut-offs users are told to use (Hamming bits)


def readable_sample(folder, max_items: int, rng) -> list[Path]:
    """The folder's image files that decode (sorted); a seeded random `max_items` of them if more."""
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())
    readable = []
    for p in files:
        try:
            load_rgb(p, min_side=64)
            readable.append(p)
        except (OSError, ValueError):
            pass
    if len(readable) > max_items:
        readable = [readable[i] for i in sorted(rng.choice(len(readable), max_items, replace=False))]
    return readable


def edit_recall_rows(label: str, planted, edits, found: set) -> list:
    """One row per edit: the share of planted copies made with it whose pair was found."""
    per = defaultdict(list)
    for a, c in planted:
        for e in edits[c]:
            per[e].append(frozenset((a, c)) in found)
    return [
        row(f"{label}, copies with {e}", float(np.mean(v)), "ratio", None) for e, v in sorted(per.items())
    ]


def plant(files: list[Path], share: float, rng) -> tuple[list, dict, set]:
    """(sources: paths then copy bytes, {copy row: edit names}, planted pairs (row, row))."""
    sources: list = list(files)
    edits, pairs = {}, set()
    for i in rng.choice(len(files), size=max(1, int(round(share * len(files)))), replace=False):
        original = Image.fromarray(load_rgb(files[i]))
        original.thumbnail((2048, 2048))  # a 2x resize of a 4K picture would pass the decoder's pixel limit
        for _ in range(int(rng.integers(1, 3))):
            data, names = edited_copy(original, rng)
            sources.append(data)
            edits[len(sources) - 1] = names
            pairs.add((int(i), len(sources) - 1))
    return sources, edits, pairs


def truth_pairs(pixels: list, planted: set) -> set[frozenset]:
    """Planted pairs and identical-pixel pairs, closed transitively (a copy of a file stored twice is
    both's)."""
    parent = list(range(len(pixels)))

    def root(x):
        while parent[x] != x:
            x = parent[x]
        return x

    by = defaultdict(list)
    for i, key in enumerate(pixels):
        if key is not None:
            by[key].append(i)
    for group in by.values():
        for j in group[1:]:
            parent[root(j)] = root(group[0])
    for a, b in planted:
        parent[root(a)] = root(b)
    classes = defaultdict(list)
    for i in range(len(pixels)):
        classes[root(i)].append(i)
    return {frozenset(p) for c in classes.values() for p in combinations(c, 2)}


def scores(found: set, truth: set) -> tuple[float, float, float]:
    tp = len(found & truth)
    p = tp / len(found) if found else 1.0
    r = tp / len(truth) if truth else 1.0
    return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def hash_bits(images: list, kind: str) -> np.ndarray:
    """(n, bits) bool of each image's hash."""
    import imagehash

    out = []
    for im in images:
        if kind == "dHash":
            out.append(imagehash.dhash(im).hash.reshape(-1))
        elif kind == "pHash":
            out.append(imagehash.phash(im).hash.reshape(-1))
        else:
            import pdqhash

            out.append(pdqhash.compute(np.asarray(im))[0].astype(bool))
    return np.asarray(out, dtype=bool)


def hamming_pairs(bits: np.ndarray, max_d: int) -> dict[frozenset, int]:
    """Every pair within max_d bits -> its distance (all pairs, blocked)."""
    x = bits.astype(np.float32)
    out = {}
    for s in range(0, len(x), 512):
        d = x[s : s + 512] @ (1 - x).T + (1 - x[s : s + 512]) @ x.T
        for i, j in zip(*np.nonzero(d <= max_d)):
            if s + i < j:
                out[frozenset((int(s + i), int(j)))] = int(d[i, j])
    return out


def best_in_hindsight(dist: dict[frozenset, int], truth: set, max_d: int) -> tuple[int, tuple]:
    best = (0, (0.0, 0.0, 0.0))
    for t in range(max_d + 1):
        s = scores({p for p, d in dist.items() if d <= t}, truth)
        if s[2] > best[1][2]:
            best = (t, s)
    return best


def verifier_rows(scan, n, truth, planted, edits, threshold, keep_identical) -> list:
    """With verifier "both" (whose own figures are the softsearch rows: one fit on the pixel features and the
    encoder's cosine): precision, recall, F1, ECE and per-edit recall of the pixel fit alone on the same
    pairs, the copy encoder's none-softmax alone (its own candidates), the lower and the higher of the two."""
    if "pixels" not in scan.parts:
        return []
    m = len(scan.parts["pixels"])
    ia, ib = scan.a[m:], scan.b[m:]  # the identical pairs (p 1), kept by every variant
    ea, eb, ep = scan.parts["encoder_a"], scan.parts["encoder_b"], scan.parts["encoder_p"]
    pa, pb = scan.a[:m], scan.b[:m]
    enc = dict(zip(zip(ea.tolist(), eb.tolist()), ep.tolist()))
    pix = dict(zip(zip(pa.tolist(), pb.tolist()), scan.parts["pixels"].tolist()))
    pix_enc = dict(zip(zip(pa.tolist(), pb.tolist()), scan.parts["encoder"].tolist()))
    variants = {
        "pixels alone": pix,
        "encoder alone": enc,
        "lower of pixels and encoder": {k: min(v, pix_enc[k]) for k, v in pix.items()},
        "higher of pixels and encoder": {
            k: max(pix.get(k, 0.0), enc.get(k, pix_enc.get(k, 0.0))) for k in set(pix) | set(enc)
        },
    }
    out = []
    for name, d in variants.items():
        keys = list(d)
        p = np.array([d[k] for k in keys])
        kept = {frozenset(k) for k, q in zip(keys, p) if q >= threshold}
        kept |= {frozenset((int(x), int(y))) for x, y in zip(ia, ib)}
        found = truth_pairs(list(range(n)), {tuple(q) for q in kept})
        pr, rc, f = scores(found, truth)
        label = np.array([frozenset(k) in truth for k in keys])
        out += [
            row(f"{name}: precision", pr, "ratio", None),
            row(f"{name}: recall", rc, "ratio", None),
            row(f"{name}: F1", f, "ratio", None),
            row(f"{name}: ECE (scored pairs)", expected_calibration_error(p, label), "ratio", None),
        ]
        out += edit_recall_rows(f"{name}: recall", planted, edits, found)
    c = scan.copy
    out += [
        row("copy encoder: held-apart copies whose original is nearest", c.copy_top1, "ratio", None),
        row("copy encoder: softmax scale", c.scale, "1/cos", None),
        row("copy encoder: none logit", c.none, "logit", None),
        row("copy encoder: share of items with a copy, EM", c.prior, "ratio", None),
        row("copy encoder: final training loss", c.train_loss, "nats", None),
    ]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--name", required=True, help="collection name for the results file")
    ap.add_argument("--planted", type=float, default=0.2)
    ap.add_argument("--max-items", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--verifier",
        default="pixels",
        choices=("pixels", "encoder", "both"),
        help="what decides a pair (DedupConfig.verifier); with both, the pixel stage alone, the trained "
        "copy encoder alone and their combinations are reported from the one scan",
    )
    ap.add_argument("--copy-steps", type=int, default=None, help="DedupConfig.copy_steps (default: its own)")
    ap.add_argument("--copy-readout", default=None, choices=("softmax", "pair"))
    ap.add_argument("--copy-koleo", type=float, default=None)
    ap.add_argument(
        "--dump",
        default=None,
        help="also save the aligned pairs' design rows, the synthetic copies' "
        "and the truth labels (.npz) for fitting model variants offline",
    )
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    readable = readable_sample(args.folder, args.max_items, rng)
    sources, edits, planted = plant(readable, args.planted, rng)
    keys, pil = [], []  # pixel digests (truth) and <= 512 px copies (the hashes resize smaller anyway)
    for s in sources:
        a = load_rgb(s)
        keys.append(hashlib.sha1(str(a.shape).encode() + a.tobytes()).hexdigest())
        im = Image.fromarray(a)
        im.thumbnail((512, 512))
        pil.append(im)
    truth = truth_pairs(keys, planted)
    n = len(sources)
    neighbours = None
    t0 = time.perf_counter()
    over = {
        k: v
        for k, v in (
            ("copy_steps", args.copy_steps),
            ("copy_readout", args.copy_readout),
            ("copy_koleo", args.copy_koleo),
        )
        if v is not None
    }
    config = replace(DedupConfig(), verifier=args.verifier, **over)
    scan = scan_collection(lambda r: sources[r], n, config, neighbours=neighbours, progress=True)
    seconds = time.perf_counter() - t0
    threshold = config.threshold
    keep = scan.p >= threshold
    direct = {frozenset((int(a), int(b))) for a, b in zip(scan.a[keep], scan.b[keep])}
    # what a user gets is groups: every pair inside a group is a duplicate pair (the hashes, thresholded on
    # all pairs, get their cliques whole; a scan's candidates link a clique of ten copies through a few pairs)
    found = truth_pairs(list(range(n)), {tuple(p) for p in direct})
    prec, rec, f1 = scores(found, truth)
    dprec, drec, df1 = scores(direct, truth)
    label = np.array([frozenset((int(a), int(b))) in truth for a, b in zip(scan.a, scan.b)])
    # calibration is judged on the aligned pairs only: the pairs joined as identical (p 1, always right) would
    # flatter it
    aligned = ~scan.identical
    ece_all = expected_calibration_error(scan.p[aligned], label[aligned])
    if args.dump:
        extra = {}
        if scan.parts:
            ea, eb = scan.parts["encoder_a"], scan.parts["encoder_b"]
            extra = {f"part_{k}": v for k, v in scan.parts.items()}
            extra["part_encoder_label"] = np.array(
                [frozenset((int(a), int(b))) in truth for a, b in zip(ea, eb)]
            )
            extra["part_a"], extra["part_b"] = scan.a, scan.b
        np.savez(
            args.dump, x=scan.x, positives=scan.positives_x, label=label[aligned], p=scan.p[aligned], **extra
        )
    sure = aligned & (scan.p >= 0.05)
    ece_sure = expected_calibration_error(scan.p[sure], label[sure])
    # the reading: the aligned pairs that hold a planted copy (copy and original, two copies, or a
    # copy and a look-alike)
    copies = np.zeros(n, bool)
    copies[list(edits)] = True
    on_copies = aligned & (copies[scan.a] | copies[scan.b])
    ece_copies = expected_calibration_error(scan.p[on_copies], label[on_copies])
    has_dup = np.zeros(n, bool)
    for pair in truth:
        has_dup[list(pair)] = True
    rows = [
        row("items (with planted copies)", float(n), "items", None),
        row("true duplicate pairs", float(len(truth)), "pairs", None),
        row("softsearch precision", prec, "ratio", None),
        row("softsearch recall", rec, "ratio", None),
        row("softsearch F1", f1, "ratio", None),
        row("softsearch precision, scored pairs only (no grouping)", dprec, "ratio", None),
        row("softsearch recall, scored pairs only (no grouping)", drec, "ratio", None),
        row("pairs joined as identical pictures (digest)", float(scan.identical.sum()), "pairs", None),
        row("softsearch ECE (all aligned pairs)", ece_all, "ratio", None),
        row("softsearch ECE (pairs at p >= 0.05)", ece_sure, "ratio", None),
        row("softsearch ECE (aligned pairs with a planted copy)", ece_copies, "ratio", None),
        row("share of items with a duplicate, estimated", scan.share_items, "ratio", float(has_dup.mean())),
        row("softsearch seconds (end to end)", seconds, "s", None),
        *[row(f"softsearch seconds: {k}", v, "s", None) for k, v in scan.seconds.items()],
        row(
            "candidate pair recall (aligned or identical)",
            float(label.sum() / max(len(truth), 1)),
            "ratio",
            None,
        ),
        row(
            "share of candidate pairs that are duplicates, estimated",
            scan.model.share,
            "ratio",
            float(label[aligned].mean()) if aligned.any() else None,
        ),
    ]
    rows += verifier_rows(scan, n, truth, planted, edits, threshold, keep_identical=scan.identical)
    rows += edit_recall_rows("softsearch recall", planted, edits, found)
    for kind in ("dHash", "pHash", "PDQ"):
        t1 = time.perf_counter()
        bits = hash_bits(pil, kind)
        max_d = 24 if kind != "PDQ" else 90
        dist = hamming_pairs(bits, max_d)
        took = time.perf_counter() - t1
        usual = scores({p for p, d in dist.items() if d <= USUAL[kind]}, truth)
        t, best = best_in_hindsight(dist, truth, max_d)
        rows += [
            row(f"{kind} <= {USUAL[kind]} precision", usual[0], "ratio", None),
            row(f"{kind} <= {USUAL[kind]} recall", usual[1], "ratio", None),
            row(f"{kind} <= {USUAL[kind]} F1", usual[2], "ratio", f1),
            row(f"{kind} best in hindsight (<= {t}) F1", best[2], "ratio", f1),
            row(f"{kind} best in hindsight precision", best[0], "ratio", None),
            row(f"{kind} best in hindsight recall", best[1], "ratio", None),
            row(f"{kind} seconds (hashes and all pairs)", took, "s", None),
        ]
    write_results(f"dedup_{args.name}", rows, machine_note=f"load {__import__('os').getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
