"""Near-duplicates at the calibrated threshold vs the thresholds a user would otherwise use.

A real folder (default: the Tux Paint stamps) gets edited copies (search/duplicates/edits.py) of a
random --planted fraction of its images written beside their originals; the folder is indexed with
--checkpoint and `softsearch dedup`'s pipeline runs on it (calibration on the collection itself, no
labels), at both stages: "verified" (the default when the images are there: each item's nearest items
re-scored pixel for pixel, search/duplicates/verify.py) and "encoder" (embedding cosine only, the
pipeline before verification). The truth is the planted pairs plus pairs of files whose decoded pixels
are identical (a file stored twice is a duplicate; found from the contents, not by hand). Reported:
pair precision, recall and F1 at the calibrated threshold,
the held-out expected calibration error, false pairs between same-class look-alikes, and the same
figures for three baselines run on the same index and images:
  - the best fixed cosine threshold chosen on a DIFFERENT corpus (--transfer: Fashion-MNIST test images
    with planted copies, embedded by the same encoder), as a user who tuned it elsewhere would;
  - immich's default duplicate distance (cosine distance <= 0.01, i.e. cosine >= 0.99);
  - raw pixels, perceptual-hash style: 64-bit difference hash, Hamming distance <= 10.

    .venv/bin/python bench/dedup.py --checkpoint CKPT [--folder DIR] [--planted 0.1]
"""
from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
from itertools import combinations
from pathlib import Path

import numpy as np
from PIL import Image

from _common import row, write_results
from index.build import BuildOptions, build_index
from search.duplicates.calibration import LEVELS, collection_share, expected_calibration_error, top1
from search.duplicates.edits import edited_copy
from search.duplicates.job import (ThumbCache, _nearest, _verified, calibrate_snapshot, default_threshold,
                                   embed_bytes, find_duplicates, scores_cache)
from search.serving.searcher import Searcher
from training.checkpoint import read_checkpoint_metadata
from training.datasets import create_dataset
from training.images import load_rgb

IMMICH_MAX_DISTANCE = 0.01
DHASH_MAX_BITS = 10


