"""`softsearch dedup`: near-duplicate groups of an index version at a probability fitted on the collection.

    softsearch dedup --index R [--version V] [--threshold P | --precision Q] [--flips] [--out FILE]

Reads every indexed image, scans it (scan.py: thumbnails, candidate pairs by descriptor and by the index's
embeddings, alignment, a classifier fitted on edited copies of the collection's own images, no labels) and
writes R/duplicates/<version>.json (what GET /v1/duplicates serves) and R/duplicates/<version>.html (the page
at /duplicates), and a copy to --out.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from index.manifest import atomic_write, utc_now
from index.store import IndexStore, require_store
from search.duplicates.baselines import table as baseline_table
from search.duplicates.config import FORMAT, DedupConfig
from search.duplicates.dedup_args import build_parser
from search.duplicates.model import DuplicateModel
from search.duplicates.page import render_page
from search.duplicates.scan import (
    choose_threshold,
    groups_of,
    notes,
    read_thumbnails,
    scan_collection,
    score_pairs,
)

logger = logging.getLogger(__name__)

BLOCK = 4096


def source_bytes(snapshot, item_id: str) -> bytes:
    """The item's original bytes: the file for folders, the stored image as PNG otherwise."""
    ds, i = snapshot.item_source(item_id)
    path = getattr(ds, "path", None)
    if callable(path):
        return Path(path(i)).read_bytes()
    buf = io.BytesIO()
    ds.image(i).save(buf, format="PNG")
    return buf.getvalue()


def has_images(snapshot) -> bool:
    """Whether the version's items can be read back as images (not a version built from vectors)."""
    if snapshot.dataset_spec() is None or snapshot.count == 0:
        return False
    try:
        source_bytes(snapshot, snapshot.index.ids[0])
    except (KeyError, OSError, ValueError):
        return False
    return True


def embedding_neighbours(version, rows=None, block: int = BLOCK):
    """k -> (len(rows), k) nearest other rows by the version's ANN index (-1: none)."""

    def find(k: int) -> np.ndarray:
        emb = version.embeddings
        sel = np.arange(emb.shape[0]) if rows is None else np.asarray(rows)
        out = np.full((sel.size, k), -1, np.int64)
        for s in range(0, sel.size, block):
            mine = sel[s : s + block]
            _, found = version.search(np.ascontiguousarray(np.asarray(emb[mine]), dtype=np.float32), k + 1)
            for i, r in enumerate(mine):
                others = found[i][(found[i] >= 0) & (found[i] != r)][:k]
                out[s + i, : others.size] = others
        return out

    return find


def scan_snapshot(snapshot, config: DedupConfig, progress: bool = True):
    """scan.Scan of every item of a snapshot (its images, its embeddings' neighbours)."""
    if not has_images(snapshot):
        raise ValueError(
            f"index version {snapshot.version} has no readable images (built from vectors, or its "
            "files are gone): dedup compares the indexed images"
        )
    ids = snapshot.index.ids
    return scan_collection(
        lambda r: source_bytes(snapshot, ids[r]),
        snapshot.count,
        config,
        neighbours=embedding_neighbours(snapshot.index),
        progress=progress,
    )


def result_of(
    scan,
    ids: list[str],
    config: DedupConfig,
    threshold: float | None = None,
    precision: float | None = None,
    embeddings=None,
) -> dict:
    """The JSON record of a scan: threshold, groups, the model, the notes, skipped files, figures, and what
    the usual hash rules (and cosine >= 0.99 on `embeddings`) would keep on the same items."""
    t, how = choose_threshold(scan.p, config, threshold, precision)
    groups = groups_of(scan.a, scan.b, scan.p, t, ids)
    kept = {frozenset((int(x), int(y))) for x, y, q in zip(scan.a, scan.b, scan.p) if q >= t}
    ok = scan.ok if scan.ok is not None else np.ones(len(ids), bool)
    compared = baseline_table(scan.hashes, ok, groups, kept, embeddings) if scan.hashes else []
    top = int(np.argmax(scan.p)) if scan.p.size else None
    return {
        "threshold": t,
        "threshold_rule": how,
        "groups": groups,
        "notes": notes(scan, t, how),
        "max_probability": float(scan.p[top]) if top is not None else 0.0,
        "max_pair": [ids[int(scan.a[top])], ids[int(scan.b[top])]] if top is not None else None,
        "pairs_scored": int(scan.p.size),
        "pairs_kept": int((scan.p >= t).sum()),
        "identical_pairs": int(scan.identical.sum()) if scan.identical is not None else 0,
        "baselines": compared,
        "collection_share": scan.share_items,
        "pair_share": scan.model.share if scan.model is not None else None,
        "model": scan.model.to_json() if scan.model is not None else None,
        "copy_model": scan.copy.to_json() if scan.copy is not None else None,
        "config": config.to_json(),
        "skipped": [{"id": ids[r], "error": e} for r, e in sorted(scan.skipped.items())],
        "seconds": scan.seconds,
        "histogram": np.histogram(scan.p, bins=20, range=(0, 1))[0].tolist(),
        "copy_probabilities": scan.model.probability(scan.positives_x).tolist()
        if scan.model is not None and scan.positives_x is not None and len(scan.positives_x)
        else [],
    }


