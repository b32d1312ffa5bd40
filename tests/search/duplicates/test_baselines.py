"""Identical pictures joined by digest before any neighbour search, and the baseline rules the page shows
beside the scan, each against an independent computation (imagehash itself, brute-force Hamming and
cosine)."""

from __future__ import annotations

import io
from itertools import combinations

import numpy as np
import pytest
from PIL import Image

from search.duplicates.baselines import cosine_pairs, dhash_bits, hamming_pairs, phash_bits, summary, table
from search.duplicates.descriptors import identical_groups, thumbnail_and_digest


def _png(arr: np.ndarray, level: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=level)
    return buf.getvalue()


def test_hashes_are_imagehash_on_the_same_thumbnail():
    imagehash = pytest.importorskip("imagehash")
    rng = np.random.default_rng(0)
    for _ in range(5):
        grey = (rng.random((64, 64)) * 255).astype(np.uint8)
        grey[16:40, 8:50] = 200  # some structure besides noise
        im = Image.fromarray(grey)
        assert (dhash_bits(grey) == imagehash.dhash(im).hash.reshape(-1)).all()
        assert (phash_bits(grey) == imagehash.phash(im).hash.reshape(-1)).all()


def test_hamming_and_cosine_pairs_match_brute_force():
    rng = np.random.default_rng(1)
    bits = rng.random((300, 64)) < 0.5
    bits[100:110] = bits[5]  # a clique within distance 0
    bits[200:220] ^= rng.random((20, 64)) < 0.05  # near 200's originals: arbitrary
    ok = np.ones(300, bool)
    ok[7] = False
    d = (bits[:, None, :] != bits[None, :, :]).sum(2)
    for cutoff in (0, 8, 20):
        want = {(i, j) for i, j in zip(*np.nonzero(d <= cutoff)) if i < j and ok[i] and ok[j]}
        got = {tuple(map(int, p)) for p in hamming_pairs(np.packbits(bits, axis=1), ok, cutoff)}
        assert got == want
    emb = rng.normal(size=(200, 16)).astype(np.float32)
    emb[50:55] = emb[3] + rng.normal(scale=0.01, size=(5, 16))
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    cos = unit @ unit.T
    want = {(i, j) for i, j in zip(*np.nonzero(cos >= 0.99)) if i < j}
    assert {tuple(map(int, p)) for p in cosine_pairs(emb * 3.0)} == want and len(want) >= 10
    groups = [{"rows": [3, 50, 51]}]
    row = summary(
        "cosine",
        "r",
        np.array(sorted(want)),
        np.where(np.isin(np.arange(200), [3, 50, 51]), 0, -1),
        {frozenset((3, 50)), frozenset((60, 61))},
    )
    assert row["pairs"] == len(want) and row["pairs_in_scan_groups"] == 3 and row["scan_pairs_kept_too"] == 1
    rows = table({"dHash": np.packbits(bits[:200], axis=1)}, ok[:200], groups, set(), emb)
    assert [r["name"] for r in rows] == ["dHash", "cosine"] and rows[0]["pairs"] == 55


def test_identical_pixels_are_one_group_whatever_the_bytes():
    rng = np.random.default_rng(2)
    pics = [(rng.random((40, 50, 3)) * 255).astype(np.uint8) for _ in range(4)]
    files = [
        _png(pics[0], 1),
        _png(pics[1], 1),
        _png(pics[0], 9),
        _png(pics[2], 1),
        _png(pics[0], 5),
        _png(pics[3], 1),
    ]
    digests = [thumbnail_and_digest(f, 32)[2] for f in files]
    assert len(set(files)) == 6 and digests[0] == digests[2] == digests[4] and len(set(digests)) == 4
    rep = identical_groups([[d] for d in digests])
    assert rep.tolist() == [0, 1, 0, 3, 0, 5]
    # any shared key joins, transitively; None (unreadable) stays alone
    rep = identical_groups([["x"], ["y"], ["y", "z"], None, ["z", "x"], ["w"]])
    assert rep.tolist() == [0, 0, 0, 3, 0, 5]


@pytest.mark.slow
def test_a_large_clique_of_identical_files_is_grouped_whole():
    """Twelve byte-different files of one picture among 60 others: more than a candidate list holds (6 + 6);
    the digest joins all 66 pairs, and the fit runs on the others."""
    from search.duplicates.config import DedupConfig
    from search.duplicates.scan import groups_of, scan_collection

    rng = np.random.default_rng(4)
    others = []
    for _ in range(61):  # smooth random pictures: noise, blurred to blobs
        small = (rng.random((6, 8, 3)) * 255).astype(np.uint8)
        others.append(np.asarray(Image.fromarray(small).resize((160, 120), Image.BICUBIC)))
    pic = others.pop()
    others = [_png(o, 6) for o in others]
    clique = [_png(pic, level) for level in range(10)] + [_png(pic, 0), _png(pic, 3)]
    sources = others + clique
    scan = scan_collection(
        lambda r: sources[r], len(sources), DedupConfig(calibration_items=60), progress=False
    )
    groups = groups_of(scan.a, scan.b, scan.p, 0.5, [str(i) for i in range(len(sources))])
    rows = set(range(60, 72))
    assert any(set(g["rows"]) == rows for g in groups)
    assert int(scan.identical.sum()) == 11 and (scan.p[scan.identical] == 1.0).all()
    assert not set(combinations(sorted(rows), 2)) & {
        (int(a), int(b)) for a, b in zip(scan.a[~scan.identical], scan.b[~scan.identical])
    }