def plant(src: Path, dest: Path, fraction: float, seed: int) -> set[frozenset]:
    """Copy `src` to `dest` and write an edited copy beside a random `fraction` of its images."""
    shutil.copytree(src, dest)
    files = sorted(p for p in dest.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    rng = np.random.default_rng(seed)
    truth = set()
    for path in rng.choice(files, size=max(1, int(fraction * len(files))), replace=False):
        data, _ = edited_copy(Image.fromarray(load_rgb(path)), rng)   # decoded as indexing decodes it
        copy = path.with_name(path.stem + ".copy" + (".jpg" if data[:2] == b"\xff\xd8" else ".png"))
        copy.write_bytes(data)
        truth.add(frozenset((path.relative_to(dest).as_posix(), copy.relative_to(dest).as_posix())))
    return truth


def identical_pairs(folder: Path, ids: list[str]) -> set[frozenset]:
    """Pairs of files whose decoded pixels are identical (duplicates by content, whatever their names)."""
    by_pixels: dict[tuple, list[str]] = {}
    for i in ids:
        a = load_rgb(folder / i)
        by_pixels.setdefault((a.shape, a.tobytes()), []).append(i)
    return {frozenset(p) for same in by_pixels.values() for p in combinations(same, 2)}


FLAT_SHARE, FLAT_LEVELS, CROP_ASPECT = 0.99, 8, 1 / 0.9


def one_colour_pairs(folder: Path, ids: list[str]) -> set[frozenset]:
    """Pairs of ONE-COLOUR pictures (>= FLAT_SHARE of the pixels within FLAT_LEVELS of the median colour) of
    the same colour whose aspect ratios differ by at most what a crop of the edit family makes (1 / 0.9):
    there is no drawing to tell them apart, each is a crop-and-resize of the other (Tux Paint's filled l
    and I are black rectangles of 31 x 115 and 32 x 110). A rule on content fixed before any run, reported
    beside the figures without it."""
    flat = {}
    for i in ids:
        a = load_rgb(folder / i)
        px = a.reshape(-1, 3).astype(np.int16)
        med = np.median(px, axis=0)
        if (np.abs(px - med).max(axis=1) <= FLAT_LEVELS).mean() >= FLAT_SHARE:
            flat[i] = (med, a.shape[1] / a.shape[0])
    return {frozenset((a, b)) for a, b in combinations(sorted(flat), 2)
            if np.abs(flat[a][0] - flat[b][0]).max() <= FLAT_LEVELS
            and max(flat[a][1], flat[b][1]) / min(flat[a][1], flat[b][1]) <= CROP_ASPECT}


def closure(pairs: set[frozenset]) -> set[frozenset]:
    """Every pair within the connected components of `pairs` (a copy of a file stored twice duplicates both)."""
    parent: dict[str, str] = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in (tuple(p) for p in pairs):
        parent[root(a)] = root(b)
    classes: dict[str, list[str]] = {}
    for x in list(parent):
        classes.setdefault(root(x), []).append(x)
    return {frozenset(p) for c in classes.values() for p in combinations(sorted(c), 2)}


def planted_ece(snap, calib, folder: Path, truth: set[frozenset], copies: list[str]) -> tuple[float, int]:
    """ECE of the verified top-1 p(original | copy) on the PLANTED copies (never seen by the calibration):
    each copy searched against the index without itself, correct when its top item is a true duplicate."""
    from search.duplicates import verify

    ids = snap.index.ids
    row = {i: r for r, i in enumerate(ids)}
    emb = np.asarray(snap.index.embeddings, dtype=np.float32)
    thumbs = ThumbCache(snap)
    conf, correct = [], []
    for c in copies:
        r = row[c]
        rows, cos = _nearest(emb @ emb[r], calib.verify_k, exclude=r)
        q = _verified(verify.thumb(load_rgb(folder / c)), rows, cos, thumbs, -1, calib.floor)
        p, _ = top1(q.weighed(calib.geometry_weights), calib.temperature, calib.bias)
        conf.append(p)
        correct.append(bool(q.top.size) and frozenset((c, ids[int(q.top_rows[0])])) in truth)
    return expected_calibration_error(np.array(conf), np.array(correct))[0], len(copies)


def scan_ece(cache, calib, ids: list[str], truth: set[frozenset]) -> float:
    """ECE of the probability a scan states for each item: its most probable verified candidate's p(j | i),
    correct when that pair is a true duplicate (an item with no candidate states 0) -- the number users read,
    checked on the whole scanned collection rather than on copies alone."""
    conf, correct = [], []
    for r in np.flatnonzero(cache.known):
        known = cache.get(int(r))
        others, _, e = known
        if not others.size or not np.isfinite(e).any():
            conf.append(0.0)
            correct.append(False)
            continue
        logits = np.r_[calib.bias, e] / calib.temperature
        p = np.exp(logits - np.logaddexp.reduce(logits))
        j = int(np.argmax(p[1:]))
        conf.append(float(p[1 + j]))
        correct.append(frozenset((ids[int(r)], ids[int(others[j])])) in truth)
    return expected_calibration_error(np.array(conf), np.array(correct))[0]


def group_pairs(found: dict) -> set[frozenset]:
    """Every pair of ids that share a group in a find_duplicates result."""
    return {frozenset(pair) for g in found["groups"] for pair in combinations(g["ids"], 2)}


def pair_scores(predicted: set[frozenset], truth: set[frozenset]) -> tuple[float, float, float]:
    tp = len(predicted & truth)
    precision = tp / len(predicted) if predicted else 1.0
    recall = tp / len(truth)
    return precision, recall, (2 * precision * recall / (precision + recall) if tp else 0.0)


def cosine_pairs(emb: np.ndarray, ids: list[str], threshold: float) -> set[frozenset]:
    s = emb @ emb.T
    np.fill_diagonal(s, -1)
    a, b = np.nonzero(np.triu(s >= threshold))
    return {frozenset((ids[i], ids[j])) for i, j in zip(a, b)}


def best_cosine_threshold(emb: np.ndarray, ids: list[str], truth: set[frozenset]) -> float:
    """The cosine threshold with the best pair F1 on a labelled corpus (what a user tunes once)."""
    best = (0.0, 0.99)
    for t in np.linspace(0.80, 0.999, 200):
        f1 = pair_scores(cosine_pairs(emb, ids, t), truth)[2]
        best = max(best, (f1, float(t)))
    return best[1]


def dhash(path: Path) -> int:
    grey = Image.fromarray(load_rgb(path)).convert("L").resize((9, 8), Image.BILINEAR)
    a = np.asarray(grey, dtype=np.int16)
    bits = (a[:, 1:] > a[:, :-1]).ravel()
    return int("".join("1" if b else "0" for b in bits), 2)


def transfer_threshold(snapshot, n: int, seed: int) -> float:
    """Best cosine threshold on Fashion-MNIST test images with planted copies, same encoder."""
    ds = create_dataset("fashion-mnist", split="test", size=n)
    rng = np.random.default_rng(seed)
    originals = [ds.image(i) for i in range(n)]
    planted = rng.choice(n, size=n // 10, replace=False)
    payloads, ids = [], []
    for i, im in enumerate(originals):
        buf = io.BytesIO()
        im.convert("RGB").save(buf, format="PNG")
        payloads.append(buf.getvalue())
        ids.append(f"o{i}")
    truth = set()
    for i in planted:
        payloads.append(edited_copy(originals[i].convert("RGB"), rng)[0])
        ids.append(f"c{i}")
        truth.add(frozenset((f"o{i}", f"c{i}")))
    emb = np.concatenate([embed_bytes(snapshot, payloads[s:s + 256]) for s in range(0, len(payloads), 256)])
    return best_cosine_threshold(emb, ids, truth)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="encoder checkpoint (e.g. trained on the folder)")
    p.add_argument("--folder", default="/usr/share/tuxpaint/stamps")
    p.add_argument("--planted", type=float, default=0.1, help="fraction of images given an edited copy")
    p.add_argument("--precision", type=float, default=0.99, help="target precision that sets the threshold")
    p.add_argument("--calibration-items", type=int, default=300)
    p.add_argument("--transfer-size", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="dedup")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dedup-bench-"))
    try:
        folder = work / "photos"
        truth = plant(Path(args.folder), folder, args.planted, args.seed)
        image_size = int(read_checkpoint_metadata(args.checkpoint)["encoder"]["image_size"])
        ds = create_dataset("folder", split="all", root=str(folder), image_size=image_size)
        root = work / "index"
        build_index(args.checkpoint, ds, root, BuildOptions(progress=False))
        searcher = Searcher(root)
        searcher.load()
        snap = searcher.snapshot()
        ids = snap.index.ids
        planted = {t for t in truth if t <= set(ids)}   # planted pairs whose both files were indexed
        same = identical_pairs(folder, ids)
        strict = closure(planted | same)
        flat = one_colour_pairs(folder, ids)
        truth = closure(planted | same | flat)
        print(f"truth: {len(planted)} planted pairs, {len(same)} pixel-identical pairs "
              f"({', '.join(' = '.join(sorted(p)) for p in same if not any('.copy.' in i for i in p))}); "
              f"{len(strict)} true pairs; with the one-colour rule "
              f"({', '.join(' ~ '.join(sorted(p)) for p in flat if not any('.copy.' in i for i in p))}) {len(truth)}")
        klass = {i: i.split("/")[0] for i in ids}

        def same_class_false(got: set[frozenset]) -> float:
            """Pairs grouped that are not duplicates and share a class folder (the look-alikes that matter)."""
            return float(sum(1 for x in got - truth if len({klass[i] for i in x}) == 1))

        # the `index add` flow: `softsearch dedup` calibrated the folder before the copies were added to it
        build_index(args.checkpoint, create_dataset("folder", split="all", root=args.folder, image_size=image_size),
                    work / "index-before", BuildOptions(progress=False))
        before = Searcher(work / "index-before")
        before.load()
        rows, stages, stages_queries, stages_grid, caches = [], {}, {}, {}, {}
        for stage, calib_snap in (("verified", snap), ("encoder", snap), ("verified-before", before.snapshot())):
            calib = calibrate_snapshot(calib_snap, stage.split("-")[0], args.calibration_items, args.precision,
                                       args.seed + 1, progress=False)
            # the default of `softsearch dedup`: the lowest level whose groups' mean confidence reaches the target
            cache = caches[stage] = scores_cache(snap, calib)   # the pair scores, verified once for the scans below
            # (at the calibration's prior, without the floor: the default before 2026-12-07)
            found = find_duplicates(snap, calib, threshold=default_threshold(snap, calib, progress=False, cache=cache,
                                                                             min_probability=0.0)[0],
                                    progress=False, cache=cache)
            found_queries = find_duplicates(snap, calib, progress=False, cache=cache)   # the calibration queries' threshold
            stages_queries[stage] = (calib.threshold, group_pairs(found_queries))
            # the default rule before 2026-12-06: the same mean-confidence test, P taken from fixed levels
            t_grid = default_threshold(snap, calib, progress=False, cache=cache, levels=LEVELS, min_probability=0.0)[0]
            stages_grid[stage] = (t_grid, group_pairs(find_duplicates(snap, calib, threshold=t_grid, progress=False,
                                                                      cache=cache)))
            pairs = group_pairs(found)
            # without labels either: the threshold with the best precision on the tool's own calibration queries
            best = max((r for r in calib.precision_curve if r["pairs"]),
                       key=lambda r: (r["precision"], -r["threshold"]))
            found_best = find_duplicates(snap, calib, threshold=best["threshold"], progress=False, cache=cache)
            pairs_best = group_pairs(found_best)
            stages[stage] = (calib, found, pairs, best, pairs_best)
            for name, got in ((f"p >= {found['threshold']:.3g}", pairs), (f"p >= {best['threshold']:.3g}", pairs_best)):
                for f in sorted(got - truth, key=sorted):
                    print(f"  {stage} {name}: false pair {' ~ '.join(sorted(f))}")
                for f in sorted(truth - got, key=sorted):
                    print(f"  {stage} {name}: missed {' ~ '.join(sorted(f))}")
        calib, found, ours, best, ours_best = stages["verified"]
        emb = np.asarray(snap.index.embeddings, dtype=np.float32)
        t_transfer = transfer_threshold(snap, args.transfer_size, args.seed)
        hashes = {i: dhash(folder / i) for i in ids}
        hashed = {frozenset((a, b)) for a, b in combinations(ids, 2)
                  if bin(hashes[a] ^ hashes[b]).count("1") <= DHASH_MAX_BITS}
        p_ours, r_ours, f_ours = pair_scores(ours, truth)
        enc_calib, enc_found, enc_pairs, enc_best, enc_pairs_best = stages["encoder"]
        for name, pairs in ((f"cosine >= {t_transfer:.3f} (best F1 on Fashion-MNIST copies)",
                             cosine_pairs(emb, ids, t_transfer)),
                            ("immich default (cosine distance <= 0.01)", cosine_pairs(emb, ids, 1 - IMMICH_MAX_DISTANCE)),
                            (f"raw pixels: dHash Hamming <= {DHASH_MAX_BITS}", hashed),
                            (f"encoder stage only, calibrated p >= {enc_found['threshold']:.3g}", enc_pairs),
                            (f"encoder stage only, best-precision level p >= {enc_best['threshold']:.3g}",
                             enc_pairs_best)):
            pb, rb, fb = pair_scores(pairs, truth)
            rows.append(row(f"F1 verified p >= {found['threshold']:.3g} (baseline: {name})", f_ours, "F1", fb))
            rows.append(row(f"precision (baseline: {name})", p_ours, "precision", pb))
            rows.append(row(f"recall (baseline: {name})", r_ours, "recall", rb))
        pb, rb, fb = pair_scores(ours_best, truth)
        rows.append(row(f"verified, best-precision level p >= {best['threshold']:.3g}: F1 (baseline: target "
                        f"{args.precision})", fb, "F1", f_ours))
        rows.append(row(f"verified, best-precision level: precision (calibration said {best['precision']:.3f})", pb,
                        "precision", None))
        rows.append(row("verified, best-precision level: recall", rb, "recall", None))
        for stage, (c, f, pairs, b, pairs_b) in stages.items():
            rows.append(row(f"{stage}: most sure the model can be (identical copy vs 'none')", c.max_probability,
                            "p", None))
            rows.append(row(f"{stage}: held-out expected calibration error (calibration's own copies)", c.ece, "ECE",
                            None))
            for name, got in ((f"p >= {f['threshold']:.3g}", pairs), (f"p >= {b['threshold']:.3g}", pairs_b)):
                rows.append(row(f"{stage} {name}: false pairs between same-class non-copies", same_class_false(got),
                                "pairs", None))
            rows.append(row(f"{stage}: duplicate temperature", c.temperature, "tau", None))
            rows.append(row(f"{stage}: dedup seconds (candidates + groups)", f["seconds"], "s", None))
        planted_copies = sorted(i for t in planted for i in t if ".copy." in i)
        for stage in ("verified", "verified-before"):
            ece_planted, n_planted = planted_ece(snap, stages[stage][0], folder, truth, planted_copies)
            rows.append(row(f"{stage}: expected calibration error on the {n_planted} planted copies", ece_planted,
                            "ECE", None))
        c, f, pairs, b, pairs_b = stages["verified-before"]
        t_q, pairs_q = stages_queries["verified-before"]
        t_g, pairs_g = stages_grid["verified-before"]
        for name, got in ((f"calibration prior (the default before 2026-12-07) p >= {f['threshold']:.3g}", pairs),
                          (f"fixed-level default (before 2026-12-06) p >= {t_g:.3g}", pairs_g),
                          (f"calibration queries' target level p >= {t_q:.3g}", pairs_q),
                          (f"best-precision level p >= {b['threshold']:.3g}", pairs_b)):
            for label, true in (("", truth), (" [truth without the one-colour rule]", strict)):
                pb, rb, fb = pair_scores(got, true)
                rows.append(row(f"verified-before {name}{label}: F1 (baseline: immich default)", fb, "F1",
                                pair_scores(cosine_pairs(emb, ids, 1 - IMMICH_MAX_DISTANCE), true)[2]))
                rows.append(row(f"verified-before {name}{label}: precision", pb, "precision", None))
                rows.append(row(f"verified-before {name}{label}: recall", rb, "recall", None))
        # the default of `softsearch dedup` (since 2026-12-07): the probabilities for this collection's share of
        # items with a duplicate, estimated from the scan by EM, the bias moved to it, the same default rule
        cache = caches["verified-before"]
        share = collection_share(cache.none_probabilities(c), c.design_share)
        shifted = c.with_share(share)
        t_c = default_threshold(snap, shifted, progress=False, cache=cache)[0]
        # the same without the floor (job.MIN_PROBABILITY): the default of the first session of 2026-12-07
        t_n = default_threshold(snap, shifted, progress=False, cache=cache, min_probability=0.0)[0]
        pairs_n = group_pairs(find_duplicates(snap, shifted, threshold=t_n, progress=False, cache=cache))
        found_c = find_duplicates(snap, shifted, threshold=t_c, progress=False, cache=cache)
        pairs_c = group_pairs(found_c)
        confidence = {frozenset(pair): g["confidence"] for g in found_c["groups"] for pair in combinations(g["ids"], 2)}
        print(f"  collection prior: share {share:.3f} (calibration {c.design_share:.3f}), P {t_c:.3g}; false pairs: "
              + "; ".join(f"{' ~ '.join(sorted(x))} (group confidence {confidence[x]:.3f})"
                          for x in sorted(pairs_c - truth, key=sorted)))
        rows.append(row("verified-before: share of items with a duplicate, EM from the scan (collection prior)", share,
                        "share", c.design_share))
        for label, true in (("", truth), (" [truth without the one-colour rule]", strict)):
            pb, rb, fb = pair_scores(pairs, true)
            pc, rc, fc = pair_scores(pairs_c, true)
            rows.append(row(f"verified-before default: collection prior p >= {t_c:.3g}{label}: F1 (baseline: the calibration's "
                            f"prior, p >= {f['threshold']:.3g})", fc, "F1", fb))
            rows.append(row(f"verified-before default: collection prior{label}: precision (baseline: the calibration's prior)",
                            pc, "precision", pb))
            rows.append(row(f"verified-before default: collection prior{label}: recall (baseline: the calibration's prior)",
                            rc, "recall", rb))
        rows.append(row("verified-before default: collection prior: false pairs between same-class non-copies",
                        same_class_false(pairs_c), "pairs", None))
        # beside the default: the rule without the floor, and per-pair levels (every kept pair at least this sure)
        f_default = pair_scores(pairs_c, truth)[2]
        # (name of the F1 row, suffix of the other rows, pairs)
        others = [(f", expected-precision rule without the floor p >= {t_n:.3g}", " without the floor", pairs_n)]
        others += [(f", every pair p >= {level}", f", every pair p >= {level}",
                    group_pairs(find_duplicates(snap, shifted, threshold=level, progress=False, cache=cache)))
                   for level in (0.9, 0.95, 0.99)]
        for f1_name, name, got in others:
            po, ro, fo = pair_scores(got, truth)
            rows.append(row(f"verified-before collection prior{f1_name}: F1 (baseline: the default, p >= {t_c:.3g})",
                            fo, "F1", f_default))
            rows.append(row(f"verified-before collection prior{name}: precision", po, "precision", None))
            rows.append(row(f"verified-before collection prior{name}: recall", ro, "recall", None))
            rows.append(row(f"verified-before collection prior{name}: false pairs between same-class non-copies",
                            same_class_false(got), "pairs", None))
        rows.append(row("verified-before: ECE of every scanned item's stated p, collection prior (baseline: the "
                        "calibration's prior)", scan_ece(cache, shifted, ids, truth), "ECE", scan_ece(cache, c, ids, truth)))
        for stage in ("verified", "verified-before"):
            t_q, pairs_q = stages_queries[stage]
            pb, rb, fb = pair_scores(pairs_q, truth)
            print(f"  {stage} calibration queries' level p >= {t_q:.3g}: precision {pb:.3f} recall {rb:.3f} F1 {fb:.3f}")
        rows.append(row("planted pairs", float(len(planted)), "pairs", None))
        rows.append(row("true pairs (planted + pixel-identical, closed)", float(len(strict)), "pairs", None))
        rows.append(row("true pairs with the one-colour rule", float(len(truth)), "pairs", None))
        rows.append(row("items indexed", float(len(ids)), "items", None))
        write_results(args.name, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
