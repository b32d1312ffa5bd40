"""Synthetic captions: bins and words checked against the rendered pixels, the exact ideal, the oracle gap."""

import json

import numpy as np
import pytest

from search.evaluation.gap import softmax_gap_dense
from search.evaluation.text_eval import caption_queries, text_gap, text_recall
from training.captions import (
    TEMPLATES,
    CaptionIdeal,
    CaptionScheme,
    oracle_image_embedding,
    oracle_text_embedding,
    read_captions,
)
from training.synthetic import render, sample_latents

SCHEME = CaptionScheme()


def test_words_name_what_the_pixels_show():
    # a disc straight up, red, light from the east: read back from the image itself
    lat = np.array([[0.0, 0.0, np.pi / 2]])
    assert SCHEME.captions(lat) == ["a red disc at the top, light from the east"]
    img = render(lat, resolution=32)[0].astype(float)
    ys, xs = np.nonzero(img[..., 0] - img[..., 1] > 60)  # red-dominant pixels = the disc
    assert ys.mean() < 12 and abs(xs.mean() - 15.5) < 2  # top row band, centred horizontally
    grey = img[28:, :, 1]  # background strip at the bottom
    assert grey[:, -4:].mean() > grey[:, :4].mean() + 20  # brighter to the east (right)


def test_bins_are_centred_arcs():
    b = SCHEME.bins
    for i, n in enumerate(b):
        width = 2 * np.pi / n
        for k in range(n):
            for off in (-0.49 * width, 0.0, 0.49 * width):
                lat = np.zeros((1, 3))
                lat[0, i] = k * width + off
                assert SCHEME.bin_indices(lat)[0, i] == k


@pytest.mark.parametrize("template", range(len(TEMPLATES)))
def test_every_template_names_the_cell(template):
    lat = sample_latents(600, 3, "test")
    cells = SCHEME.cells(lat)
    caps = SCHEME.captions(lat, np.full(len(lat), template))
    assert [SCHEME.parse(c) for c in caps] == cells.tolist()


def test_cells_are_equal_mass():
    # uniform latents -> every one of the n_cells cells has probability 1 / n_cells (the r = n_cells claim)
    lat = np.random.default_rng(0).uniform(0, 2 * np.pi, size=(384_000, 3))
    counts = np.bincount(SCHEME.cells(lat), minlength=SCHEME.n_cells)
    assert counts.size == SCHEME.n_cells == 384
    expected = len(lat) / SCHEME.n_cells
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < SCHEME.n_cells + 6 * np.sqrt(2 * SCHEME.n_cells)


def test_log_ratio_values():
    # r = p(y|c)/p(y) = 1 / P(cell c) = n_cells inside the cell (equal-mass cells, test above), 0 outside
    ideal = CaptionIdeal(SCHEME)
    q, d = np.array([5, 5]), np.array([5, 6])
    lr = ideal.log_ratio(q, d)
    assert lr[0, 0] == pytest.approx(np.log(384)) and np.isneginf(lr[0, 1])


def test_oracle_gap_below_1e4_and_equals_dense():
    db = sample_latents(512, 0, "test")
    caps, cells = caption_queries(SCHEME, sample_latents(300, 1, "test"))
    db_cells = SCHEME.cells(db)
    zt = oracle_text_embedding(SCHEME, cells)
    zi = oracle_image_embedding(SCHEME, db)
    tau = 0.01
    gap, kept = text_gap(zt, zi, cells, db_cells, tau)
    assert 0 < kept.sum() < len(cells)  # some held-out cells are empty in a 512-image database
    assert float(gap.kl.mean()) < 1e-4
    dense = softmax_gap_dense(zt[kept], zi, cells[kept], db_cells, CaptionIdeal(SCHEME), tau)
    np.testing.assert_allclose(gap.kl, dense.kl, atol=1e-6)  # the streamed pass multiplies in float32
    # independent: q uniform on the cell, p softmax of s / tau, KL by hand
    s = zt[kept] @ zi.T / tau
    logp = s - np.log(np.exp(s - s.max(1, keepdims=True)).sum(1, keepdims=True)) - s.max(1, keepdims=True)
    same = cells[kept, None] == db_cells[None, :]
    n = same.sum(1)
    kl = -np.log(n) - (np.where(same, logp, 0).sum(1) / n)
    np.testing.assert_allclose(dense.kl, kl, atol=1e-9)
    # a worse temperature gives a clearly positive gap
    assert float(text_gap(zt, zi, cells, db_cells, 0.2)[0].kl.mean()) > 0.1


def test_recall_counts_own_image_and_cell():
    db = sample_latents(200, 2, "test")
    caps, cells = caption_queries(SCHEME, db)
    zt = oracle_text_embedding(SCHEME, cells)
    zi = oracle_image_embedding(SCHEME, db)
    r = text_recall(zt, zi, np.arange(len(db)), cells, SCHEME.cells(db), ks=(1, 10))
    assert r["hit@1"] == 1.0 and r["recall@10"] == 1.0
    # shuffled text embeddings: the own image is found about as often as chance
    r0 = text_recall(zt[::-1], zi, np.arange(len(db)), cells, SCHEME.cells(db), ks=(10,))
    assert r0["recall@10"] < 0.3


def test_read_captions_jsonl_and_sidecars(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "cat.png").write_bytes(b"")
    (tmp_path / "a" / "cat.txt").write_text("A small cat.\nfr.utf8=Un petit chat.\n", encoding="utf-8")
    (tmp_path / "dog.png").write_bytes(b"")
    (tmp_path / "dog.txt").write_text("de.utf8=Ein Hund\n\nA dog.\n", encoding="utf-8")
    (tmp_path / "fox.png").write_bytes(b"")
    assert read_captions(tmp_path, ["a/cat.png", "dog.png", "fox.png"]) == ["A small cat.", "A dog.", None]
    (tmp_path / "captions.jsonl").write_text(json.dumps({"file": "dog.png", "text": " a brown dog "}) + "\n")
    assert read_captions(tmp_path, ["dog.png"]) == ["a brown dog"]
    (tmp_path / "captions.jsonl").write_text("{bad\n")
    with pytest.raises(ValueError, match="line 1"):
        read_captions(tmp_path, ["dog.png"])


def test_tuxpaint_stamp_sidecar_format():
    from pathlib import Path

    root = Path("/usr/share/tuxpaint/stamps")
    txt = sorted(root.rglob("*.txt"))[:1] if root.is_dir() else []
    if not txt:
        pytest.skip("no Tux Paint stamps on this machine")
    png = txt[0].with_suffix(".png")
    caption = read_captions(root, [png.relative_to(root).as_posix()])[0]
    assert caption and ".utf8=" not in caption
