"""Positive generators and augmentations, checked against brute-force and closed-form references."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from scipy.special import i0, i1, logsumexp

from training.augment import AugmentConfig, apply_params, random_augment, sample_params
from training.datasets import create_dataset
from training.generators import (
    GENERATORS,
    InstanceGenerator,
    LabelGenerator,
    LatentGenerator,
    PositiveGenerator,
    create_generator,
    log_i0,
)
from training.synthetic import M, oracle_embedding, render, sample_latents
from training.transforms import preprocess


def _softmax_rows(logits):
    return np.exp(logits - logsumexp(logits, axis=1, keepdims=True))


class _LabelledArrayDataset:
    """Minimal labelled dataset (duck-typed like ImageDataset) built from random uint8 images."""

    name = "toy"
    latents = None

    def __init__(self, labels, seed=0):
        self.labels = np.asarray(labels, dtype=np.int64)
        self.images = np.random.default_rng(seed).integers(
            0, 256, size=(len(labels), 12, 12, 3), dtype=np.uint8
        )
        self.image_size = 12

    def __len__(self):
        return len(self.labels)

    def tensors(self, idx):
        return preprocess(self.images[np.asarray(idx)], self.image_size)


# --- registry -----------------------------------------------------------------------------


def _dataset_for(name, tiny_synthetic):
    return tiny_synthetic if name == "latent" else _LabelledArrayDataset(np.arange(20) % 4)


def _meta_for(name, ds):
    return ds.latents if name == "latent" else (ds.labels if name == "label" else np.arange(len(ds)))


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_registered_generator(name, tiny_synthetic, rng):
    gen = create_generator(name)
    assert isinstance(gen, PositiveGenerator) and gen.name == name
    assert gen.description and name in gen.description
    assert gen.exact == (name not in ("instance", "neighbour"))
    ds = _dataset_for(name, tiny_synthetic)
    meta = _meta_for(name, ds)
    lr = gen.log_ratio(meta[:5], meta)
    assert lr.shape == (5, len(ds)) and lr.dtype == np.float64
    # the source item always has positive ratio (r(x, x) > 0)
    assert np.all(np.isfinite(lr[np.arange(5), np.arange(5)]))
    a, b = gen.sample_pairs(ds, np.arange(6), rng)
    assert a.shape == b.shape == (6, 3, ds.image_size, ds.image_size)
    assert a.dtype == b.dtype == torch.float32
    assert a.min() >= -1 and a.max() <= 1 and b.min() >= -1 and b.max() <= 1
    assert not torch.equal(a, b)
    # options() round-trips through create_generator
    assert repr(create_generator(name, **gen.options())) == repr(gen)


def test_create_generator_errors():
    with pytest.raises(ValueError, match="nope"):
        create_generator("nope")
    with pytest.raises(ValueError, match="bad options"):
        create_generator("latent", kapa=3)
    with pytest.raises(ValueError, match="kappa"):
        create_generator("latent", kappa=-1.0)


# --- latent -------------------------------------------------------------------------------


def test_log_i0_matches_scipy():
    for k in (0.1, 1.0, 8.0, 50.0):
        assert log_i0(k) == pytest.approx(math.log(i0(k)), rel=1e-12)
    assert np.isfinite(log_i0(2000.0))  # i0 itself overflows here


@pytest.mark.parametrize("kappa", [0.5, 8.0])
def test_latent_log_ratio_and_q_match_brute_force(kappa):
    gen = LatentGenerator(kappa=kappa)
    q_lat, d_lat = sample_latents(4, seed=1, split="test"), sample_latents(30, seed=1)
    lr = gen.log_ratio(q_lat, d_lat)
    brute = np.empty((4, 30))
    for a in range(4):
        for b in range(30):
            # log of prod_i exp(kappa cos(dtheta_i)) / I0(kappa): von Mises density over uniform 1/(2pi)
            brute[a, b] = sum(
                math.log(math.exp(kappa * math.cos(d_lat[b, i] - q_lat[a, i])) / i0(kappa)) for i in range(M)
            )
    np.testing.assert_allclose(lr, brute, rtol=1e-10, atol=1e-10)
    q = _softmax_rows(lr)
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-12)
    r = np.exp(brute)
    np.testing.assert_allclose(q, r / r.sum(axis=1, keepdims=True), rtol=1e-9)


def test_latent_ratio_integrates_to_one():
    """E_{y ~ uniform}[r(x, y)] = 1: Monte Carlo over the uniform torus marginal."""
    gen = LatentGenerator(kappa=2.0)
    y = np.random.default_rng(0).uniform(0, 2 * np.pi, size=(200_000, M))
    r = np.exp(gen.log_ratio(np.zeros((1, M)), y))[0]
    assert r.mean() == pytest.approx(1.0, abs=4 * r.std() / math.sqrt(r.size))


def test_latent_perturbation_is_von_mises(rng):
    kappa = 8.0
    gen = LatentGenerator(kappa=kappa)
    lat = sample_latents(4000, seed=2)
    moved = gen.perturb(lat, rng)
    assert moved.min() >= 0 and moved.max() < 2 * np.pi
    d = np.angle(np.exp(1j * (moved - lat))).ravel()  # wrapped to (-pi, pi]
    mean_cos = np.cos(d).mean()
    expected = i1(kappa) / i0(kappa)  # E cos(X), X ~ vM(0, kappa)
    stderr = np.cos(d).std() / math.sqrt(d.size)
    assert abs(mean_cos - expected) < 4 * stderr
    assert abs(np.sin(d).mean()) < 4 * np.sin(d).std() / math.sqrt(d.size)
    assert stats.kstest(d, stats.vonmises(kappa).cdf).pvalue > 1e-3
    # each angle independently: the per-axis correlation of the noise is ~0
    dd = np.angle(np.exp(1j * (moved - lat)))
    c = np.corrcoef(dd.T)
    assert np.abs(c[np.triu_indices(M, 1)]).max() < 0.06


def test_latent_sample_pairs_renders_perturbed_latents(tiny_synthetic):
    gen = LatentGenerator(kappa=4.0)
    idx = np.array([3, 0, 17, 17])
    a, b = gen.sample_pairs(tiny_synthetic, idx, np.random.default_rng(5))
    expected_lat = gen.perturb(tiny_synthetic.latents[idx], np.random.default_rng(5))
    torch.testing.assert_close(a, preprocess(render(tiny_synthetic.latents[idx]), 32), rtol=0, atol=0)
    torch.testing.assert_close(b, preprocess(render(expected_lat), 32), rtol=0, atol=0)
    assert not torch.equal(b[2], b[3])  # the same anchor gets fresh noise


def test_latent_needs_latents(rng):
    with pytest.raises(ValueError, match="latents"):
        LatentGenerator().sample_pairs(_LabelledArrayDataset([0, 1]), np.arange(2), rng)
    with pytest.raises(ValueError, match="metadata"):
        LatentGenerator().log_ratio(np.zeros((2, 3)), np.zeros((4, 2)))


@pytest.mark.parametrize("kappa", [2.0, 8.0])
def test_oracle_embedding_is_the_ideal_search(kappa):
    """At tau = 1/(m kappa), s/tau = log r + const per row, so p(j|x) = q(j|x): gap 0."""
    gen = LatentGenerator(kappa=kappa)
    q_lat, d_lat = sample_latents(8, seed=3, split="test"), sample_latents(50, seed=3)
    s = oracle_embedding(q_lat) @ oracle_embedding(d_lat).T
    tau = 1.0 / (M * kappa)
    diff = s / tau - gen.log_ratio(q_lat, d_lat)
    np.testing.assert_allclose(diff, diff[:, :1].repeat(50, axis=1), atol=1e-9)
    np.testing.assert_allclose(diff[:, 0], M * log_i0(kappa), rtol=1e-12)
    p, q = _softmax_rows(s / tau), _softmax_rows(gen.log_ratio(q_lat, d_lat))
    np.testing.assert_allclose(p, q, atol=1e-12)
    kl = (q * (np.log(q) - np.log(p))).sum(axis=1)
    assert np.abs(kl).max() < 1e-10
    # a different temperature gives a strictly positive gap
    p2 = _softmax_rows(s / (2 * tau))
    assert (q * (np.log(q) - np.log(p2))).sum(axis=1).min() > 1e-3


# --- label --------------------------------------------------------------------------------


def test_label_log_ratio_brute_force():
    gen = LabelGenerator()
    db = np.array([0, 0, 1, 2, 2, 2, 0, 1, 2, 2])
    queries = np.array([2, 0, 1, 5])
    lr = gen.log_ratio(queries, db)
    n = len(db)
    for a, c in enumerate(queries):
        pi_c = np.mean(db == c)
        for b in range(n):
            if db[b] == c:
                assert lr[a, b] == pytest.approx(math.log(1.0 / pi_c))
            else:
                assert lr[a, b] == -np.inf
    q = _softmax_rows(lr[:3])
    for a, c in enumerate(queries[:3]):
        same = db == c
        np.testing.assert_allclose(q[a, same], 1.0 / same.sum())  # uniform over same-class items
        assert np.all(q[a, ~same] == 0)
    # sum over the database of r / N = 1 (r is a density ratio under the empirical marginal)
    assert np.exp(lr[:3]).sum(axis=1) / n == pytest.approx(np.ones(3))


def test_label_positive_indices_uniform_other_same_class():
    labels = np.array([0, 1, 0, 2, 0, 1, 0, 3])  # classes 2 and 3 are singletons
    gen = LabelGenerator()
    r = np.random.default_rng(0)
    anchors = np.repeat(np.arange(len(labels)), 3000)
    pos = gen.positive_indices(labels, anchors, r)
    assert np.all(labels[pos] == labels[anchors])
    alone = np.isin(anchors, [3, 7])
    assert np.all(pos[alone] == anchors[alone])  # alone in its class -> itself
    assert np.all(pos[~alone] != anchors[~alone])
    for a in (0, 1, 2):
        others = np.flatnonzero((labels == labels[a]) & (np.arange(len(labels)) != a))
        counts = np.array([(pos[anchors == a] == o).sum() for o in others])
        if len(others) > 1:
            assert stats.chisquare(counts).pvalue > 1e-3, counts
        assert counts.sum() == 3000


def test_label_sample_pairs(rng):
    ds = _LabelledArrayDataset(np.array([0, 1, 0, 1, 2, 2]))
    gen = LabelGenerator(augment=False)
    a, b = gen.sample_pairs(ds, np.array([0, 1, 4]), np.random.default_rng(9))
    torch.testing.assert_close(a, ds.tensors([0, 1, 4]))
    torch.testing.assert_close(b, ds.tensors([2, 3, 5]))  # the only other item of each class
    with pytest.raises(ValueError, match="labelled"):
        gen.sample_pairs(create_dataset("synthetic", size=4), np.arange(2), rng)


# --- instance -----------------------------------------------------------------------------


def test_instance_log_ratio_and_views(rng):
    gen = InstanceGenerator()
    assert not gen.exact and "approximation" in gen.description
    lr = gen.log_ratio(np.array([2, 0]), np.arange(4))
    expected = np.full((2, 4), -np.inf)
    expected[0, 2] = expected[1, 0] = 0.0
    np.testing.assert_array_equal(lr, expected)
    ds = _LabelledArrayDataset(np.zeros(5))
    a1, b1 = gen.sample_pairs(ds, np.arange(5), np.random.default_rng(3))
    a2, b2 = gen.sample_pairs(ds, np.arange(5), np.random.default_rng(3))
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(b1, b2)
    assert not torch.allclose(a1, b1)


# --- augmentations ------------------------------------------------------------------------


def _params(n, **kw):
    base = {"w": 1.0, "h": 1.0, "cx": 0.0, "cy": 0.0, "flip": 0.0, "brightness": 1.0, "contrast": 1.0}
    base.update(kw)
    return {k: np.full(n, v, dtype=np.float64) for k, v in base.items()}


def _batch(n=3, s=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, s, s, generator=g) * 2 - 1


def test_augment_identity_and_flip():
    x = _batch()
    torch.testing.assert_close(apply_params(x, _params(3)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        apply_params(x, _params(3, flip=1.0)), torch.flip(x, dims=[-1]), atol=1e-5, rtol=0
    )


def test_augment_centre_crop_matches_interpolate():
    """A centred half-size crop equals bilinear upsampling (x2) of the central 8x8 block."""
    x = _batch(s=16)
    y = apply_params(x, _params(3, w=0.5, h=0.5))
    ref = F.interpolate(x[:, :, 4:12, 4:12], size=(16, 16), mode="bilinear", align_corners=False)
    # the outermost output pixels sample just outside the block; compare the interior
    torch.testing.assert_close(y[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1], atol=1e-5, rtol=0)


def test_augment_from_a_larger_source():
    """out_size < source side: crop on the source grid, then shrink to out_size as preprocess does."""
    x = _batch(s=32)
    down = F.avg_pool2d(x, 2)  # an exact 2x reduction: 2 x 2 block means (as preprocess)
    torch.testing.assert_close(apply_params(x, _params(3), out_size=16), down, atol=1e-5, rtol=0)
    # a centred half crop: the central 16x16 block, bilinear x2 onto the source grid, then 2 x 2 means
    y = apply_params(x, _params(3, w=0.5, h=0.5), out_size=16)
    up = F.interpolate(x[:, :, 8:24, 8:24], size=(32, 32), mode="bilinear", align_corners=False)
    ref = F.avg_pool2d(up, 2)
    torch.testing.assert_close(y[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1], atol=1e-5, rtol=0)
    # photometric jitter acts after the resize, on the output pixels
    p = (down + 1) / 2
    y = apply_params(x, _params(3, brightness=0.8), out_size=16)
    torch.testing.assert_close((y + 1) / 2, (0.8 * p).clamp(0, 1), atol=1e-5, rtol=0)
    assert random_augment(x, np.random.default_rng(0), out_size=16).shape == (3, 3, 16, 16)


def test_augment_translation_shifts_pixels():
    x = _batch(s=16)
    # centre shifted by 2 px to the right (grid units: 2 px * 2/16)
    y = apply_params(x, _params(3, cx=0.25))
    torch.testing.assert_close(y[..., :-2], x[..., 2:], atol=1e-5, rtol=0)


def test_augment_photometric():
    x = _batch()
    p = (x + 1) / 2  # [0, 1] pixels
    y = apply_params(x, _params(3, brightness=0.8))
    torch.testing.assert_close((y + 1) / 2, (0.8 * p).clamp(0, 1), atol=1e-5, rtol=0)
    y = apply_params(x, _params(3, contrast=0.5))
    m = p.mean(dim=(1, 2, 3), keepdim=True)
    torch.testing.assert_close((y + 1) / 2, (m + 0.5 * (p - m)).clamp(0, 1), atol=1e-5, rtol=0)


def test_augment_random_params_in_range():
    cfg = AugmentConfig(crop_scale=(0.4, 0.9), flip_p=0.3)
    p = sample_params(5000, np.random.default_rng(0), cfg)
    area = p["w"] * p["h"]
    assert area.min() >= 0.4 - 1e-9 and area.max() <= 0.9 + 1e-9
    assert abs(p["flip"].mean() - 0.3) < 0.03
    x = _batch(n=4)
    y1 = random_augment(x, np.random.default_rng(1), cfg)
    y2 = random_augment(x, np.random.default_rng(1), cfg)
    torch.testing.assert_close(y1, y2)
    assert y1.shape == x.shape and y1.min() >= -1 and y1.max() <= 1
    with pytest.raises(ValueError, match="crop_scale"):
        AugmentConfig(crop_scale=(0.0, 1.0))


def test_augment_colour_grey_blur_against_references():
    """Saturation, greyscale and blur checked against plain numpy formulas on the [0, 1] pixels."""
    x = _batch(n=2, s=8)
    p = ((x + 1) / 2).double().numpy()
    grey = p.mean(axis=1, keepdims=True)
    y = apply_params(x, _params(2, saturation=0.5))
    np.testing.assert_allclose(
        (y.double().numpy() + 1) / 2, np.clip(grey + 0.5 * (p - grey), 0, 1), atol=1e-5
    )
    y = apply_params(x, _params(2, grey=1.0)).double().numpy()
    np.testing.assert_allclose((y + 1) / 2, np.repeat(grey, 3, axis=1), atol=1e-5)  # every channel its grey
    # grey on one view only: the other keeps its colour
    y = apply_params(x, {**_params(2), "grey": np.array([1.0, 0.0])})
    torch.testing.assert_close(y[1], x[1], atol=1e-5, rtol=0)
    # blur: [1 2 1]/4 outer product, edge pixels repeated
    y = apply_params(x, _params(2, blur=1.0)).double().numpy()
    pad = np.pad(p, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="edge")
    k = np.array([0.25, 0.5, 0.25])
    ref = sum(k[i] * k[j] * pad[:, :, i : i + 8, j : j + 8] for i in range(3) for j in range(3))
    np.testing.assert_allclose((y + 1) / 2, ref, atol=1e-5)


def test_augment_rotation_quarter_turn():
    """A 90 degree rotation of the sampling grid is an exact quarter turn of the pixels."""
    x = _batch(s=16)
    y = apply_params(x, _params(3, angle=np.pi / 2))
    turned = [torch.rot90(x, k, dims=(-2, -1)) for k in (1, -1)]
    assert min(float((y - t).abs().max()) for t in turned) < 1e-5
    torch.testing.assert_close(apply_params(x, _params(3, angle=0.0)), x, atol=1e-5, rtol=0)


def test_augment_new_options_draw_only_when_on():
    """Configs without the new options give the same views as before; with them the ranges hold."""
    base = sample_params(5000, np.random.default_rng(3), AugmentConfig())
    assert set(base) == {"w", "h", "cx", "cy", "flip", "brightness", "contrast"}
    cfg = AugmentConfig(saturation=0.5, grey_p=0.2, blur_p=0.5, rotate=10.0)
    p = sample_params(5000, np.random.default_rng(3), cfg)
    for k in base:
        np.testing.assert_array_equal(p[k], base[k])
    assert 0.5 <= p["saturation"].min() and p["saturation"].max() <= 1.5
    assert abs(p["grey"].mean() - 0.2) < 0.03 and abs(p["blur"].mean() - 0.5) < 0.03
    assert np.abs(p["angle"]).max() <= np.radians(10.0)
    for bad in ({"grey_p": 1.5}, {"saturation": -0.1}, {"rotate": 200.0}):
        with pytest.raises(ValueError):
            AugmentConfig(**bad)


# --- neighbour ----------------------------------------------------------------------------


def test_pixel_neighbours_match_brute_force():
    from training.neighbours import grey_pixels, pixel_neighbours

    ds = _LabelledArrayDataset(np.arange(150) % 3, seed=5)
    table = pixel_neighbours(ds, k=4, block=32, progress=False)  # several blocks
    # independent reference: cosine of float64 grey levels straight from the uint8 images
    grey = ds_images_grey = np.stack(
        [preprocess(ds.images[i : i + 1], 12)[0].numpy() for i in range(len(ds))]
    )
    grey = (ds_images_grey * 0.5 + 0.5).mean(axis=1).reshape(len(ds), -1).astype(np.float64)
    grey /= np.linalg.norm(grey, axis=1, keepdims=True)
    sim = grey @ grey.T
    np.fill_diagonal(sim, -np.inf)
    expected = np.argsort(-sim, axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(table, expected)
    assert not np.any(table == np.arange(len(ds))[:, None])
    assert grey_pixels(ds).shape == (150, 144)
    with pytest.raises(ValueError, match="k must be in"):
        pixel_neighbours(ds, k=150, progress=False)


def test_neighbour_positives_are_augmented_neighbours(rng):
    ds = _LabelledArrayDataset(np.arange(40) % 2, seed=6)
    plain = dict(
        crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0.0, translate=0.0, brightness=0.0, contrast=0.0
    )
    gen = create_generator("neighbour", k=3, **plain)
    table = gen.neighbour_table(ds)
    assert gen.neighbour_table(ds) is table  # computed once per dataset
    anchors = np.repeat(np.arange(4), 150)
    a, b = gen.sample_pairs(ds, anchors, rng)
    every = ds.tensors(np.arange(len(ds))).flatten(1)  # (N, P)
    np.testing.assert_allclose(a.flatten(1), every[anchors], atol=1e-5)  # identity augmentation
    # each positive is exactly one dataset image, and that image is one of the anchor's 3 neighbours
    dist = torch.cdist(b.flatten(1), every, compute_mode="donot_use_mm_for_euclid_dist")
    source = dist.argmin(dim=1).numpy()
    assert float(dist.min(dim=1).values.max()) < 1e-3
    for i in range(4):
        picked = source[anchors == i]
        assert set(picked) == set(table[i].tolist())  # all 3 neighbours are drawn in 150 tries...
        counts = np.bincount(np.searchsorted(np.sort(table[i]), picked), minlength=3)
        assert stats.chisquare(counts).pvalue > 1e-3  # ...uniformly
    # options round trip; a pickled copy (DataLoader worker) recomputes its table on first use
    import pickle

    clone = pickle.loads(pickle.dumps(gen))
    assert clone.k == 3 and clone._table is None
    np.testing.assert_array_equal(clone.neighbour_table(ds), table)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        create_generator("neighbour", k=0)


class _CountingEncoder(torch.nn.Module):
    """A fixed random projection of the pixels (train/eval mode and call count recorded)."""

    def __init__(self, d_in, d_out=5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(d_in, d_out, generator=g))
        self.calls, self.modes = 0, []

    def forward(self, x):
        self.calls += 1
        self.modes.append(self.training)
        return x.flatten(1) @ self.w


def test_encoder_neighbours_match_brute_force_and_refresh_when_due():
    from training.neighbours import encoder_neighbours

    ds = _LabelledArrayDataset(np.arange(60) % 3, seed=7)
    every = ds.tensors(np.arange(len(ds)))
    enc = _CountingEncoder(every[0].numel())
    enc.train()
    table = encoder_neighbours(enc, ds, k=4, batch_size=16)  # several batches
    assert enc.training and enc.modes and not any(enc.modes)  # embedded in eval mode, mode restored
    # independent reference: float64 cosine of the projections, self excluded, argsort
    z = (every.flatten(1).double() @ enc.w.detach().double()).numpy()
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    sim = z @ z.T
    np.fill_diagonal(sim, -np.inf)
    np.testing.assert_array_equal(table, np.argsort(-sim, axis=1, kind="stable")[:, :4])

    # space "both": the mean of the embedding and grey-pixel cosines
    from training.neighbours import grey_pixels

    g = grey_pixels(ds).double().numpy()
    both = (sim + g @ g.T) / 2
    np.fill_diagonal(both, -np.inf)
    np.testing.assert_array_equal(
        encoder_neighbours(enc, ds, k=4, with_pixels=True), np.argsort(-both, axis=1, kind="stable")[:, :4]
    )
    gb = create_generator("neighbour", k=4, space="both")
    assert gb.refresh(enc, ds, 0)
    np.testing.assert_array_equal(gb.neighbour_table(ds), np.argsort(-both, axis=1, kind="stable")[:, :4])

    gen = create_generator("neighbour", k=4, space="encoder", refresh_every=10)
    with pytest.raises(RuntimeError, match="refresh"):
        gen.neighbour_table(ds)  # the encoder space needs the encoder
    assert gen.refresh(enc, ds, 0)  # first call computes
    np.testing.assert_array_equal(gen.neighbour_table(ds), table)
    assert not gen.refresh(enc, ds, 5) and gen.refresh(enc, ds, 10)  # then only every 10 steps
    once = create_generator("neighbour", k=4, space="encoder")  # refresh_every 0: the step-0 table only
    assert once.refresh(enc, ds, 0) and not once.refresh(enc, ds, 100)
    assert not create_generator("neighbour", k=4).refresh(enc, ds, 0)  # pixel space: nothing to refresh
    # options round trip; the pixel default's options read as before
    assert repr(create_generator("neighbour", **gen.options())) == repr(gen)
    assert "space" not in create_generator("neighbour").options()
    for bad in ({"space": "text"}, {"refresh_every": -1}):
        with pytest.raises(ValueError):
            create_generator("neighbour", **bad)