def latest_scan(store: IndexStore):
    """(version, model, config, threshold) of the newest scan with a model this code reads (None if none)."""
    for version in reversed(store.versions()):
        path = store.duplicates_path(version)
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or data["config"].get("verifier", "pixels") != "pixels":
                continue  # a scan with the copy encoder: its tower is not kept, new items cannot be scored
            return (
                version,
                DuplicateModel.from_json(data["model"]),
                DedupConfig.from_json(data["config"]),
                float(data["threshold"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def report_new_duplicates(root, base: str | None, version: str, progress: bool = False) -> dict | None:
    """Print (and return) the pairs that items new in `version` (not in `base`) form with indexed items
    (their nearest by the embeddings), scored by the model of the newest dedup scan; None without one."""
    from search.serving.searcher import Searcher

    store = IndexStore(root)
    if version is None or version == base:
        return None
    found = latest_scan(store)
    if found is None:
        logger.info("no dedup scan yet: run 'softsearch dedup --index %s' to find duplicates", root)
        return None
    scanned, model, config, threshold = found
    searcher = Searcher(root)
    searcher.load(version)
    snap = searcher.snapshot()
    ids = snap.index.ids
    old = set(store.load(base, verify=False, gpu=False).ids) if base else set()
    new_rows = np.array([r for r, i in enumerate(ids) if i not in old], np.int64)
    if not new_rows.size or snap.count < 2:
        return None
    k = config.k_descriptor + config.k_embedding
    nb = embedding_neighbours(snap.index, new_rows)(min(k, snap.count - 1))
    a = np.repeat(new_rows, nb.shape[1])
    b = nb.reshape(-1)
    keep = b >= 0
    a, b = a[keep], b[keep]
    pr = np.unique(np.sort(np.column_stack([a, b]), axis=1), axis=0)
    rows = np.unique(pr.reshape(-1))
    thumbs, colours, skipped, _ = read_thumbnails(
        lambda r: source_bytes(snap, ids[r]), rows, config.thumb, progress
    )
    local = {int(r): i for i, r in enumerate(rows)}
    good = np.array([int(x) not in skipped and int(y) not in skipped for x, y in pr], bool)
    pr = pr[good]
    from search.duplicates.descriptors import search_descriptor

    la, lb = np.array([local[int(x)] for x in pr[:, 0]]), np.array([local[int(y)] for y in pr[:, 1]])
    p = (
        score_pairs(
            thumbs,
            colours,
            search_descriptor(thumbs, colours, config.dct, config.colour_weight),
            la,
            lb,
            model,
            config,
        )
        if len(pr)
        else np.zeros(0)
    )
    kept = [(ids[int(x)], ids[int(y)], float(q)) for (x, y), q in zip(pr, p) if q >= threshold]
    for x, y, q in kept:
        print(f"duplicate: {x} ~ {y} (p {q:.3f})")
    print(
        f"{len(kept)} duplicate pairs among {new_rows.size} "
        f"new items (p >= {threshold:.3g}, model of {scanned})"
    )
    return {"pairs": kept, "threshold": threshold}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from search.serving.searcher import Searcher

    if args.threshold is not None and not 0.0 < args.threshold < 1.0:
        raise ValueError(f"--threshold must be in (0, 1), got {args.threshold}")
    if args.precision is not None and not 0.0 < args.precision < 1.0:
        raise ValueError(f"--precision must be in (0, 1), got {args.precision}")
    if args.threshold is not None and args.precision is not None:
        raise ValueError("give --threshold or --precision, not both")
    config = replace(
        DedupConfig(),
        flips=args.flips,
        calibration_items=args.calibration_items,
        seed=args.seed,
        verifier=args.verifier,
    )
    root = require_store(args.index)
    store = IndexStore(root)
    version = args.version or store.current_version()
    if version is None:
        raise FileNotFoundError(
            f"no current index version under {root}; build one first (softsearch index build)"
        )
    searcher = Searcher(root)
    searcher.load(version)
    snapshot = searcher.snapshot()
    scan = scan_snapshot(snapshot, config, progress=not args.no_progress)
    result = {
        "format": FORMAT,
        "version": version,
        "created": utc_now(),
        "count": snapshot.count,
        **result_of(
            scan,
            snapshot.index.ids,
            config,
            args.threshold,
            args.precision,
            embeddings=snapshot.index.embeddings,
        ),
    }
    path = store.duplicates_path(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    atomic_write(path, lambda fh: fh.write(text))
    atomic_write(store.duplicates_path(version, ".html"), lambda fh: fh.write(render_page(result, snapshot)))
    if args.out:
        Path(args.out).write_text(text)
    for note in result["notes"]:
        print(f"note: {note}")
    grouped = sum(len(g["ids"]) for g in result["groups"])
    print(
        f"dedup {version}: {len(result['groups'])} groups ({grouped} items) at p >= "
        f"{result['threshold']:.3g} ({result['threshold_rule']}); highest p "
        f"{result['max_probability']:.3g}; items with a duplicate: about {result['collection_share']:.1%} "
        f"(estimated, no labels); {len(result['skipped'])} skipped; {path}"
    )
    return 0
