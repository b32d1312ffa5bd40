"""The raw-pixel baseline and the paired comparison against independent numpy computations."""

import numpy as np
import pytest
import torch

from search.evaluation.baselines import (
    RAW_PIXELS,
    baseline_comparison,
    centred_unit,
    per_query_precision,
    raw_pixel_features,
    recipe_description,
    verdict,
)


def test_raw_pixel_features_are_grey_area_thumbnails():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 3, 64, 64)).astype(np.float32)
    got = raw_pixel_features(torch.from_numpy(x))
    grey = x.mean(axis=1)  # (3, 64, 64)
    ref = grey.reshape(3, 32, 2, 32, 2).mean(axis=(2, 4)).reshape(3, -1)  # 2x2 box average
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_raw_pixel_precision_matches_brute_force_numpy():
    rng = np.random.default_rng(1)
    n, q, d = 120, 30, 16
    labels = rng.integers(0, 4, n)
    centres = rng.normal(size=(4, d)) * 2
    db = centres[labels] + rng.normal(size=(n, d))
    qlab = rng.integers(0, 4, q)
    queries = centres[qlab] + rng.normal(size=(q, d))
    zdb, zq = centred_unit(db.astype(np.float32), queries.astype(np.float32))
    got = per_query_precision(zq, zdb, qlab, labels, k=10)
    mu = db.mean(0)
    a = (db - mu) / np.linalg.norm(db - mu, axis=1, keepdims=True)
    b = (queries - mu) / np.linalg.norm(queries - mu, axis=1, keepdims=True)
    top = np.argsort(-(b @ a.T), axis=1)[:, :10]
    ref = (labels[top] == qlab[:, None]).mean(1)
    np.testing.assert_allclose(got, ref)
    # excluding each query's own row (queries drawn from the database)
    own = rng.choice(n, q, replace=False)
    got_ex = per_query_precision(zdb[own], zdb, labels[own], labels, k=5, exclude=own)
    s = a[own] @ a.T
    s[np.arange(q), own] = -np.inf
    top = np.argsort(-s, axis=1)[:, :5]
    np.testing.assert_allclose(got_ex, (labels[top] == labels[own][:, None]).mean(1))


def test_paired_difference_and_verdict_follow_the_interval():
    rng = np.random.default_rng(2)
    base = rng.uniform(0.2, 0.5, 200)
    better = np.clip(base + 0.15 + rng.normal(0, 0.02, 200), 0, 1)
    out = baseline_comparison({RAW_PIXELS: (base, base)}, (better, better), n_boot=500)
    d = out["rows"][0]["difference@10"]
    assert d["mean"] == pytest.approx(float(np.mean(better - base)))
    assert 0 < d["low"] < d["mean"] < d["high"]
    assert out["verdict"].startswith("training improved precision@10 over raw pixels")
    worse = baseline_comparison({RAW_PIXELS: (better, better)}, (base, base), n_boot=500)
    assert "it is worse by -0.1" in worse["verdict"]
    same = verdict("precision@10", RAW_PIXELS, {"mean": 0.01, "low": -0.02, "high": 0.04})
    assert "did not clearly improve" in same and "includes 0" in same


def test_verdict_names_the_recipe():
    info = {
        "lineage": {
            "generator": {"name": "neighbour", "options": {"k": 5, "space": "encoder", "refresh_every": 50}}
        },
        "train_config": {"steps": 400, "encoder": {"image_size": 32}},
    }
    recipe = recipe_description(info)
    assert (
        recipe
        == "encoder neighbours as positives (neighbour, k 5, refreshed every 50 steps), 32 px, 400 steps"
    )
    pixels = {"lineage": {"generator": {"name": "neighbour", "options": {"k": 3}}}, "train_config": {}}
    assert recipe_description(pixels) == "grey-pixel neighbours as positives (neighbour, k 3)"
    assert recipe_description({"lineage": {"generator": {"name": "label"}}}).startswith("class folders")
    assert recipe_description({}) is None  # an imported model records no recipe
    anchored = {**info, "train_config": {"steps": 400, "encoder": {"image_size": 32, "pixel_weight": 0.5}}}
    assert recipe_description(anchored) == (
        recipe
        + ", pixel anchor 0.5 (the embedding carries 32x32 grey pixels at weight 0.5 beside the tower's 0.5)"
    )
    enc = {"image_size": 32, "pixel_weight": 0.4, "colour_weight": 0.2}
    coloured = {**info, "train_config": {"steps": 400, "encoder": enc, "loss_sees_anchor": True}}
    assert recipe_description(coloured) == (
        recipe + ", pixel anchor 0.4 + colour 0.2 (the embedding carries 32x32 grey pixels at weight 0.4 and "
        "a colour histogram of 4x4x4 bins at weight 0.2 beside the tower's 0.4), "
        "the loss saw the anchored embedding"
    )
    enc = {
        "image_size": 32,
        "pixel_weight": 0.25,
        "colour_weight": 0.25,
        "gradient_weight": 0.25,
        "colour_bins": 8,
    }
    edged = {**info, "train_config": {"steps": 400, "encoder": enc}}
    assert recipe_description(edged) == (
        recipe
        + ", pixel anchor 0.25 + colour 0.25 + gradient 0.25 (the embedding carries 32x32 grey pixels at "
        "weight 0.25, a colour histogram of 8x8x8 bins at weight 0.25 and gradient-orientation histograms "
        "(16 directions, 4x4 cells) at weight 0.25 beside the tower's 0.25)"
    )
    rng = np.random.default_rng(4)
    base = rng.uniform(0.2, 0.5, 100)
    out = baseline_comparison({RAW_PIXELS: (base, base)}, (base + 0.1, base + 0.1), n_boot=200, recipe=recipe)
    assert out["verdict"].startswith("training improved") and out["verdict"].endswith("; recipe: " + recipe)
    assert out["recipe"] == recipe
    assert "recipe" not in baseline_comparison({RAW_PIXELS: (base, base)}, (base, base), n_boot=50)
