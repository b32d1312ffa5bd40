"""Round five's pixel-stage pieces against independent computations: every overlay the edits make lies in
the cells the robust score may drop; a look-alike that differs in the middle is not explained away as an
overlay, one that differs in a corner is; positives made of two edits of one picture look less alike than a
picture and its edit."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw

from search.duplicates.align import overlay_cells, pair_features
from search.duplicates.config import DedupConfig
from search.duplicates.descriptors import chroma, search_descriptor, thumbnail
from search.duplicates.edits import add_overlay
from search.duplicates.scan import synthetic_features


def test_overlay_reach_every_changed_pixel_lies_in_the_droppable_cells():
    """1000 overlays on flat pictures of random sizes and aspects: each changed pixel, mapped onto the square
    thumbnail's cell grid (8 x 8 as scored, 16 x 16 as the chroma is), falls in a droppable cell."""
    rng = np.random.default_rng(0)
    grids = {n: overlay_cells(n).numpy() for n in (8, 16)}
    for _ in range(1000):
        w, h = (int(v) for v in rng.integers(24, 400, 2))
        out = np.asarray(add_overlay(Image.new("RGB", (w, h), (128, 128, 128)), rng), np.int16)
        ys, xs = np.nonzero(np.abs(out - 128).sum(axis=2) > 0)
        assert ys.size
        for n, grid in grids.items():
            assert grid[ys * n // h, xs * n // w].all(), (w, h, n)


def test_overlay_cells_spare_the_middle_of_the_picture():
    grid = overlay_cells(8).numpy()
    assert grid[0].all() and grid[-1].all()  # captions along the top and bottom
    assert not grid[3:5].any()  # the middle rows: no overlay of the edits reaches them
    assert 0.5 < grid.mean() < 0.8


def _picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    im = Image.new("RGB", (128, 128), (200, 200, 190))
    d = ImageDraw.Draw(im)
    for _ in range(14):
        x0, y0 = (int(v) for v in rng.integers(0, 110, 2))
        box = (x0, y0, x0 + int(rng.integers(10, 40)), y0 + int(rng.integers(10, 40)))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)(box, fill=fill)
    return im


def _thumbs(images):
    items = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        items.append(thumbnail(buf.getvalue(), 64))
    return np.stack([g for g, _ in items]), np.stack([chroma(c) for _, c in items])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_change_in_the_middle_is_not_trimmed_a_change_in_a_corner_is(seed):
    """The same 18 x 18 px patch (2 % of the picture) painted over a picture in a corner and in the middle:
    the robust correlation drops the corner (an overlay's place) and keeps the middle (a look-alike's other
    emblem), against the plain correlation of the same pair."""
    im = _picture(seed)
    corner, middle = im.copy(), im.copy()
    ImageDraw.Draw(corner).rectangle((4, 4, 22, 22), fill=(20, 20, 240))
    ImageDraw.Draw(middle).rectangle((55, 55, 73, 73), fill=(20, 20, 240))
    grey, col = _thumbs([im, corner, middle])
    f = pair_features(grey, np.array([0, 0]), np.array([1, 2]), colours=col)
    assert f[0, 1] > 0.995  # the corner patch is dropped: the rest is the same picture
    assert f[1, 1] < f[0, 1] - 0.01  # the middle one stays in
    assert f[1, 4] > f[0, 4]  # and its colour is not explained either


def test_two_edits_of_one_picture_are_positives_that_look_less_alike():
    """copy_pairs 1: every positive is two independent edits of a picture; 0: a picture and its edit. The
    first are on average less alike (lower robust correlation), each pair still far above a random pair."""
    images = [_picture(s) for s in range(40)]
    grey, col = _thumbs(images)
    data = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        data.append(buf.getvalue())
    desc = search_descriptor(grey, col, 12, 1.0)
    rows = np.arange(len(images))
    robust = {}
    for share in (0.0, 1.0):
        config = DedupConfig(copy_pairs=share)
        f, cos = synthetic_features(
            lambda r: data[r], rows, grey, col, desc, config, np.random.default_rng(0), False
        )
        assert f.shape == (len(rows), 5) and cos.shape == (len(rows),)
        robust[share] = f[:, 1]
    other = pair_features(grey, rows, np.roll(rows, 1), colours=col)[:, 1]
    assert robust[1.0].mean() < robust[0.0].mean()
    assert np.median(robust[1.0]) > np.percentile(other, 90)
    with pytest.raises(ValueError, match="copy_pairs"):
        DedupConfig(copy_pairs=1.5)
