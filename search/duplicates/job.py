"""`softsearch dedup`: calibrate the duplicate temperature on the collection, find the groups, write them.

    softsearch dedup --index R [--version V] [--threshold P | --precision 0.99 --min-probability 0.9]
                     [--stage verified|encoder] [--prior collection|calibration] [--out FILE]

Two stages: the encoder's nearest items are the candidates, and (default) the verification stage re-scores
each item's VERIFY_K nearest pixel for pixel (verify.py), the probabilities calibrated on that score. Writes R/duplicates/<version>.json (what GET /v1/duplicates serves) and R/duplicates/<version>.html
(the page at /duplicates), and a copy to --out.
"""
from __future__ import annotations

import io
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

from index.manifest import atomic_write, utc_now
from index.store import IndexStore, require_store
from search.duplicates import verify
from search.duplicates.calibration import (LEVELS, QueryScores, calibrate, collection_share, query_scores,
                                           scored_candidates, default_level)
from search.duplicates.edits import edited_copy
from search.duplicates.groups import (VerifiedScores, candidate_sets, describe_group, mutual_groups,
                                      verified_candidate_sets)
from search.duplicates.dedup_args import MIN_PROBABILITY, build_parser
from search.duplicates.page import render_page
from training.images import cache_resolution, load_query, load_rgb, load_square

logger = logging.getLogger(__name__)
FORMAT = "softsearch-duplicates"
QUERY_BLOCK = 64
VERIFY_K = 8            # encoder neighbours re-scored by the verification stage
TWINS = 2              # extra neighbours a negative query fetches, to stay at k after dropping twins
TWIN_COSINE = 1.0 - 1e-3   # embeddings at least this close are a twin candidate (the same picture stored twice)
FLOOR_QUANTILE = 0.01   # the encoder cosine below which no candidate is verified: this quantile of the
                        # calibration copies' cosine to their original (the edits lose ~1 % there)
HARD_FRACTION = 0.1     # the hard stratum of the "none" queries: this top share of items by nearest-other cosine
HARD_SHARE = 0.5        # ... and this share of the "none" queries is drawn from it (all of it when fewer)
POOL_FACTOR = 20        # hardness is measured on a uniform pool of this many times the queries (bounded work)


def source_bytes(snapshot, item_id: str) -> bytes:
    """The item's original bytes: the file for folders, the stored image as PNG otherwise."""
    ds, i = snapshot.item_source(item_id)
    path = getattr(ds, "path", None)
    if callable(path):
        return Path(path(i)).read_bytes()
    buf = io.BytesIO()
    ds.image(i).save(buf, format="PNG")
    return buf.getvalue()


def embed_bytes(snapshot, payloads: list[bytes]) -> np.ndarray:
    """Embed image bytes exactly as the server embeds an upload of them (training/images.py decode)."""
    side = cache_resolution(snapshot.encoder.image_size)
    decode = load_square if snapshot.file_backed else load_query
    return snapshot.encode([decode(b, side) for b in payloads])


def _similarities(snapshot, z: np.ndarray) -> np.ndarray:
    emb = snapshot.index.embeddings
    return np.concatenate([z @ np.asarray(emb[s:s + 65536]).T for s in range(0, emb.shape[0], 65536)], axis=1)


def has_images(snapshot) -> bool:
    """Whether the version's items can be read back as images (not a version built from vectors)."""
    if snapshot.encoder is None or snapshot.dataset_spec() is None or snapshot.count == 0:
        return False
    try:
        source_bytes(snapshot, snapshot.index.ids[0])
    except (KeyError, OSError, ValueError):
        return False
    return True


def item_thumb(snapshot, row: int) -> verify.Thumb | None:
    """The verification thumb of an indexed item (None when its image can no longer be read)."""
    try:
        return verify.thumb(load_rgb(source_bytes(snapshot, snapshot.index.ids[int(row)])))
    except (KeyError, OSError, ValueError) as err:   # ImageError is a ValueError
        logger.warning("duplicate verification skips %s: %s", snapshot.index.ids[int(row)], err)
        return None


class ThumbCache:
    """Thumbs of indexed rows, made on first use and forgotten beyond `size` (bounded memory)."""

    def __init__(self, snapshot, size: int = 1024):
        self.snapshot, self.size, self._store = snapshot, int(size), {}

    def __call__(self, row: int) -> verify.Thumb | None:
        row = int(row)
        if row not in self._store:
            if len(self._store) >= self.size:
                self._store.pop(next(iter(self._store)))
            self._store[row] = item_thumb(self.snapshot, row)
        return self._store[row]


