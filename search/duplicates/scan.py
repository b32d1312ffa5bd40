"""One duplicate scan of a collection: thumbnails, identical pictures joined by digest, candidate pairs,
synthetic copies, the self-supervised fit (model.py), probabilities, a threshold and groups. Knows nothing of
index versions: job.py feeds it an index version's images and embeddings, tests and benchmarks a folder's.

In a paragraph: every image becomes a 64 x 64 greyscale and a 16 x 16 colour thumbnail; pictures with
identical decoded pixels or identical thumbnails are one group at once (p 1), and one item per group stands
for it from then on; each such item's nearest items by the thumbnail's low-frequency DCT beside its colour
layout (and, when there are embeddings, by the index's own) are its candidates; each candidate pair is aligned
(an affine map and a gain, align.py) and scored by how well it then correlates; a logistic regression fitted
on this collection -- edited copies of its own images as positives, its candidate pairs as an unlabelled
mixture (positive-unlabelled learning; the share of duplicates by Best Bin Estimation, the ratio by an
isotonic fit) -- turns those scores into the probability that the pair is one picture edited, at this
collection's own share of duplicates.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import numpy as np
from PIL import Image
from tqdm.auto import tqdm

from search.duplicates.align import pair_features
from search.duplicates.baselines import hash_table
from search.duplicates.config import DedupConfig
from search.duplicates.descriptors import (
    chroma,
    identical_groups,
    search_descriptor,
    thumbnail,
    thumbnails_digest_rgb,
)
from search.duplicates.edits import edited_copy
from search.duplicates.model import (
    NAMES,
    DuplicateModel,
    design,
    fit_model,
    items_share,
    threshold_for_precision,
)
from training.images import load_rgb

logger = logging.getLogger(__name__)
EDIT_SIDE = 320  # synthetic copies are made from the picture shrunk to this longest side (speed)


@dataclass
class Scan:
    """A scan's pairs (rows a < b), their probabilities, the fitted model and what was skipped: first the
    aligned candidate pairs (their design rows in x), then the pairs joined as identical (`identical` True, p
    1)."""

    a: np.ndarray
    b: np.ndarray
    p: np.ndarray
    x: np.ndarray
    model: DuplicateModel
    skipped: dict[int, str]
    share_items: float
    seconds: dict = field(default_factory=dict)
    positives_x: np.ndarray | None = None
    identical: np.ndarray | None = None
    hashes: dict = field(default_factory=dict)  # baselines.hash_table of the items (the page's comparison)
    ok: np.ndarray | None = None
    copy: object | None = None  # copy_encoder.CopyModel with verifier "encoder" or "both"
    # per verifier, over the scored pairs before the identical ones: "pixels" / "encoder" p of the same
    # pairs, and the encoder's own candidate pairs ("encoder_a", "encoder_b", "encoder_p")
    parts: dict = field(default_factory=dict)


def read_thumbnails(read: Callable[[int], object], rows, side: int, progress: bool, rgb_out=None):
    """(grey (n, side, side) uint8, chroma (n, 16, 16, 2) float16, {row: error}, keys) for the given rows;
    unreadable rows stay zero; keys[k] is (pixel digest, thumbnail digest), None when unreadable; `rgb_out`
    (n, S, S, 3) uint8, when given, is filled with S-pixel colour thumbnails (the copy encoder's input)."""
    rows = np.asarray(rows)
    thumbs = np.zeros((len(rows), side, side), np.uint8)
    colours = np.zeros((len(rows), 16, 16, 2), np.float16)
    skipped, keys = {}, [None] * len(rows)
    for k, r in enumerate(tqdm(rows, desc="thumbnails", unit="img", disable=not progress, mininterval=1.0)):
        try:
            g, c, digest, big = thumbnails_digest_rgb(
                read(int(r)), side, rgb_side=0 if rgb_out is None else rgb_out.shape[1]
            )
            thumbs[k], colours[k] = g, chroma(c)
            if rgb_out is not None:
                rgb_out[k] = big
            keys[k] = (b"p" + digest, b"t" + g.tobytes() + c.tobytes())
        except (OSError, ValueError, KeyError) as err:  # ImageError is a ValueError
            skipped[int(r)] = f"{type(err).__name__}: {err}"
    return thumbs, colours, skipped, keys


def candidate_pairs(
    desc: np.ndarray,
    ok: np.ndarray,
    k: int,
    extra: np.ndarray | None = None,
    flipped: np.ndarray | None = None,
    rep: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Unique pairs (a < b) of `ok` rows: each row's k nearest by descriptor cosine (exact FAISS inner
    product; with `flipped`, also the nearest of its mirror), plus `extra` (n, k') neighbour rows (-1: none),
    those read through `rep` (each row's representative: a group's members lend it their neighbours)."""
    import faiss

    n = len(desc)
    good = np.flatnonzero(ok)
    pairs = []
    if good.size > 1:
        index = faiss.IndexFlatIP(desc.shape[1])
        index.add(np.ascontiguousarray(desc[good]))
        kk = min(k + 1, good.size)
        for q in (desc, flipped) if flipped is not None else (desc,):
            _, found = index.search(np.ascontiguousarray(q[good]), kk)
            a = np.repeat(good, kk)
            b = np.where(found.reshape(-1) >= 0, good[np.maximum(found.reshape(-1), 0)], -1)
            pairs.append(np.column_stack([a, b]))
    if extra is not None:
        kk = extra.shape[1]
        own = np.repeat(np.arange(n), kk)
        other = extra.reshape(-1)
        if rep is not None:
            own, other = rep[own], np.where(other >= 0, rep[np.maximum(other, 0)], -1)
        pairs.append(np.column_stack([own, other]))
    if not pairs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pr = np.concatenate(pairs).astype(np.int64)
    pr = pr[(pr[:, 1] >= 0) & (pr[:, 0] != pr[:, 1])]
    pr = pr[ok[pr[:, 0]] & ok[pr[:, 1]]]
    pr = np.unique(np.sort(pr, axis=1), axis=0)
    return pr[:, 0], pr[:, 1]


def synthetic_features(
    read, rows, thumbs, colours, desc, config: DedupConfig, rng, progress: bool, rgb_out=None, first_out=None
) -> tuple[np.ndarray, np.ndarray]:
    """(align features, descriptor cosine) of edited copies of the given rows against their originals, or,
    for a `copy_pairs` share of them, against a second, independent edit of the same picture (two copies
    of one lost original are as much a duplicate pair as a copy and its original); a quarter mirrored with
    flips; `rgb_out`, a list, gets each copy's (original row, copy_source-pixel colour thumbnail), and
    `first_out` beside it the other side's colour thumbnail when that is a second copy (else None)."""
    left, left_colours, copies, copy_colours = [], [], [], []
    decoded: dict[int, Image.Image] = {}  # a small collection gives each item several copies: decode once
    for r in tqdm(rows, desc="synthetic copies", unit="img", disable=not progress, mininterval=1.0):
        try:
            if int(r) not in decoded:
                im = Image.fromarray(load_rgb(read(int(r)), min_side=EDIT_SIDE))
                im.thumbnail((EDIT_SIDE, EDIT_SIDE))
                decoded[int(r)] = im
            im = decoded[int(r)]
            data, _ = edited_copy(im, rng, flip=bool(config.flips and rng.random() < 0.25))
            g, c = thumbnail(data, config.thumb)
            first = None
            if rng.random() < config.copy_pairs:
                first, _ = edited_copy(im, rng)
                g0, c0 = thumbnail(first, config.thumb)
                left.append(g0)
                left_colours.append(chroma(c0))
            else:
                left.append(thumbs[int(r)])
                left_colours.append(colours[int(r)])
            copies.append(g)
            copy_colours.append(chroma(c))
            if rgb_out is not None:
                rgb_out.append((int(r), thumbnail(data, 4, colour_side=config.copy_source)[1]))
            if first_out is not None:
                first_out.append(
                    None if first is None else thumbnail(first, 4, colour_side=config.copy_source)[1]
                )
        except (OSError, ValueError, KeyError) as err:
            logger.warning("no synthetic copy of row %d: %s", r, err)
    if not copies:
        return np.zeros((0, len(NAMES) - 1), np.float32), np.zeros(0)
    lt, lc = np.stack(left), np.stack(left_colours).astype(np.float32)
    c, cc = np.stack(copies), np.stack(copy_colours)
    k = np.arange(len(c))
    f = pair_features(
        lt,
        k,
        k,
        colours=lc,
        other=c,
        other_colours=cc,
        iters=config.iterations,
        zooms=config.zooms,
        cell=config.cell,
        flips=config.flips,
    )
    ld = search_descriptor(lt, lc, config.dct, config.colour_weight)
    cd = search_descriptor(c, cc, config.dct, config.colour_weight)
    cos = np.einsum("ij,ij->i", ld, cd)
    if config.flips:
        flip = search_descriptor(c, cc, config.dct, config.colour_weight, flip=True)
        cos = np.maximum(cos, np.einsum("ij,ij->i", ld, flip))
    return f, cos


def synthetic_positives(
    read, rows, thumbs, colours, desc, config: DedupConfig, rng, progress: bool, rgb_out=None, first_out=None
) -> np.ndarray:
    """Design rows of `synthetic_features` (the positives the fit learns from)."""
    f, cos = synthetic_features(read, rows, thumbs, colours, desc, config, rng, progress, rgb_out, first_out)
    return design(f, cos) if len(f) else np.zeros((0, len(NAMES)))


def pair_design(thumbs, colours, desc, a, b, config: DedupConfig, progress: bool, flipped=None) -> np.ndarray:
    with tqdm(
        total=len(a), desc="aligning candidate pairs", unit="pair", disable=not progress, mininterval=1.0
    ) as bar:
        f = pair_features(
            thumbs,
            a,
            b,
            colours=colours,
            iters=config.iterations,
            zooms=config.zooms,
            cell=config.cell,
            flips=config.flips,
            progress=bar,
        )
    cos = np.einsum("ij,ij->i", desc[a], desc[b])
    if flipped is not None:
        cos = np.maximum(cos, np.einsum("ij,ij->i", desc[a], flipped[b]))
    return design(f, cos)


def scan_collection(
    read: Callable[[int], object],
    n: int,
    config: DedupConfig = DedupConfig(),
    *,
    neighbours: Callable[[int], np.ndarray] | None = None,
    progress: bool = True,
) -> Scan:
    """Scan n items (`read(row)` -> a path or bytes; `neighbours(k)` -> (n, k) nearest rows by the index's
    embeddings, -1 where none) and fit the model on them."""
    t = {}
    t0 = time.perf_counter()
    rgb = (
        np.zeros((n, config.copy_source, config.copy_source, 3), np.uint8)
        if config.verifier != "pixels"
        else None
    )
    thumbs, colours, skipped, keys = read_thumbnails(read, np.arange(n), config.thumb, progress, rgb)
    ok = np.ones(n, bool)
    ok[list(skipped)] = False
    if ok.sum() < 20:
        raise ValueError(f"{int(ok.sum())} readable images; a duplicate scan needs at least 20")
    t["thumbnails"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # identical pictures (pixels or thumbnails) are one group before any neighbour search: each member is
    # linked to the group's first row at p 1, and only that row takes part in the candidates and the fit
    rep = identical_groups(keys)
    same = np.flatnonzero(rep != np.arange(n))
    lead = ok & (rep == np.arange(n))
    desc = search_descriptor(thumbs, colours, config.dct, config.colour_weight)
    flipped = (
        search_descriptor(thumbs, colours, config.dct, config.colour_weight, flip=True)
        if config.flips
        else None
    )
    extra = neighbours(config.k_embedding) if neighbours is not None and config.k_embedding else None
    rng = np.random.default_rng(config.seed)
    good = np.flatnonzero(lead)
    # each readable item once in random order, again until there are calibration_items copies (small
    # collections)
    reps = -(-config.calibration_items // good.size)
    sample = np.concatenate([rng.permutation(good) for _ in range(reps)])[: config.calibration_items]
    copy, parts = None, {}
    if config.verifier != "pixels":
        from search.duplicates.copy_encoder import (
            copy_candidates,
            embed_rgb,
            fit_readout,
            held_apart_copies,
            train_and_embed,
        )
        from search.duplicates.copy_encoder import neighbours as encoder_neighbours

        encoder, loss, z, t["copy encoder training"] = train_and_embed(rgb, lead, config, progress)
        nb = encoder_neighbours(z, config.copy_k, lead)
        t0 = time.perf_counter()
    if config.verifier == "encoder":
        copy = fit_readout(encoder, z, held_apart_copies(read, sample, config), lead, config, loss, t)
        t["copy readout"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        a, b, p = copy_candidates(z, lead, copy, config, nb)
        parts.update(encoder_a=a, encoder_b=b, encoder_p=p)
        x, xp, model = np.zeros((len(a), len(NAMES))), None, None
        t["candidates"] = time.perf_counter() - t0
    else:
        if config.verifier == "both":  # the encoder's k_descriptor nearest are candidates too
            mine = nb[0][:, : config.k_descriptor]
            extra = mine if extra is None else np.hstack([extra, mine])
        a, b = candidate_pairs(desc, lead, config.k_descriptor, extra, flipped, rep)
        t["candidates"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        x = pair_design(thumbs, colours, desc, a, b, config, progress, flipped)
        t["pairs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        copies_rgb = [] if config.verifier == "both" else None
        firsts = [] if config.verifier == "both" else None
        xp = synthetic_positives(
            read, sample, thumbs, colours, desc, config, rng, progress, copies_rgb, firsts
        )
        t["copies"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fit = partial(
            fit_model,
            l2=config.l2,
            max_share=config.max_share,
            share_delta=config.share_delta,
            segments=config.segments,
            threshold=config.threshold,
        )
        model = fit(xp, x)
        if config.verifier == "both":
            # one model on both: the encoder's cosine (Fisher z) a seventh monotone feature of the same
            # positive-unlabelled fit, its synthetic copies embedded beside their originals; the
            # none-softmax read from the same copies (reported beside it)
            copy = fit_readout(encoder, z, copies_rgb, lead, config, loss, t)
            ea, eb, ep = copy_candidates(z, lead, copy, config, nb)
            parts.update(encoder_a=ea, encoder_b=eb, encoder_p=ep)
            parts.update(
                pixels=model.probability(x),
                encoder=copy.pair_probability(z, a, b, *nb, config.copy_readout),
                encoder_cos=np.einsum("ij,ij->i", z[a], z[b]),
            )
            used = np.array([r for r, _ in copies_rgb], np.int64)
            zc = embed_rgb(encoder, np.stack([c for _, c in copies_rgb]), config.copy_side)
            fz = lambda c: np.arctanh(np.clip(c, -0.999, 0.99999))  # noqa: E731
            x = np.column_stack([x, fz(parts["encoder_cos"])])
            # the encoder's cosine between the same two pictures as the pixel features: the original, or
            # for a copy pair (copy_pairs) the first copy, against the copy
            zl = z[used].copy()
            two = [k for k, f in enumerate(firsts) if f is not None]
            if two:
                zl[two] = embed_rgb(encoder, np.stack([firsts[k] for k in two]), config.copy_side)
            xp = np.column_stack([xp, fz(np.einsum("ij,ij->i", zl, zc))])
            model = fit(xp, x)
        p = model.probability(x)
        t["fit"] = time.perf_counter() - t0
    a, b, p = np.r_[a, rep[same]], np.r_[b, same], np.r_[p, np.ones(same.size)]
    identical = np.r_[np.zeros(len(x), bool), np.ones(same.size, bool)]
    t0 = time.perf_counter()
    hashes = hash_table(thumbs, ok)
    t["baseline hashes"] = time.perf_counter() - t0
    return Scan(
        a, b, p, x, model, skipped, items_share(n, a, b, p), t, xp, identical, hashes, ok, copy, parts
    )


def score_pairs(
    thumbs, colours, desc, a, b, model: DuplicateModel, config: DedupConfig, progress: bool = False
):
    """Probabilities of given pairs under an already fitted model (new items after `index add`)."""
    flipped = (
        search_descriptor(thumbs, colours, config.dct, config.colour_weight, flip=True)
        if config.flips
        else None
    )
    return model.probability(pair_design(thumbs, colours, desc, a, b, config, progress, flipped))


def choose_threshold(p: np.ndarray, config: DedupConfig, threshold: float | None, precision: float | None):
    """(threshold, how it was chosen): --threshold as given; --precision: the lowest found p whose pairs are
    expected to reach it (always a found p); otherwise the config's (0.5: each pair kept is more likely a
    duplicate than not)."""
    if threshold is not None:
        return float(threshold), "given"
    if precision is not None:
        t = threshold_for_precision(p, precision)
        if t is not None:
            return t, f"lowest p whose pairs are expected to reach precision {precision:g}"
        return config.threshold, f"no pairs are expected to reach precision {precision:g}; the default"
    return config.threshold, "default"


def groups_of(a, b, p, threshold: float, ids: list[str]) -> list[dict]:
    """Connected components of the pairs at p >= threshold, largest first; a group's confidence is the
    lowest p of the pairs that hold it together (each kept pair is listed)."""
    keep = np.flatnonzero(p >= threshold)
    parent: dict[int, int] = {}

    def root(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for k in keep:
        parent[root(int(a[k]))] = root(int(b[k]))
    members: dict[int, list[int]] = {}
    for x in list(parent):
        members.setdefault(root(x), []).append(x)
    edges: dict[int, list[int]] = {}
    for k in keep:
        edges.setdefault(root(int(a[k])), []).append(int(k))
    out = []
    for r, rows in members.items():
        rows = sorted(rows)
        pairs = [
            {
                "a": ids[int(a[k])],
                "b": ids[int(b[k])],
                "p_ab": float(p[k]),
                "p_ba": float(p[k]),
                "similarity": float(p[k]),
            }
            for k in edges[r]
        ]
        out.append(
            {
                "ids": [ids[x] for x in rows],
                "rows": rows,
                "confidence": float(min(p[k] for k in edges[r])),
                "pairs": pairs,
            }
        )
    return sorted(out, key=lambda g: (-len(g["rows"]), -g["confidence"], g["rows"]))


def notes(scan: Scan, threshold: float, how: str) -> list[str]:
    """What a user should know about this scan's probabilities, each with what to do."""
    out = []
    if scan.model is not None and scan.model.bound:
        out.append(scan.model.bound)
    top = float(scan.p.max()) if scan.p.size else 0.0
    if top < threshold:
        out.append(
            f"no pair reaches p >= {threshold:.3g}; the highest p found is {top:.3g}"
            + (f" (--threshold {top:.3g} would keep that pair)" if top > 0 else "")
        )
    recall = (scan.model or scan.copy).copy_recall if (scan.model or scan.copy) else float("nan")
    if np.isfinite(recall) and recall < 0.8:
        out.append(
            f"only {recall:.0%} of held-out synthetic copies reach p >= "
            f"{threshold:.3g}: edited copies here are hard to tell from look-alikes; expect low recall"
        )
    if scan.skipped:
        out.append(f"{len(scan.skipped)} unreadable images skipped (listed under 'skipped')")
    if how.startswith("no pairs"):
        out.append(how)
    return out
