"""The trained copy detector's parts against independent computations: the none-option softmax, its
maximum-likelihood fit on data drawn from known parameters, the prior shift against Bayes' rule, the EM
share against a known share, the pair readout against a loop, KoLeo against a double loop, the overlay edit
of the augmentation against its mask; and a short scan with verifier "encoder" on generated pictures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from search.duplicates.config import DedupConfig
from search.duplicates.copy_encoder import (
    CopyModel,
    em_prior,
    fit_none_softmax,
    neighbours,
    none_softmax,
    shift_prior,
)
from search.duplicates.model import NAMES
from training.augment import AugmentConfig, apply_params, overlay_mask, sample_params
from training.regularizers import koleo


def test_none_softmax_matches_direct_computation():
    rng = np.random.default_rng(0)
    sims = rng.uniform(-1, 1, (5, 4))
    sims[2, 3] = -np.inf  # no fourth candidate in row 2
    scale, none = 12.0, 7.5
    p = none_softmax(sims, scale, none)
    for r in range(5):
        terms = [math.exp(scale * s) for s in sims[r] if np.isfinite(s)] + [math.exp(none)]
        den = sum(terms)
        for c in range(4):
            want = math.exp(scale * sims[r, c]) / den if np.isfinite(sims[r, c]) else 0.0
            assert p[r, c] == pytest.approx(want, rel=1e-12, abs=1e-300)
        assert p[r, 4] == pytest.approx(math.exp(none) / den, rel=1e-12)


def test_fit_recovers_the_parameters_that_drew_the_answers():
    """Rows (m, K) of cosines; answers drawn from the none-softmax at known (scale, none): rows answering a
    candidate are the fit's positives (that column), rows answering none its negatives."""
    rng = np.random.default_rng(1)
    scale, none = 20.0, 15.0
    sims = np.clip(rng.normal(0.7, 0.12, (20000, 4)), -1, 1)
    p = none_softmax(sims, scale, none)
    u = rng.random(len(p))
    answer = (u[:, None] > np.cumsum(p, axis=1)).sum(axis=1)
    pos = answer < 4
    s_hat, n_hat = fit_none_softmax(sims[pos], answer[pos], sims[~pos])
    assert s_hat == pytest.approx(scale, rel=0.08)
    assert n_hat == pytest.approx(none, rel=0.08)


def test_prior_shift_is_bayes_rule():
    """At the shifted none logit, P(candidate j) / P(none) equals the old ratio times the change of the
    prior odds."""
    sims = np.array([[0.9, 0.5, 0.2]])
    scale, none, p0, p1 = 15.0, 12.0, 0.5, 0.1
    old = none_softmax(sims, scale, none)[0]
    new = none_softmax(sims, scale, shift_prior(none, p0, p1))[0]
    factor = (p1 / (1 - p1)) / (p0 / (1 - p0))
    for j in range(3):
        assert new[j] / new[3] == pytest.approx(old[j] / old[3] * factor, rel=1e-10)


def test_em_recovers_a_known_share():
    """Queries of which 20 % have a copy (cosine ~0.95 in the first column) and 80 % none (every candidate
    ~0.6): the softmax fitted at a 50 % prior, EM on the mixture reads the share back."""
    rng = np.random.default_rng(2)
    m, k = 4000, 5
    have = rng.random(m) < 0.2
    sims = rng.normal(0.6, 0.05, (m, k))
    sims[have, 0] = rng.normal(0.95, 0.02, have.sum())
    # fit on a balanced labelled set drawn the same way (the held-apart copies' role)
    lab = rng.normal(0.6, 0.05, (2000, k))
    lab[:, 0] = rng.normal(0.95, 0.02, 2000)
    neg = rng.normal(0.6, 0.05, (2000, k))
    scale, none = fit_none_softmax(lab, np.zeros(2000, int), neg)
    assert em_prior(sims, scale, none, 0.5) == pytest.approx(have.mean(), abs=0.02)