def _nearest(sims: np.ndarray, k: int, exclude: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cosines) of the k largest entries of one query's cosines, descending (`exclude` left out)."""
    s = np.asarray(sims, dtype=np.float64).copy()
    if exclude is not None:
        s[exclude] = -np.inf
    rows = np.argpartition(-s, k - 1)[:k] if k < s.size else np.arange(s.size)
    rows = rows[np.argsort(-s[rows], kind="stable")]
    return rows, s[rows]


def _verified(query_thumb, rows: np.ndarray, cosines: np.ndarray, thumbs: "ThumbCache", source: int,
              floor: float) -> QueryScores:
    """A verified calibration query: its nearest rows with cosine >= floor re-scored by verify.match (its
    evidence and geometry). A copy whose original is not among them counts as answered "none" (the model
    cannot name it)."""
    rows = rows[cosines >= floor]
    if query_thumb is None:
        return scored_candidates(np.full(rows.size, -np.inf), rows, -1, np.zeros((rows.size, verify.PENALTIES)))
    v, geometry = verify.matched(query_thumb, [thumbs(r) for r in rows])
    kept = rows[np.isfinite(v)].tolist()
    return scored_candidates(verify.evidence(v), rows, source if source in kept else -1, geometry)


def verified_calibration_queries(snapshot, items: int, seed: int, k: int = VERIFY_K,
                                 progress: bool = True) -> tuple[list[QueryScores], float]:
    """(queries, floor) for the verified stage, over each query's k nearest items by cosine: edited copies
    of `items` sampled items (the answer: their original) and `items` items (hard_negative_sample) searched
    without themselves and without any item whose decoded pixels equal theirs (the answer: "none"; their nearest
    items are their look-alikes). Those are the pairs a scan judges when an item has no duplicate: two originals,
    unedited. (Edited copies searched without their original, the negatives before 2026-12-07, met each look-alike
    one edit further away than the scan does -- the fit learned the dreidels' letter difference from pairs that
    differed more, and called the originals duplicates at p 0.6-0.9.) Either kind is a wrong negative when the
    collection already holds an edited copy of the item: calibrate before adding copies (flow B), as the README
    says. The floor is FLOOR_QUANTILE of the positive copies' cosine to their original."""
    from tqdm.auto import tqdm

    k = min(int(k), snapshot.count - 1)
    ids = snapshot.index.ids
    thumbs = ThumbCache(snapshot)

    def pixels(row):
        try:
            return load_rgb(source_bytes(snapshot, ids[int(row)])).tobytes()
        except (KeyError, OSError, ValueError):
            return None

    emb = snapshot.index.embeddings

    def negative(sims, src, weight):
        rows, cos = _nearest(sims, k + 1 + TWINS, exclude=src)
        same = pixels(src)   # the same picture stored twice is the item too
        # a twin has the item's embedding; its pixels decide
        twin = np.asarray(emb[rows], dtype=np.float32) @ np.asarray(emb[src], dtype=np.float32) >= TWIN_COSINE
        keep = [r != src and not (twin[x] and pixels(r) == same) for x, r in enumerate(rows)]
        return rows[keep][:k], cos[keep][:k], thumbs(src), weight

    copies, others = _calibration_embeddings(
        snapshot, items, seed, progress,
        on_copy=lambda sims, src, payload: (*_nearest(sims, k), src, float(sims[src]),
                                            verify.thumb(load_rgb(payload))),
        on_item=negative)
    floor = float(np.quantile([c[3] for c in copies], FLOOR_QUANTILE))
    queries = [_verified(th, rows, cos, thumbs, src, floor)
               for rows, cos, src, _, th in tqdm(copies, desc="verifying calibration copies", disable=not progress)]
    queries += [replace(_verified(th, rows, cos, thumbs, -1, floor), weight=weight)
                for rows, cos, th, weight in tqdm(others, desc="verifying items without themselves",
                                                  disable=not progress)]
    return queries, floor


def calibration_queries(snapshot, items: int, seed: int, progress: bool = True) -> list[QueryScores]:
    """Edited copies of `items` sampled items (their original is the answer) and `items` other items
    searched without themselves (no original: the answer is "none")."""
    copies, loners = _calibration_embeddings(
        snapshot, items, seed, progress, on_copy=lambda sims, src, payload: query_scores(sims, source=src),
        on_item=lambda sims, row, weight: replace(query_scores(sims, source=-1, exclude=row), weight=weight))
    return copies + loners


