"""A pretrained open_clip start: a named model's weights, saved by the test in the layouts open_clip's
`pretrained=FILE` accepts (random initialisation, nothing downloaded), load through
`encoder.pretrained`; the encoder's outputs equal the saved model's own `encode_image` on open_clip's
own preprocessing of the same images."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from training.checkpoint import load_checkpoint, save_checkpoint
from training.encoder import EncoderConfig, create_encoder, embed
from training.transforms import preprocess

STAMPS = Path("/usr/share/tuxpaint/stamps")
OPEN_CLIP_MODEL = "ViT-S-32-alt"  # the model the session fixture `open_clip_weights` saves


@pytest.fixture(scope="module")
def images():
    """Real PNG stamps (tuxpaint), squared to the model's 224 px so neither pipeline resamples."""
    paths = sorted(STAMPS.rglob("*.png"))[:2] if STAMPS.is_dir() else []
    if len(paths) < 2:
        rng = np.random.default_rng(0)
        return [Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)) for _ in range(2)]
    return [Image.open(p).convert("RGB").resize((224, 224), Image.BICUBIC) for p in paths]


def _reference(model, images) -> tuple[torch.Tensor, torch.Tensor]:
    """open_clip end to end: its own eval transform for the model, then encode_image(normalize=True)."""
    cfg = open_clip.get_model_preprocess_cfg(model)
    transform = open_clip.image_transform(
        cfg["size"],
        is_train=False,
        mean=cfg["mean"],
        std=cfg["std"],
        interpolation=cfg["interpolation"],
        resize_mode=cfg["resize_mode"],
    )
    x = torch.stack([transform(im) for im in images])  # (B, 3, 224, 224)
    with torch.no_grad():
        return x, model.encode_image(x, normalize=True)


@pytest.mark.parametrize("layout", ["safetensors", "bin", "train_checkpoint", "fp16"])
def test_pretrained_file_round_trip(open_clip_weights, images, layout):
    assert open_clip_weights["name"] == OPEN_CLIP_MODEL
    model = open_clip_weights["model"]
    if layout == "fp16":  # the file holds half-precision weights: compare with the model they describe
        model = copy.deepcopy(model)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    encoder = create_encoder(
        EncoderConfig(model_name=OPEN_CLIP_MODEL, pretrained=str(open_clip_weights["files"][layout]))
    )
    # the model's own preprocessing: image size, mean and std (open_clip's config for it)
    assert encoder.image_size == 224
    assert encoder.config.image_mean == pytest.approx(open_clip.OPENAI_DATASET_MEAN)
    assert encoder.config.image_std == pytest.approx(open_clip.OPENAI_DATASET_STD)
    assert encoder.embed_dim == model.visual.output_dim
    assert encoder.clip_temperature == pytest.approx(
        open_clip_weights["temperature"], rel=1e-3 if layout == "fp16" else 1e-6
    )
    mine = encoder.tower.state_dict()
    for name, value in model.visual.state_dict().items():
        assert torch.equal(mine[name], value), name
    x_ref, z_ref = _reference(model, images)
    x = preprocess(images, encoder.image_size)
    # preprocess() then the encoder's renormalisation is exactly open_clip's transform
    torch.testing.assert_close(x * encoder.input_scale + encoder.input_shift, x_ref, atol=1e-6, rtol=0)
    z = embed(encoder, x, progress=False)
    np.testing.assert_allclose(z, z_ref.numpy(), atol=2e-5)


def test_reduced_image_size_resizes_position_embeddings_like_open_clip(open_clip_weights, images):
    path = str(open_clip_weights["files"]["safetensors"])
    encoder = create_encoder(EncoderConfig(model_name=OPEN_CLIP_MODEL, pretrained=path, image_size=64))
    model = open_clip.create_model(
        OPEN_CLIP_MODEL, pretrained=path, force_image_size=64, pretrained_text=False
    ).eval()
    small = [im.resize((64, 64), Image.BICUBIC) for im in images]
    _, z_ref = _reference(model, small)
    np.testing.assert_allclose(
        embed(encoder, preprocess(small, 64), progress=False), z_ref.numpy(), atol=2e-5
    )
    assert encoder.tower.positional_embedding.shape[0] == (64 // 32) ** 2 + 1


def test_checkpoint_keeps_the_models_normalisation(tmp_path, open_clip_weights, images):
    path = str(open_clip_weights["files"]["safetensors"])
    encoder = create_encoder(EncoderConfig(model_name=OPEN_CLIP_MODEL, pretrained=path, image_size=64))
    ck = save_checkpoint(tmp_path / "c.safetensors", encoder, step=0, train_config={}, lineage={})
    loaded, meta = load_checkpoint(ck)  # rebuilt without the pretrained file
    assert meta["encoder"]["image_mean"] == pytest.approx(open_clip.OPENAI_DATASET_MEAN)
    small = preprocess([im.resize((64, 64)) for im in images], 64)
    np.testing.assert_array_equal(embed(loaded, small, progress=False), embed(encoder, small, progress=False))


def test_named_model_defaults_and_errors(open_clip_weights, tmp_path):
    assert EncoderConfig(model_name=OPEN_CLIP_MODEL).image_size == 224  # the model's own input size
    assert EncoderConfig().image_size == 32 and EncoderConfig().image_mean is None
    with pytest.raises(ValueError, match="cannot load encoder.pretrained=.*ViT-S-32'"):
        create_encoder(
            EncoderConfig(model_name="ViT-S-32", pretrained=str(open_clip_weights["files"]["bin"]))
        )
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not weights")
    with pytest.raises(ValueError, match="cannot load encoder.pretrained"):
        create_encoder(EncoderConfig(model_name=OPEN_CLIP_MODEL, pretrained=str(junk)))
    with pytest.raises(ValueError, match="Hugging Face"):
        create_encoder(EncoderConfig(model_name="roberta-ViT-B-32"))
    with pytest.raises(ValueError, match="image_std"):
        create_encoder(EncoderConfig(model_name=OPEN_CLIP_MODEL, image_std=(0.2, 0.0, 0.2)))


@pytest.mark.slow
def test_fine_tuning_starts_from_the_pretrained_weights(tmp_path, open_clip_weights):
    from safetensors.torch import load_file

    from api.cli import main

    weights = open_clip_weights["files"]["train_checkpoint"]
    out = tmp_path / "run"
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    assert (
        main(
            [
                "train",
                "--config",
                str(tiny),
                "--set",
                f'out_dir="{out}"',
                "--set",
                "steps=2",
                "--set",
                "batch_size=8",
                "--set",
                f'encoder.model_name="{OPEN_CLIP_MODEL}"',
                "--set",
                f'encoder.pretrained="{weights}"',
                "--set",
                "encoder.image_size=64",
            ]
        )
        == 0
    )
    reference = open_clip.create_model(
        OPEN_CLIP_MODEL, pretrained=str(weights), force_image_size=64, pretrained_text=False
    ).visual.state_dict()
    init = load_file(str(out / "init.safetensors"))
    final = load_file(str(out / "checkpoint.safetensors"))
    for name, value in reference.items():
        assert torch.equal(init[f"tower.{name}"], value), name  # step 0 is exactly the pretrained model
    assert any(not torch.equal(final[k], init[k]) for k in init)  # and training moved it
    encoder, meta = load_checkpoint(out / "checkpoint.safetensors")
    assert meta["encoder"]["image_mean"] == pytest.approx(open_clip.OPENAI_DATASET_MEAN)
