"""The rules people already use for near-duplicates, run beside the scan on the same thumbnails so the page
can show what each would have kept: dHash and pHash (imagehash's definitions, at Hamming distance <= 8), PDQ
(when the pdqhash package is installed, <= 31 of 256 bits) and cosine >= 0.99 on the index's embeddings
(immich's rule). No labels: the page lists how many pairs each keeps and how many of them the scan's groups
hold too."""

from __future__ import annotations

import numpy as np
from PIL import Image
from scipy.fft import dct

HASH_CUTOFF = {"dHash": 8, "pHash": 8, "PDQ": 31}  # the cut-offs these hashes are usually used at (bits)
COSINE = 0.99
BLOCK = 4096


def dhash_bits(grey: np.ndarray) -> np.ndarray:
    """(64,) bool: imagehash.dhash of one greyscale picture (9 x 8 Lanczos, each pixel brighter than its
    left)."""
    px = np.asarray(Image.fromarray(grey).resize((9, 8), Image.LANCZOS), np.float64)
    return (px[:, 1:] > px[:, :-1]).reshape(-1)


def phash_bits(grey: np.ndarray) -> np.ndarray:
    """(64,) bool: imagehash.phash (32 x 32 Lanczos, 2-D DCT-II, the 8 x 8 lowest frequencies above their
    median)."""
    px = np.asarray(Image.fromarray(grey).resize((32, 32), Image.LANCZOS), np.float64)
    low = dct(dct(px, axis=0), axis=1)[:8, :8]
    return (low > np.median(low)).reshape(-1)


def pdq_bits(grey: np.ndarray) -> np.ndarray | None:
    """(256,) bool PDQ hash of one greyscale picture; None when pdqhash is not installed."""
    try:
        import pdqhash
    except ImportError:
        return None
    return pdqhash.compute(np.ascontiguousarray(np.repeat(grey[:, :, None], 3, axis=2)))[0].astype(bool)


def hash_table(thumbs: np.ndarray, ok: np.ndarray) -> dict[str, np.ndarray]:
    """{name: (n, bytes) uint8 packed bits} of every hash available, from the scan's greyscale thumbnails
    (unreadable rows hashed as their zero thumbnail; `pairs` leaves them out)."""
    out = {
        "dHash": np.packbits(np.stack([dhash_bits(t) for t in thumbs]), axis=1),
        "pHash": np.packbits(np.stack([phash_bits(t) for t in thumbs]), axis=1),
    }
    if len(thumbs) and pdq_bits(thumbs[0]) is not None:
        out["PDQ"] = np.packbits(np.stack([pdq_bits(t) for t in thumbs]), axis=1)
    return out


def hamming_pairs(packed: np.ndarray, ok: np.ndarray, cutoff: int) -> np.ndarray:
    """(m, 2) rows a < b of `ok` items whose hashes differ in at most `cutoff` bits (exact, FAISS
    popcount)."""
    import faiss

    good = np.flatnonzero(ok)
    if good.size < 2:
        return np.zeros((0, 2), np.int64)
    index = faiss.IndexBinaryFlat(packed.shape[1] * 8)
    index.add(np.ascontiguousarray(packed[good]))
    found = []
    for s in range(0, good.size, BLOCK):
        lims, _, idx = index.range_search(np.ascontiguousarray(packed[good[s : s + BLOCK]]), cutoff + 1)
        rows = np.repeat(np.arange(s, min(s + BLOCK, good.size)), np.diff(lims).astype(np.int64))
        found.append(np.column_stack([good[rows], good[idx.astype(np.int64)]]))
    pr = np.concatenate(found)
    return pr[pr[:, 0] < pr[:, 1]]


def cosine_pairs(embeddings, threshold: float = COSINE) -> np.ndarray:
    """(m, 2) rows a < b whose embeddings (unit-normalised here) have cosine >= threshold (exact, FAISS)."""
    import faiss

    n = embeddings.shape[0]
    if n < 2:
        return np.zeros((0, 2), np.int64)
    x = np.asarray(embeddings, np.float32)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(np.ascontiguousarray(x))
    found = []
    for s in range(0, n, BLOCK):
        lims, _, idx = index.range_search(np.ascontiguousarray(x[s : s + BLOCK]), float(threshold))
        rows = np.repeat(np.arange(s, min(s + BLOCK, n)), np.diff(lims).astype(np.int64))
        found.append(np.column_stack([rows, idx]))
    pr = np.concatenate(found).astype(np.int64)
    return pr[pr[:, 0] < pr[:, 1]]


def table(hashes: dict, ok: np.ndarray, groups: list[dict], kept: set, embeddings=None) -> list[dict]:
    """`summary` rows of every hash at its usual cut-off and, given embeddings, of cosine >= 0.99."""
    group_of = np.full(len(ok), -1, np.int64)
    for g, grp in enumerate(groups):
        group_of[grp["rows"]] = g
    rows = [
        summary(
            name,
            f"Hamming distance <= {HASH_CUTOFF[name]} of {bits.shape[1] * 8} bits",
            hamming_pairs(bits, ok, HASH_CUTOFF[name]),
            group_of,
            kept,
        )
        for name, bits in hashes.items()
    ]
    if embeddings is not None:
        rows.append(
            summary(
                "cosine",
                f"cosine >= {COSINE:g} of the index's embeddings",
                cosine_pairs(embeddings),
                group_of,
                kept,
            )
        )
    return rows


def summary(name: str, rule: str, pairs: np.ndarray, group_of: np.ndarray, kept: set) -> dict:
    """One page row: pairs the rule keeps, the items they touch, how many of those pairs the scan's groups
    also hold (both ends in one group; `group_of` -1 for ungrouped rows), how many of the scan's kept pairs
    (`kept`, frozensets of rows) the rule keeps too."""
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    ga, gb = group_of[pairs[:, 0]], group_of[pairs[:, 1]]
    mine = {frozenset((int(a), int(b))) for a, b in pairs}
    return {
        "name": name,
        "rule": rule,
        "pairs": int(len(pairs)),
        "items": int(np.unique(pairs).size),
        "pairs_in_scan_groups": int(((ga == gb) & (ga >= 0)).sum()),
        "scan_pairs_kept_too": int(len(mine & kept)),
        "scan_pairs": int(len(kept)),
    }