def nearest_other_cosine(version, rows: np.ndarray, block: int = 1024) -> np.ndarray:
    """Each row's cosine to its nearest other item by the version's ANN index, items with the same embedding
    (stored twice: twins, which a "none" query drops) left out; -1 when it has no other neighbour."""
    emb = version.embeddings
    out = np.full(rows.size, -1.0)
    for start in range(0, rows.size, block):
        mine = rows[start:start + block]
        scores, found = version.search(np.ascontiguousarray(np.asarray(emb[mine]), dtype=np.float32), 2 + TWINS)
        ok = (found >= 0) & (found != mine[:, None]) & (scores < TWIN_COSINE)
        out[start:start + mine.size] = np.where(ok, scores, -np.inf).max(axis=1, initial=-1.0)
    return out


def hard_negative_sample(version, m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(rows, weights) of the "none" queries: a stratified sample in which the items with a close look-alike
    are over-represented. On a uniform pool of min(n, POOL_FACTOR m) items, the hard stratum is the top
    HARD_FRACTION by nearest-other cosine; HARD_SHARE of the m rows come from it (all of it if smaller), the
    rest uniformly from the others. weight = N_h / n_h of the row's stratum (its inverse inclusion
    probability), scaled to mean 1: weighted means over the sample estimate the uniform ones without bias,
    and the few look-alikes that decide the fit are seen every time instead of by chance."""
    n = version.embeddings.shape[0]
    pool = rng.choice(n, size=min(n, POOL_FACTOR * m), replace=False)
    hardness = nearest_other_cosine(version, pool)
    order = np.argsort(-hardness, kind="stable")
    n_hard = max(1, int(round(HARD_FRACTION * pool.size)))
    hard, easy = pool[order[:n_hard]], pool[order[n_hard:]]
    take_hard = min(hard.size, int(round(HARD_SHARE * m)))
    take_easy = min(easy.size, m - take_hard)
    rows = np.concatenate([rng.choice(hard, take_hard, replace=False), rng.choice(easy, take_easy, replace=False)])
    weights = np.concatenate([np.full(take_hard, hard.size / max(take_hard, 1)),
                              np.full(take_easy, easy.size / max(take_easy, 1))])
    return rows.astype(np.int64), weights / weights.mean()


def _calibration_embeddings(snapshot, items: int, seed: int, progress: bool, on_copy, on_item):
    """([on_copy(cosines to every row, source row, copy bytes)], [on_item(cosines, row, weight)]) over the
    edited copies of `items` uniformly sampled items and `items` items drawn by `hard_negative_sample`; a query's
    cosines live for one block. An item may be in both samples: they are different queries."""
    from tqdm.auto import tqdm

    n = snapshot.count
    rng = np.random.default_rng(seed)
    m = min(int(items), n // 2)
    if m < 10:
        raise ValueError(f"index version {snapshot.version} has {n} items; duplicate calibration needs at least 20")
    sources = rng.permutation(n)[:m]
    loners, loner_weights = hard_negative_sample(snapshot.index, m, rng)
    ids = snapshot.index.ids
    copies, others = [], []
    for start in tqdm(range(0, m, QUERY_BLOCK), desc="calibration copies", disable=not progress):
        rows = sources[start:start + QUERY_BLOCK]
        # decoded as indexing decodes (EXIF orientation, transparency on white), then edited
        payloads = [edited_copy(Image.fromarray(load_rgb(source_bytes(snapshot, ids[r]))), rng)[0] for r in rows]
        sims = _similarities(snapshot, embed_bytes(snapshot, payloads))
        copies += [on_copy(sims[j], int(r), payloads[j]) for j, r in enumerate(rows)]
    for start in range(0, m, QUERY_BLOCK):
        rows, weights = loners[start:start + QUERY_BLOCK], loner_weights[start:start + QUERY_BLOCK]
        sims = _similarities(snapshot, np.asarray(snapshot.index.embeddings[rows], dtype=np.float32))
        others += [on_item(sims[j], int(r), float(weights[j])) for j, r in enumerate(rows)]
    return copies, others


def find_duplicates(snapshot, calibration, *, threshold: float | None = None, rows=None, k: int = 32,
                    max_group: int = 8, progress: bool = True, cache: VerifiedScores | None = None) -> dict:
    """The duplicate groups among `rows` (default: every item) and whatever they link to; `cache` keeps the
    verified stage's pair scores for another scan of the same calibration (default_threshold, then main)."""
    version = snapshot.index
    p = float(calibration.threshold if threshold is None else threshold)
    if not 0.0 < p < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {p}")
    rows = np.arange(snapshot.count) if rows is None else np.asarray(rows, dtype=np.int64)
    t0 = time.perf_counter()
    if calibration.stage == "verified":
        thumbs = ThumbCache(snapshot)

        def scan(some, progress):
            return verified_candidate_sets(version, calibration, some, thumbs, threshold=p, max_group=max_group,
                                           progress=progress, cache=cache)
    else:
        def scan(some, progress):
            return candidate_sets(version, calibration, some, threshold=p, k=k, max_group=max_group,
                                  progress=progress)
    sets, exact = scan(rows, progress)
    needed = sorted({int(j) for cs in sets.values() for j in cs.rows} - set(rows.tolist()))
    if needed:   # the other side of each link (scans of only some rows: index add / sync)
        more, more_exact = scan(needed, False)
        sets.update(more)
        exact += more_exact
    # a clique split off a larger component may leave a member less than p sure: such groups are dropped
    groups = [g for g in (describe_group(g, sets, version.ids) for g in mutual_groups(sets)) if g["confidence"] >= p]
    if rows.size < snapshot.count:
        asked = set(rows.tolist())
        groups = [g for g in groups if asked & set(g["rows"])]
    return {"threshold": p, "groups": groups, "items_scanned": int(rows.size), "exact_log_z": int(exact),
            "seconds": time.perf_counter() - t0}