def test_pair_readout_matches_a_loop():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(30, 8))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    ok = np.ones(30, bool)
    ok[7] = False
    rows, cos = neighbours(z.astype(np.float32), 4, ok)
    # the neighbour table against brute force
    for r in np.flatnonzero(ok):
        others = [j for j in np.flatnonzero(ok) if j != r]
        best = sorted(others, key=lambda j: -z[r] @ z[j])[:4]
        assert list(rows[r]) == best
    model = CopyModel(scale=10.0, none=6.0, prior=0.3, k=4, copy_top1=1.0, train_loss=0.0, seconds={})
    a, b = np.array([0, 3, 5]), np.array([rows[0, 0], 20, 9])
    got = model.pair_probability(z, a, b, rows, cos, "softmax")
    for x, y, g in zip(a, b, got):
        best = 0.0
        for q, c in ((x, y), (y, x)):
            cands = set(rows[q].tolist()) | {c}
            den = math.exp(6.0) + sum(math.exp(10.0 * float(z[q] @ z[j])) for j in cands)
            best = max(best, math.exp(10.0 * float(z[q] @ z[c])) / den)
        assert g == pytest.approx(best, rel=1e-5)
    pair = model.pair_probability(z, a, b, rows, cos, "pair")
    s = np.einsum("ij,ij->i", z[a], z[b])
    np.testing.assert_allclose(pair, 1 / (1 + np.exp(-(10.0 * s - 6.0))), rtol=1e-10)


def test_koleo_matches_a_double_loop():
    z = torch.randn(12, 5, dtype=torch.float64)
    z[3] = z[7] + 1e-3  # a near pair dominates both rows' terms
    want = -np.mean(
        [
            math.log(min(float(torch.linalg.norm(z[i] - z[j])) for j in range(12) if j != i) + 1e-8)
            for i in range(12)
        ]
    )
    assert float(koleo(z)) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError):
        koleo(torch.zeros(1, 3))


def test_overlay_changes_exactly_its_mask():
    """With overlay_p 1 and every other edit off, a view differs from its source only inside the mask,
    where it is the overlay's colour; bars cover 1.8-8.4 % of the picture, badges pi r^2 of it."""
    rng = np.random.default_rng(4)
    cfg = AugmentConfig(
        crop_scale=(1.0, 1.0),
        crop_ratio=(1.0, 1.0),
        flip_p=0,
        translate=0,
        brightness=0,
        contrast=0,
        overlay_p=1.0,
    )
    x = torch.rand(64, 3, 40, 40) * 2 - 1
    params = sample_params(64, rng, cfg)
    y = apply_params(x, params)
    tp = {k: torch.as_tensor(v, dtype=x.dtype) for k, v in params.items()}
    m = overlay_mask(tp, 40)
    colour = torch.stack([tp[f"overlay_c{c}"] for c in range(3)], 1) * 2 - 1  # normalised scale
    inside = m.bool().unsqueeze(1).expand_as(x)
    torch.testing.assert_close(y[~inside], x.clamp(-1, 1)[~inside], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        y, torch.where(inside, colour.view(64, 3, 1, 1).expand_as(x), y), atol=1e-6, rtol=0
    )
    area = m.mean(dim=(1, 2)).numpy()
    bar = params["overlay_bar"] > 0
    expected_bar = params["overlay_w"] * params["overlay_h"]
    np.testing.assert_allclose(area[bar], expected_bar[bar], atol=0.03)
    np.testing.assert_allclose(area[~bar], np.pi * params["overlay_r"][~bar] ** 2, atol=0.01)
    assert area.max() < 0.09


def test_config_rejects_unknown_verifier():
    with pytest.raises(ValueError, match="verifier"):
        DedupConfig(verifier="hashes")
    with pytest.raises(ValueError, match="copy_readout"):
        DedupConfig(copy_readout="max")
    assert DedupConfig.from_json(DedupConfig(verifier="both").to_json()).verifier == "both"


