"""Image-text training pieces: the symmetric CLIP loss against an independent formula, unique-caption batches,
WEINCE on image-text rows, folder captions."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from training.captions import CaptionScheme
from training.losses import create_loss
from training.text import TextConfig, TextEncoder, text_config_from_dict
from training.text_trainer import CaptionData, caption_data, clip_step, unique_caption_batch


class _Fixed(torch.nn.Module):
    def __init__(self, z):
        super().__init__()
        self.z = z

    def forward(self, x):
        return self.z


def test_clip_step_is_symmetric_cross_entropy():
    g = torch.Generator().manual_seed(0)
    zi = F.normalize(torch.randn(6, 8, generator=g), dim=1)
    zt = F.normalize(torch.randn(6, 8, generator=g), dim=1)
    tau = 0.07
    out = clip_step(_Fixed(zi), _Fixed(zt), create_loss("infonce"), None, None, tau)
    logits = (zi @ zt.T).double() / tau
    target = torch.arange(6)
    expected = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-5)


def test_weince_runs_on_image_text_rows():
    g = torch.Generator().manual_seed(1)
    zi = F.normalize(torch.randn(32, 8, generator=g), dim=1).requires_grad_()
    zt = F.normalize(torch.randn(32, 8, generator=g), dim=1)
    out = clip_step(_Fixed(zi), _Fixed(zt), create_loss("weince"), None, None, 0.1)
    out.loss.backward()
    assert torch.isfinite(out.loss) and zi.grad.abs().sum() > 0


def test_unique_caption_batches():
    keys = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    data = CaptionData(np.arange(10), keys, {})
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = unique_caption_batch(data, 4, rng)
        assert len(idx) == 4 and len(set(keys[idx])) == 4
    assert len(unique_caption_batch(data, 8, rng)) == 5  # only 5 distinct captions exist


def test_synthetic_caption_data_names_the_cells(tiny_synthetic):
    data = caption_data(tiny_synthetic, {"bins": [4, 3, 4]})
    scheme = CaptionScheme((4, 3, 4))
    idx = np.arange(10)
    texts = data.texts(tiny_synthetic, idx, np.random.default_rng(0))
    assert [scheme.parse(t) for t in texts] == scheme.cells(tiny_synthetic.latents[idx]).tolist()
    with pytest.raises(ValueError, match="bins"):
        caption_data(tiny_synthetic, {"bins": [5, 6, 8]})


def test_text_config_checks_and_tokenizer_is_offline():
    with pytest.raises(ValueError, match="unknown text config keys"):
        text_config_from_dict({"widht": 3})
    with pytest.raises(ValueError, match="divisible"):
        text_config_from_dict({"width": 10, "heads": 4})
    enc = TextEncoder(TextConfig(width=16, heads=2, layers=1, context_length=12), 8)
    tokens = enc.tokenize(["a red disc", "x " * 50])
    assert tokens.shape == (2, 12) and tokens.dtype == torch.long
    assert int(tokens[1, -1]) == enc.tokenizer.eot_token_id  # truncated, still ends with end-of-text


def test_folder_captions_train_and_skip_uncaptioned(tmp_path, make_image_folder):
    import json

    from training.checkpoint import read_checkpoint_metadata
    from training.config import TrainConfig
    from training.datasets import create_dataset
    from training.encoder import EncoderConfig
    from training.trainer import train

    folder = make_image_folder(tmp_path / "photos", count=12, classes=2, size=32)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))
    lines = [json.dumps({"file": f, "text": f"photo {n % 5}"}) for n, f in enumerate(files[:9])]
    (folder / "captions.jsonl").write_text("\n".join(lines) + "\n")
    ds = create_dataset("folder", split="all", root=str(folder), image_size=32, progress=False)
    data = caption_data(ds, {})
    assert data.items.tolist() == list(range(9))  # 3 images without a caption are not trained on
    batch = unique_caption_batch(data, 8, np.random.default_rng(0))
    assert len(batch) == 5  # only 5 distinct captions
    config = TrainConfig(
        dataset="folder",
        data_root=str(folder),
        split="all",
        steps=2,
        batch_size=8,
        warmup_steps=1,
        encoder=EncoderConfig(embed_dim=8, width=16, layers=1, heads=2, patch_size=8),
        text={"width": 16, "layers": 1, "heads": 2, "context_length": 8},
        out_dir=str(tmp_path / "run"),
        progress=False,
        device="cpu",
    )
    meta = read_checkpoint_metadata(train(config))
    assert meta["lineage"]["text"]["captions"] == "files" and meta["lineage"]["text"]["captioned"] == 9
    with pytest.raises(ValueError, match="bins"):
        caption_data(ds, {"bins": [8, 6, 8]})


def test_locked_image_tower_is_kept_and_text_tower_learns(tmp_path):
    from training.checkpoint import load_checkpoint, read_checkpoint_metadata, save_checkpoint
    from training.config import TrainConfig
    from training.encoder import EncoderConfig, create_encoder
    from training.text import load_text_encoder
    from training.trainer import train

    enc_cfg = EncoderConfig(embed_dim=8, width=16, layers=1, heads=2, patch_size=8)
    torch.manual_seed(3)
    image_ck = save_checkpoint(
        tmp_path / "image.safetensors",
        create_encoder(enc_cfg),
        step=0,
        train_config={},
        lineage={"objective": "infonce"},
    )
    common = dict(
        dataset="synthetic",
        dataset_size=64,
        steps=3,
        batch_size=16,
        warmup_steps=1,
        encoder=enc_cfg,
        progress=False,
        device="cpu",
    )
    text = {"width": 16, "layers": 1, "heads": 2, "context_length": 20, "image_checkpoint": str(image_ck)}
    ck = train(TrainConfig(**common, text={**text, "lock_image": True}, out_dir=str(tmp_path / "lit")))
    before, _ = load_checkpoint(image_ck)
    after, meta = load_checkpoint(ck)
    for (name, a), b in zip(before.state_dict().items(), after.state_dict().values()):
        assert torch.equal(a, b), name  # locked: the image tower is the one given
    assert meta["lineage"]["text"]["image_tower"] == "locked (LiT)"
    init = load_text_encoder(ck)
    assert init is not None
    # without the lock both towers move
    ck2 = train(TrainConfig(**common, text=text, out_dir=str(tmp_path / "both")))
    moved, _ = load_checkpoint(ck2)
    assert any(
        not torch.equal(a, b) for a, b in zip(before.state_dict().values(), moved.state_dict().values())
    )
    assert read_checkpoint_metadata(ck2)["lineage"]["text"]["image_tower"] == "trained"
    with pytest.raises(ValueError, match="image_checkpoint"):
        train(
            TrainConfig(
                **common, text={"width": 16, "heads": 2, "lock_image": True}, out_dir=str(tmp_path / "x")
            )
        )