def default_threshold(snapshot, calibration, target: float | None = None, *, k: int = 32, max_group: int = 8,
                      progress: bool = True, cache: VerifiedScores | None = None, levels=None,
                      min_probability: float = MIN_PROBABILITY) -> tuple[float, bool]:
    """(P, reached) for `softsearch dedup` without --threshold: the groups of a scan at the lowest level, then
    the lowest group confidence at which the groups kept have a mean confidence that reaches the target
    precision, never below `min_probability` (calibration.py default_level; `levels`: P from those fixed levels,
    the rule before 2026-12-06); when none does, the calibration queries' own threshold and False."""
    target = float(calibration.target_precision if target is None else target)
    scan = find_duplicates(snapshot, calibration, threshold=min(LEVELS), k=k, max_group=max_group, progress=progress,
                           cache=cache)
    found = default_level([g["confidence"] for g in scan["groups"]], target, min_probability, levels)
    return (float(calibration.threshold), False) if found is None else (float(found), True)


def scores_cache(snapshot, calibration) -> VerifiedScores | None:
    """A pair-score cache for scans of `calibration` on `snapshot` (None at the encoder stage: nothing to keep)."""
    if calibration.stage != "verified":
        return None
    return VerifiedScores(snapshot.count, int(calibration.verify_k))


def calibrate_snapshot(snapshot, stage: str = "verified", items: int = 300, precision: float = 0.99, seed: int = 0,
                       progress: bool = True):
    """The duplicate calibration of a snapshot at `stage` ("verified" or "encoder")."""
    if not has_images(snapshot):
        raise ValueError(f"index version {snapshot.version} has no readable images (built from vectors, or its "
                         "files are gone): dedup calibrates on edited copies of the indexed images")
    if stage == "verified":
        queries, floor = verified_calibration_queries(snapshot, items, seed, progress=progress)
        return replace(calibrate(queries, target_precision=precision, seed=seed, best_score=verify.BEST_EVIDENCE),
                       stage="verified",
                       verify_k=VERIFY_K, floor=floor)
    return calibrate(calibration_queries(snapshot, items, seed, progress=progress), target_precision=precision,
                     seed=seed)


def latest_calibration(store: IndexStore, checkpoint_sha: str | None):
    """The newest dedup calibration of a version embedded by the same encoder (None if there is none)."""
    from search.duplicates.calibration import DuplicateCalibration

    for version in reversed(store.versions()):
        path = store.duplicates_path(version)
        if not path.is_file():
            continue
        try:
            if store.manifest(version).checkpoint_record.get("sha256") != checkpoint_sha:
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, KeyError):
            continue
        return version, DuplicateCalibration.from_json(data["calibration"]), float(data["threshold"])
    return None


