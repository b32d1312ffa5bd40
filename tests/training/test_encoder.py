"""Encoder: shapes, unit norm, ViT / ModifiedResNet towers, input validation, embed()."""

import numpy as np
import pytest
import torch

from training.encoder import EncoderConfig, create_encoder, embed

TINY_VIT = EncoderConfig(width=16, layers=1, heads=2, patch_size=8, mlp_ratio=1.0, embed_dim=8)
TINY_RN = EncoderConfig(width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8, image_size=32)


@pytest.mark.parametrize("config", [TINY_VIT, TINY_RN], ids=["vit", "resnet"])
def test_shapes_and_unit_norm(config):
    torch.manual_seed(0)
    enc = create_encoder(config)
    x = torch.randn(3, 3, 32, 32)
    h = enc.features(x)
    z = enc(x)
    assert h.shape == (3, 8) and z.shape == (3, 8)
    assert torch.allclose(z.norm(dim=1), torch.ones(3), atol=1e-6)
    # forward is exactly the normalised features
    assert torch.allclose(z, h / h.norm(dim=1, keepdim=True), atol=1e-6)


def test_tower_types():
    from open_clip.modified_resnet import ModifiedResNet
    from open_clip.transformer import VisionTransformer

    assert isinstance(create_encoder(TINY_VIT).tower, VisionTransformer)
    assert isinstance(create_encoder(TINY_RN).tower, ModifiedResNet)


def test_default_is_small_vit():
    enc = create_encoder(None)
    assert enc.embed_dim == 64 and enc.image_size == 32
    assert 50_000 < enc.num_parameters() < 120_000