def test_scan_with_the_copy_encoder_finds_planted_copies():
    """Generated pictures with planted copies, a short training: the encoder alone keeps only true pairs,
    its candidates are each item's nearest by the tower, and "both" fits one model on seven features
    (the pixel features and the encoder's cosine) that finds most copies."""
    import importlib.util
    from dataclasses import replace
    from pathlib import Path

    from search.duplicates.job import result_of
    from search.duplicates.scan import notes, scan_collection

    spec = importlib.util.spec_from_file_location(
        "_dedup_scan_tests", Path(__file__).with_name("test_scan.py")
    )
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)  # the scan tests' generated pictures and planting
    _generated, _plant = helpers._generated, helpers._plant

    torch.set_num_threads(1)
    sources, pairs, _ = _plant(_generated(60, 0), 0.3, 1)
    truth = {frozenset(p) for p in pairs}
    found = {}
    for verifier in ("encoder", "both"):
        cfg = replace(DedupConfig(), verifier=verifier, copy_steps=30, calibration_items=40)
        scan = scan_collection(lambda r: sources[r], len(sources), cfg, progress=False)
        assert np.all(scan.a < scan.b) and np.all((scan.p >= 0) & (scan.p <= 1))
        assert scan.copy is not None and 0 < scan.copy.prior < 1
        found[verifier] = {frozenset((int(a), int(b))) for a, b, q in zip(scan.a, scan.b, scan.p) if q >= 0.5}
        assert isinstance(notes(scan, 0.5, "default"), list)
        record = json.loads(json.dumps(result_of(scan, [f"i{r}" for r in range(len(sources))], cfg)))
        assert record["copy_model"]["copy_recall"] == pytest.approx(scan.copy.copy_recall)
        assert (record["model"] is None) == (verifier == "encoder")
        if verifier == "both":
            width = len(NAMES) + 1  # the pixel stage's features, then the copy encoder's cosine
            assert len(scan.model.knots) == width and scan.x.shape[1] == width
            assert len(found[verifier] & truth) >= 0.7 * len(truth)
    assert found["encoder"] and found["encoder"] <= truth


def test_trainer_step_adds_koleo_on_each_view():
    """contrastive_step with koleo_weight w == InfoNCE + w * mean of KoLeo over view a's and view b's rows,
    computed here from the encoder's own outputs."""
    from training.distributed import DistInfo
    from training.encoder import EncoderConfig, create_encoder
    from training.losses import create_loss
    from training.trainer import contrastive_step

    torch.manual_seed(0)
    enc = create_encoder(EncoderConfig(width=16, layers=1, heads=2, patch_size=8, mlp_ratio=1.0, embed_dim=8))
    a, b = torch.randn(6, 3, 32, 32), torch.randn(6, 3, 32, 32)
    loss = create_loss("infonce")
    got = contrastive_step(enc, loss, a, b, 0.3, DistInfo(), koleo_weight=0.7)
    za, zb = enc(a), enc(b)
    want = loss(za, zb, 0.3).loss + 0.7 * 0.5 * (koleo(za) + koleo(zb))
    assert float(got.loss) == pytest.approx(float(want), abs=1e-5)
    assert got.stats["koleo"] == pytest.approx(float(0.5 * (koleo(za) + koleo(zb))), abs=1e-5)


def test_copy_recipe_is_the_scan_augmentation():
    """configs/copy.toml (softsearch train) and the scan's tower train on the same edits and weights; its
    KoLeo weight is off the lineage when 0 so older runs hash as before."""
    from pathlib import Path

    from search.duplicates.copy_encoder import copy_augment
    from training.config import load_train_config
    from training.generators import create_generator

    root = Path(__file__).resolve().parents[3]
    cfg = load_train_config(root / "configs" / "copy.toml")
    cfg.validate()
    gen = create_generator(cfg.generator, **cfg.generator_options)
    COPY_AUGMENT = copy_augment()
    assert gen.aug.crop_scale == COPY_AUGMENT.crop_scale
    np.testing.assert_allclose(gen.aug.crop_ratio, COPY_AUGMENT.crop_ratio, rtol=1e-4)
    for name in (
        "flip_p",
        "translate",
        "brightness",
        "contrast",
        "saturation",
        "blur_p",
        "rotate",
        "overlay_p",
    ):
        assert getattr(gen.aug, name) == getattr(COPY_AUGMENT, name), name
    d = DedupConfig()
    assert cfg.koleo == d.copy_koleo and cfg.schedule_options["tau"] == d.copy_temperature
    assert (cfg.encoder.width, cfg.encoder.layers, cfg.encoder.patch_size, cfg.encoder.image_size) == (
        d.copy_width,
        d.copy_layers,
        d.copy_patch,
        d.copy_side,
    )
    assert "koleo" in cfg.lineage_dict()
    from dataclasses import replace

    assert "koleo" not in replace(cfg, koleo=0.0).lineage_dict()