def report_new_duplicates(root, base: str | None, version: str, progress: bool = False) -> dict | None:
    """Print (and return) the groups that items new in `version` (not in `base`) form with indexed items,
    at the calibration of the newest dedup scan made with the same encoder; None without one."""
    from search.serving.searcher import Searcher

    store = IndexStore(root)
    if version is None or version == base:
        return None
    found = latest_calibration(store, store.manifest(version).checkpoint_record.get("sha256"))
    if found is None:
        logger.info("no dedup scan with this encoder yet: run 'softsearch dedup --index %s' to find duplicates", root)
        return None
    scanned, calib, threshold = found
    searcher = Searcher(root)
    searcher.load(version)
    snapshot = searcher.snapshot()
    old = set(store.load(base, verify=False, gpu=False).ids) if base else set()
    new_rows = [r for r, i in enumerate(snapshot.index.ids) if i not in old]
    result = find_duplicates(snapshot, calib, threshold=threshold, rows=new_rows, progress=progress)
    for g in result["groups"]:
        fresh = [i for i in g["ids"] if i not in old]
        print(f"duplicate: {', '.join(fresh)} ~ {', '.join(i for i in g['ids'] if i in old) or '(each other)'} "
              f"(confidence {g['confidence']:.3f})")
    print(f"{len(result['groups'])} duplicate groups among {len(new_rows)} new items (p >= {threshold:.3g}, "
          f"calibration of {scanned})")
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from search.serving.searcher import Searcher

    root = require_store(args.index)
    store = IndexStore(root)
    version = args.version or store.current_version()
    if version is None:
        raise FileNotFoundError(f"no current index version under {root}; build one first (softsearch index build)")
    searcher = Searcher(root)
    searcher.load(version)
    snapshot = searcher.snapshot()
    if args.threshold is not None and not 0.0 < args.threshold < 1.0:
        raise ValueError(f"--threshold must be in (0, 1), got {args.threshold}")
    if not 0.0 < args.precision < 1.0:
        raise ValueError(f"--precision must be in (0, 1), got {args.precision}")
    if not 0.0 <= args.min_probability < 1.0:
        raise ValueError(f"--min-probability must be in [0, 1), got {args.min_probability}")
    if args.prior is None:   # a p that holds at this collection's base rate wherever it can be estimated
        args.prior = "collection" if args.stage == "verified" else "calibration"
    if args.prior == "collection" and args.stage != "verified":
        raise ValueError("--prior collection needs the verified stage (every item's p(none) from its verified "
                         "candidates); drop --stage encoder")
    calib = calibrate_snapshot(snapshot, args.stage, args.calibration_items, args.precision, args.seed,
                               progress=not args.no_progress)
    threshold = args.threshold
    # the verified pair scores do not depend on the threshold (nor on the prior): every scan below shares them
    cache = scores_cache(snapshot, calib)
    share = None
    if args.prior == "collection":   # the collection's duplicate share needs every item scored first (no labels)
        find_duplicates(snapshot, calib, threshold=min(LEVELS), k=args.k, max_group=args.max_group,
                        progress=not args.no_progress, cache=cache)
        share = collection_share(cache.none_probabilities(calib), calib.design_share)
        calib = calib.with_share(share)
    if threshold is None:   # the lowest P whose groups are expected to reach --precision
        threshold, reached = default_threshold(snapshot, calib, args.precision, k=args.k, max_group=args.max_group,
                                               progress=not args.no_progress, cache=cache,
                                               min_probability=args.min_probability)
        if not reached:
            print(f"note: no groups are expected to reach precision {args.precision:.3g}; "
                  f"p >= {threshold:.3g} from the calibration queries. {calib.limit_note()}")
    found = find_duplicates(snapshot, calib, threshold=threshold, k=args.k, max_group=args.max_group,
                            progress=not args.no_progress, cache=cache)
    if cache is not None and share is None:   # reported either way: the scan above scored every item
        share = collection_share(cache.none_probabilities(calib), calib.design_share)
    result = {"format": FORMAT, "version": version, "created": utc_now(), "count": snapshot.count,
              "temperature": calib.temperature, "bias": calib.bias, "calibration": calib.to_json(),
              "prior": args.prior, "design_share": calib.design_share, "collection_share": share,
              "k": args.k, "max_group": args.max_group, **found}
    path = store.duplicates_path(version)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    atomic_write(path, lambda fh: fh.write(text))
    atomic_write(store.duplicates_path(version, ".html"), lambda fh: fh.write(render_page(result, snapshot)))
    if args.out:
        Path(args.out).write_text(text)
    grouped = sum(len(g["ids"]) for g in result["groups"])
    print(f"dedup {version}: {len(result['groups'])} groups ({grouped} items) at p >= {result['threshold']:.3g} "
          f"(duplicate temperature {calib.temperature:.4g}, {calib.stage} stage, held-out ECE {calib.ece:.3f}"
          + (f"; items with a duplicate: {share:.1%} here, {calib.design_share:.0%} in the calibration, "
             f"p for the {args.prior}'s share" if share is not None
             else "") + f"); {path}")
    return 0