def test_config_from_dict_and_list_layers():
    enc = create_encoder({"width": 8, "layers": [1, 1, 1, 1], "heads": 2, "embed_dim": 4})
    assert enc.config.layers == (1, 1, 1, 1) and enc.config.is_resnet
    with pytest.raises(ValueError, match="bogus"):
        create_encoder({"bogus": 1})


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(layers=(1, 1, 1, 1), image_size=48), "image_size=48"),
        (dict(layers=(1, 1, 1), image_size=32), "4 positive ints"),
        (dict(patch_size=5), "patch_size=5"),
        (dict(width=10, heads=4), "heads=4"),
        (dict(pretrained="/nonexistent/w.pt"), "model_name"),
    ],
)
def test_invalid_configs(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        create_encoder(EncoderConfig(**kwargs))


def test_missing_pretrained_file():
    with pytest.raises(FileNotFoundError, match="nonexistent"):
        create_encoder(EncoderConfig(model_name="RN50", pretrained="/nonexistent/w.pt"))


def test_wrong_input_shape():
    enc = create_encoder(TINY_VIT)
    with pytest.raises(ValueError, match="16, 16"):
        enc(torch.randn(2, 3, 16, 16))


def test_embed_matches_forward_all_input_kinds():
    torch.manual_seed(1)
    enc = create_encoder(TINY_VIT)
    x = torch.randn(7, 3, 32, 32)
    with torch.no_grad():
        ref = enc.eval()(x).numpy()
    enc.train()
    out = embed(enc, x, batch_size=3, progress=False)
    assert out.dtype == np.float32 and out.shape == (7, 8)
    np.testing.assert_allclose(out, ref, atol=1e-6)
    assert enc.training  # mode restored
    np.testing.assert_allclose(embed(enc, x.numpy(), batch_size=4, progress=False), ref, atol=1e-6)
    loader = [(x[:4], None), (x[4:], None)]
    np.testing.assert_allclose(embed(enc, loader, progress=False), ref, atol=1e-6)
    ds = torch.utils.data.TensorDataset(x)
    np.testing.assert_allclose(embed(enc, ds, batch_size=5, progress=False), ref, atol=1e-6)
    assert embed(enc, x[:0], progress=False).shape == (0, 8)
    with pytest.raises(ValueError, match="batch_size"):
        embed(enc, x, batch_size=0)


def test_pixel_anchor_cosine_is_the_weighted_sum_of_tower_and_pixel_cosines(tmp_path):
    """pixel_weight w: the embedding's inner products equal (1 - w) x the tower's cosine + w x the
    report's centred grey-pixel cosine (computed independently by the evaluation baseline); the
    centre is saved with the weights."""
    from search.evaluation.baselines import centred_unit, raw_pixel_features
    from training.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    cfg = EncoderConfig(width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8, image_size=64, pixel_weight=0.3)
    enc = create_encoder(cfg).eval()
    assert enc.embed_dim == 8 + 32 * 32 and enc.tower_dim == 8
    x = torch.rand(12, 3, 64, 64) * 2 - 1
    enc.set_pixel_mean([x[:5], x[5:]])  # batches, as the trainer feeds them
    z = enc(x).detach().numpy()
    t = enc.tower_embed(x).detach().numpy()
    assert np.allclose(enc(x, anchored=False).detach().numpy(), t)
    p, _ = centred_unit(raw_pixel_features(x), raw_pixel_features(x))  # 64 px -> 32x32 area thumbnails
    np.testing.assert_allclose(z @ z.T, 0.7 * t @ t.T + 0.3 * p @ p.T, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)
    save_checkpoint(tmp_path / "a.safetensors", enc, step=0, train_config={}, lineage={}, metrics={})
    back, _ = load_checkpoint(tmp_path / "a.safetensors")
    np.testing.assert_allclose(back(x).detach().numpy(), z, atol=1e-6)
    assert np.array_equal(embed(back, x, progress=False), back(x).detach().numpy())
    with pytest.raises(ValueError, match="pixel_weight"):
        create_encoder(EncoderConfig(pixel_weight=1.0))
    with pytest.raises(ValueError, match="pixel_side"):
        create_encoder(EncoderConfig(pixel_weight=0.5, pixel_side=0))
    assert create_encoder(TINY_RN).embed_dim == 8 and "pixel_mean" not in create_encoder(TINY_RN).state_dict()


def test_colour_part_cosine_adds_the_centred_histogram_cosine(tmp_path):
    """colour_weight c beside pixel_weight w: inner products are (1 - w - c) tower + w grey pixels + c x
    the cosine of centred, square-rooted joint RGB histograms (counted here with numpy's histogramdd);
    the colour centre is saved with the weights."""
    from search.evaluation.baselines import centred_unit, raw_pixel_features
    from training.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(1)
    cfg = EncoderConfig(
        width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8, image_size=32, pixel_weight=0.3, colour_weight=0.2
    )
    enc = create_encoder(cfg).eval()
    assert enc.embed_dim == 8 + 32 * 32 + 4**3
    x = torch.rand(10, 3, 32, 32) * 2 - 1
    x[0] = 1.0  # a white image: every pixel in the top bin (p = 1 must not overflow)
    enc.set_pixel_mean([x[:4], x[4:]])
    z = enc(x).detach().numpy()
    t = enc.tower_embed(x).detach().numpy()
    p, _ = centred_unit(raw_pixel_features(x), raw_pixel_features(x))
    rgb = ((x.numpy() + 1) / 2).transpose(0, 2, 3, 1).reshape(10, -1, 3)  # (B, S^2, 3) in [0, 1]
    h = np.stack([np.histogramdd(v, bins=4, range=[(0, 1)] * 3)[0].ravel() for v in rgb]) / (32 * 32)
    q, _ = centred_unit(np.sqrt(h), np.sqrt(h))
    np.testing.assert_allclose(z @ z.T, 0.5 * t @ t.T + 0.3 * p @ p.T + 0.2 * q @ q.T, atol=2e-5)
    save_checkpoint(tmp_path / "c.safetensors", enc, step=0, train_config={}, lineage={}, metrics={})
    back, _ = load_checkpoint(tmp_path / "c.safetensors")
    np.testing.assert_allclose(back(x).detach().numpy(), z, atol=1e-6)
    colour_only = create_encoder(
        EncoderConfig(width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8, colour_weight=0.3)
    )
    assert colour_only.embed_dim == 8 + 64 and "pixel_mean" not in colour_only.state_dict()
    for bad in (dict(pixel_weight=0.6, colour_weight=0.4), dict(colour_weight=-0.1), dict(colour_bins=1)):
        with pytest.raises(ValueError, match="colour"):
            create_encoder(EncoderConfig(**bad))


def _numpy_hog(x: np.ndarray, grid: int, bins: int) -> np.ndarray:
    """Independent reference: 32x32 grey (channel mean, 2x2 area), edge-replicated central differences,
    each pixel's magnitude in the nearest of `bins` signed directions by its angle (arctan2), summed per
    cell, L2-normalised, square-rooted."""
    g = x.mean(axis=1).reshape(len(x), 32, 2, 32, 2).mean(axis=(2, 4))
    gp = np.pad(g, ((0, 0), (1, 1), (1, 1)), mode="edge")
    gx, gy = gp[:, 1:-1, 2:] - gp[:, 1:-1, :-2], gp[:, 2:, 1:-1] - gp[:, :-2, 1:-1]
    k = np.round(np.mod(np.arctan2(gy, gx), 2 * np.pi) / (2 * np.pi / bins)).astype(int) % bins
    mag, cell = np.hypot(gx, gy), 32 // grid
    h = np.zeros((len(x), bins, grid, grid))
    for i in range(len(x)):
        for yy in range(32):
            for xx in range(32):
                h[i, k[i, yy, xx], yy // cell, xx // cell] += mag[i, yy, xx]
    h = h.reshape(len(x), -1)
    return np.sqrt(h / np.linalg.norm(h, axis=1, keepdims=True))


def test_gradient_part_adds_the_centred_orientation_histogram_cosine(tmp_path):
    """gradient_weight e: inner products are (1 - w - c - e) tower + w grey + c colour + e x the cosine of
    centred gradient-orientation histograms (counted here with arctan2 and loops); the centre is saved."""
    from search.evaluation.baselines import centred_unit, raw_pixel_features
    from training.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(2)
    cfg = EncoderConfig(
        width=8,
        layers=(1, 1, 1, 1),
        heads=2,
        embed_dim=8,
        image_size=64,
        pixel_weight=0.2,
        colour_weight=0.2,
        gradient_weight=0.3,
        gradient_grid=4,
        gradient_bins=8,
    )
    enc = create_encoder(cfg).eval()
    assert enc.embed_dim == 8 + 32 * 32 + 4**3 + 4 * 4 * 8
    x = torch.rand(6, 3, 64, 64, dtype=torch.float64).float() * 2 - 1
    x[1] = 0.25  # a flat image: no gradients anywhere, a zero histogram
    x[2, :, :, :32], x[2, :, :, 32:] = 0.5, -1.0  # a vertical edge, bright to dark: direction pi only
    some = [0, 2, 3, 4, 5]
    ref = _numpy_hog(x[some].double().numpy(), 4, 8)
    got = enc.gradient_histogram(x).double().numpy()
    np.testing.assert_allclose(got[some], ref, atol=1e-5)
    assert np.all(got[1] == 0)
    # (bins, grid, grid) order: direction 4 of 8 (pi), the two columns of cells either side of the edge
    assert sorted(np.flatnonzero(got[2])) == [4 * 16 + r * 4 + c for r in range(4) for c in (1, 2)]
    enc.set_pixel_mean([x[:3], x[3:]])
    z, t = enc(x).detach().double().numpy(), enc.tower_embed(x).detach().double().numpy()
    p, _ = centred_unit(raw_pixel_features(x), raw_pixel_features(x))
    rgb = ((x.numpy() + 1) / 2).transpose(0, 2, 3, 1).reshape(6, -1, 3)
    hist = np.stack([np.histogramdd(v, bins=4, range=[(0, 1)] * 3)[0].ravel() for v in rgb]) / (64 * 64)
    q, _ = centred_unit(np.sqrt(hist), np.sqrt(hist))
    o, _ = centred_unit(got, got)
    np.testing.assert_allclose(
        z @ z.T, 0.3 * t @ t.T + 0.2 * p @ p.T + 0.2 * q @ q.T + 0.3 * o @ o.T, atol=5e-5
    )
    save_checkpoint(tmp_path / "g.safetensors", enc, step=0, train_config={}, lineage={}, metrics={})
    back, _ = load_checkpoint(tmp_path / "g.safetensors")
    np.testing.assert_allclose(back(x).detach().numpy(), z, atol=1e-6)
    np.testing.assert_allclose(back.gradient_mean.numpy(), got.mean(axis=0), atol=1e-6)
    alone = create_encoder(
        EncoderConfig(width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8, gradient_weight=0.5)
    )
    assert (
        alone.embed_dim == 8 + 4 * 4 * 16 and set(alone.state_dict()) & {"pixel_mean", "colour_mean"} == set()
    )
    for bad in (
        dict(pixel_weight=0.3, colour_weight=0.3, gradient_weight=0.4),
        dict(gradient_weight=-0.1),
        dict(gradient_bins=1),
        dict(gradient_grid=0),
        dict(gradient_weight=0.2, gradient_grid=5),
    ):
        with pytest.raises(ValueError, match="gradient"):
            create_encoder(EncoderConfig(**bad))
