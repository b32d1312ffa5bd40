"""Trainer: lr schedule, deterministic data, config loading/overrides, main() end to end, resume."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from training.checkpoint import config_hash, load_checkpoint, load_train_state, read_checkpoint_metadata
from training.config import TrainConfig, load_train_config
from training.trainer import batch_indices, lr_at, main, sample_views, train

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def test_lr_warmup_and_cosine():
    cfg = TrainConfig(steps=11, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.5) and lr_at(1, cfg) == pytest.approx(1.0)
    assert lr_at(2, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(10, cfg) == pytest.approx(0.1)  # and ends at lr * min_lr_ratio
    # midpoint of the cosine part (step 6 of 2..10): 0.1 + 0.9 * (1 + cos(pi/2)) / 2
    assert lr_at(6, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    values = [lr_at(s, cfg) for s in range(2, 11)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_batch_indices_cover_each_epoch_without_repeats():
    n, b = 50, 8  # 6 full batches per epoch, 2 items dropped
    epoch0 = np.concatenate([batch_indices(s, n, b, seed=3) for s in range(6)])
    assert len(set(epoch0.tolist())) == 48 and epoch0.max() < n
    epoch1 = np.concatenate([batch_indices(s, n, b, seed=3) for s in range(6, 12)])
    assert not np.array_equal(epoch0, epoch1)  # a fresh permutation per epoch
    assert np.array_equal(batch_indices(7, n, b, 3), batch_indices(7, n, b, 3))
    assert not np.array_equal(batch_indices(0, n, b, 3), batch_indices(0, n, b, 4))
    with pytest.raises(ValueError, match="batch_size=60"):
        batch_indices(0, n, 60, 0)


def test_sample_views_split_matches_full_batch():
    """Rank r's chunk-aligned part of the batch equals that part of the single-process batch."""
    from training.datasets import create_dataset

    ds = create_dataset("synthetic", size=64)
    gen = ds.default_generator()
    idx = batch_indices(0, len(ds), 16, seed=0)
    a, b = sample_views(gen, ds, idx, seed=0, step=5, offset=0, chunk=4)
    a1, b1 = sample_views(gen, ds, idx[8:], seed=0, step=5, offset=8, chunk=4)
    assert a.shape == (16, 3, 32, 32)
    assert torch.equal(a[8:], a1) and torch.equal(b[8:], b1)
    assert not torch.equal(a, b)  # positives differ from anchors
    with pytest.raises(ValueError, match="offset 6"):
        sample_views(gen, ds, idx[6:], seed=0, step=5, offset=6, chunk=4)


def test_load_config_and_overrides(tmp_path):
    cfg = load_train_config(
        TINY,
        [
            "steps=3",
            "encoder.layers=[1, 1, 1, 1]",
            "schedule_options.tau=0.5",
            "lr=1e-3",
            "generator=none",
            "progress=true",
            'out_dir="x y"',
            "loss_options.kappa_rho=10",
            "grad_clip=1",
        ],
    )
    assert cfg.steps == 3 and cfg.encoder.layers == (1, 1, 1, 1) and cfg.encoder.width == 16
    assert cfg.schedule_options == {"tau": 0.5} and cfg.lr == 1e-3 and cfg.generator is None
    assert cfg.progress is True and cfg.out_dir == "x y" and cfg.loss_options == {"kappa_rho": 10}
    assert cfg.grad_clip == 1.0 and isinstance(cfg.grad_clip, float)
    assert load_train_config(None).steps == TrainConfig().steps
    for bad, needle in [
        ("bogus=1", "bogus"),
        ("encoder.bogus=1", "encoder.bogus"),
        ("steps=abc", "steps"),
        ("steps=0", "steps"),
        ("nokeyvalue", "nokeyvalue"),
        ("lr.x=1", "lr"),
        ("encoder.layers=[1, 1, 1]", "encoder.layers"),
    ]:
        with pytest.raises(ValueError, match=needle):
            load_train_config(TINY, [bad])
    bad_file = tmp_path / "bad.toml"
    bad_file.write_text('steps = 3\nmystery = "x"\n[encoder]\nwidth = 8\ncolour = 1\n')
    with pytest.raises(ValueError, match="mystery"):
        load_train_config(bad_file)
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_train_config(tmp_path / "nope.toml")
    for name in ("synthetic.toml", "fashion-mnist.toml", "tiny.toml"):
        load_train_config(ROOT / "configs" / name)  # the shipped configs parse and validate


def test_lineage_hash_ignores_runtime_fields():
    a = load_train_config(TINY, ['out_dir="a"', "log_every=1", "num_workers=2", "stop_after=3"])
    b = load_train_config(TINY, ['out_dir="b"'])
    c = load_train_config(TINY, ["lr=0.1"])
    assert config_hash(a.lineage_dict()) == config_hash(b.lineage_dict()) != config_hash(c.lineage_dict())


def _read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_main_end_to_end(tmp_path):
    out = tmp_path / "run"
    assert (
        main(["--config", str(TINY), "--set", "steps=4", "--set", "checkpoint_every=2", "--out", str(out)])
        == 0
    )
    assert {p.name for p in out.iterdir()} >= {
        "init.safetensors",
        "checkpoint.safetensors",
        "train_state.safetensors",
        "metrics.jsonl",
        "config.json",
    }
    rows = _read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert {"loss", "temperature", "lr", "images_per_s", "pos_sim_mean", "top1_accuracy"} <= set(r)
        assert math.isfinite(r["loss"]) and r["temperature"] == 0.2
    enc, meta = load_checkpoint(out / "checkpoint.safetensors")
    init, init_meta = load_checkpoint(out / "init.safetensors")
    assert meta["step"] == 4 and init_meta["step"] == 0
    assert meta["metrics"]["step"] == 3 and meta["metrics"]["loss"] == rows[-1]["loss"]
    cfg = load_train_config(TINY, ["steps=4", "checkpoint_every=2", f'out_dir="{out}"'])
    assert meta["lineage"]["train_config_hash"] == config_hash(cfg.lineage_dict())
    assert meta["lineage"]["objective"] == "infonce" and meta["lineage"]["temperature_schedule"] == "fixed"
    assert (
        meta["lineage"]["dataset"]["name"] == "synthetic" and meta["lineage"]["generator"]["name"] == "latent"
    )
    assert json.loads((out / "config.json").read_text()) == cfg.to_dict()
    assert any(not torch.equal(a, b) for a, b in zip(enc.state_dict().values(), init.state_dict().values()))
    # the training loss of the logged step equals a recomputation from... the state: lr was applied
    assert (
        load_train_state(out / "train_state.safetensors")["optimizer"]["param_groups"][0]["lr"]
        == rows[-1]["lr"]
    )


def _state(path):
    return load_file(str(path))


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            'schedule="learnable"',
            "schedule_options={tau = 0.2}",
            'noise_schedule="fixed"',
            "noise_options={tau = 1e-4}",
            "num_workers=1",
            'loss="weince"',
        ],
    ],
    ids=["infonce-fixed", "weince-learnable-langevin-prefetch"],
)
def test_resume_equals_straight_run(tmp_path, extra):
    """10 steps straight == 5 steps, stop, --resume to 10 (bitwise on CPU)."""
    base = ["steps=10", "checkpoint_every=3"] + extra
    straight = train(load_train_config(TINY, base + [f'out_dir="{tmp_path / "a"}"']))
    cfg_b = load_train_config(TINY, base + [f'out_dir="{tmp_path / "b"}"', "stop_after=5"])
    half = train(cfg_b)
    assert read_checkpoint_metadata(half)["step"] == 5
    assert (
        main(
            ["--config", str(TINY), "--resume", "--out", str(tmp_path / "b")]
            + sum((["--set", s] for s in base), [])
        )
        == 0
    )
    a, b = _state(straight), _state(tmp_path / "b" / "checkpoint.safetensors")
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
    la, lb = _read_metrics(tmp_path / "a"), _read_metrics(tmp_path / "b")
    assert [r["step"] for r in lb] == list(range(10))
    for ra, rb in zip(la, lb):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6) and ra["temperature"] == pytest.approx(
            rb["temperature"]
        )
    if extra:
        temps = [r["temperature"] for r in la]
        assert temps[0] != temps[-1]  # the learnable temperature moved
        assert "noise_temperature" in la[0]
        sa = load_train_state(tmp_path / "a" / "train_state.safetensors")["schedule"]
        sb = load_train_state(tmp_path / "b" / "train_state.safetensors")["schedule"]
        assert torch.allclose(sa["logit_scale"], sb["logit_scale"], atol=1e-6)
        la_state = load_train_state(tmp_path / "b" / "train_state.safetensors")["loss"]
        assert set(la_state) >= {"rho0_ema", "beta_ema"}  # WEINCE's EMA buffers are resumed too
        assert "weince_lambda_mean" in la[0] and "weince_rho0" in la[0]  # the loss stats are logged


def test_resume_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_state"):
        train(load_train_config(TINY, ["steps=2", f'out_dir="{tmp_path}"']), resume=True)
    train(load_train_config(TINY, ["steps=2", f'out_dir="{tmp_path}"']))
    with pytest.raises(ValueError, match="lr"):
        train(load_train_config(TINY, ["steps=2", "lr=0.5", f'out_dir="{tmp_path}"']), resume=True)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="batch_size=512"):
        train(load_train_config(TINY, ["batch_size=512", f'out_dir="{tmp_path}"']))
    with pytest.raises(ValueError, match="nope"):
        train(load_train_config(TINY, ['loss="nope"', f'out_dir="{tmp_path}"']))
    with pytest.raises(ValueError, match="pixel_weight"):  # the anchor is for image search only
        load_train_config(TINY, ["encoder.pixel_weight=0.5", "text={epochs = 1}"]).validate()


@pytest.mark.slow
def test_training_lowers_loss(tmp_path):
    """~200 steps at a fixed temperature: the training loss clearly drops."""
    cfg = load_train_config(
        TINY,
        [
            "steps=200",
            "batch_size=32",
            "dataset_size=1024",
            "lr=3e-3",
            "warmup_steps=10",
            "checkpoint_every=1000",
            f'out_dir="{tmp_path}"',
        ],
    )
    train(cfg)
    losses = [r["loss"] for r in _read_metrics(tmp_path)]
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    assert last < first - 0.5, (first, last)
    # also below the chance level log(2N - 1) of an untrained encoder
    assert last < math.log(2 * 32 - 1) - 0.5


def test_contrastive_step_single_process_equals_loss_forward():
    """The trainer's step (one forward of cat(a, b), NT-Xent layout) == ContrastiveLoss.forward."""
    from training.distributed import DistInfo
    from training.encoder import EncoderConfig, create_encoder
    from training.losses import create_loss
    from training.trainer import contrastive_step

    torch.manual_seed(0)
    enc = create_encoder(EncoderConfig(width=16, layers=1, heads=2, patch_size=8, mlp_ratio=1.0, embed_dim=8))
    a, b = torch.randn(6, 3, 32, 32), torch.randn(6, 3, 32, 32)
    loss = create_loss("infonce")
    got = contrastive_step(enc, loss, a, b, 0.3, DistInfo())
    ref = loss(enc(a), enc(b), 0.3)
    assert torch.allclose(got.loss, ref.loss, atol=1e-6)
    assert got.stats == pytest.approx(ref.stats)


def test_contrastive_step_sees_the_anchor_only_when_asked():
    """With a pixel/colour anchor the step's loss is the loss of the tower alone, or (sees_anchor) of the
    served embedding, which differs from it."""
    from training.distributed import DistInfo
    from training.encoder import EncoderConfig, create_encoder
    from training.losses import create_loss
    from training.trainer import contrastive_step

    torch.manual_seed(0)
    cfg = EncoderConfig(
        width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8, pixel_weight=0.4, colour_weight=0.2
    )
    enc = create_encoder(cfg).eval()  # batch-norm statistics: one batch of cat(a, b) vs a and b alone
    a, b = torch.rand(6, 3, 32, 32) * 2 - 1, torch.rand(6, 3, 32, 32) * 2 - 1
    enc.set_pixel_mean([torch.cat([a, b])])
    loss = create_loss("infonce")
    tower = contrastive_step(enc, loss, a, b, 0.3, DistInfo())
    served = contrastive_step(enc, loss, a, b, 0.3, DistInfo(), sees_anchor=True)
    assert torch.allclose(tower.loss, loss(enc.tower_embed(a), enc.tower_embed(b), 0.3).loss, atol=1e-6)
    assert torch.allclose(served.loss, loss(enc(a), enc(b), 0.3).loss, atol=1e-6)
    assert enc(a).shape[1] == 8 + 1024 + 64 and not torch.allclose(tower.loss, served.loss, atol=1e-3)


def test_served_space_neighbours_rank_by_the_anchored_embedding():
    """encoder_neighbours(served=True) ranks by the encoder's served (anchored) embedding: with an
    untrained tower it agrees with a brute-force ranking of those cosines, not the tower's."""
    from training.encoder import EncoderConfig, create_encoder
    from training.neighbours import encoder_neighbours

    class DS:
        def __init__(self, x):
            self.x = x

        def __len__(self):
            return len(self.x)

        def tensors(self, idx):
            return self.x[torch.as_tensor(idx)]

    torch.manual_seed(2)
    x = torch.rand(20, 3, 32, 32) * 2 - 1
    enc = create_encoder(EncoderConfig(width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8, pixel_weight=0.5))
    enc.set_pixel_mean([x])
    enc.eval()  # as encoder_neighbours embeds
    ds = DS(x)
    with torch.no_grad():
        z = enc(x).numpy()
    sim = z @ z.T
    np.fill_diagonal(sim, -np.inf)
    got = encoder_neighbours(enc, ds, 3, served=True)
    np.testing.assert_array_equal(got, np.argsort(-sim, axis=1)[:, :3])
    # the untrained tower alone ranks otherwise (its cosines all sit near 1)
    assert not np.array_equal(encoder_neighbours(enc, ds, 3), got)


def test_encoder_space_neighbours_follow_the_encoder(tmp_path, monkeypatch):
    """generator neighbour/space=encoder: the table is computed from the encoder before step 0 and at
    every refresh_every-th step, each time from the encoder's weights at that step."""
    from training import generators, neighbours

    seen = []
    real = neighbours.encoder_neighbours

    def spy(encoder, dataset, k, **kw):
        seen.append({n: p.detach().clone() for n, p in encoder.state_dict().items()})
        return real(encoder, dataset, k, **kw)

    monkeypatch.setattr(neighbours, "encoder_neighbours", spy)
    cfg = load_train_config(
        TINY,
        [
            "steps=7",
            'generator="neighbour"',
            f'out_dir="{tmp_path}"',
            'generator_options={k = 3, space = "encoder", refresh_every = 3}',
        ],
    )
    train(cfg)
    assert len(seen) == 3  # steps 0, 3, 6
    init = load_file(str(tmp_path / "init.safetensors"))
    for name, value in init.items():
        torch.testing.assert_close(seen[0][name].float(), value.float())  # the untrained tower's neighbours
    for a, b in zip(seen, seen[1:]):  # each later table: newer weights
        assert any(not torch.equal(a[n], b[n]) for n in a)
    info = json.loads((tmp_path / "config.json").read_text())
    assert info["generator_options"]["space"] == "encoder"
    assert isinstance(
        generators.create_generator("neighbour", **info["generator_options"]), generators.NeighbourGenerator
    )


def test_folder_config_without_classes_trains_on_encoder_neighbours(tmp_path):
    """configs/folder.toml on a flat folder (no class subfolders): generator auto -> the neighbour
    generator in the encoder's space, as the checkpoint's lineage records."""
    from PIL import Image

    img = tmp_path / "img"
    img.mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(img / f"{i:02d}.png")
    cfg = load_train_config(
        ROOT / "configs" / "folder.toml",
        [
            f'data_root="{img}"',
            f'out_dir="{tmp_path / "run"}"',
            "steps=3",
            "batch_size=8",
            "warmup_steps=1",
            "num_workers=0",
            "cache_workers=1",
            "progress=false",
            f'cache_dir="{tmp_path / "cache"}"',
            "checkpoint_every=1000",
            'device="cpu"',
        ],
    )
    ckpt = train(cfg)
    gen = read_checkpoint_metadata(ckpt)["lineage"]["generator"]
    assert gen["name"] == "neighbour" and gen["options"]["space"] == "encoder"
    assert gen["options"]["refresh_every"] == cfg.generator_options["refresh_every"] > 0
    # the shipped anchor: grey pixels and a colour histogram beside the tower, centres from these images
    from training.trainer import build_data

    enc = cfg.encoder
    weights = load_file(str(ckpt))
    assert enc.pixel_weight > 0 and enc.colour_weight > 0
    assert weights["pixel_mean"].shape == (enc.pixel_side**2,)
    ds, _ = build_data(cfg)
    x = ds.tensors(np.arange(len(ds))).float().numpy()  # (N, 3, S, S) in [-1, 1]
    rgb = ((x + 1) / 2).transpose(0, 2, 3, 1).reshape(len(x), -1, 3)
    bins = enc.colour_bins
    hist = [np.histogramdd(v, bins=bins, range=[(0, 1)] * 3)[0].ravel() / len(v) for v in rgb]
    np.testing.assert_allclose(weights["colour_mean"].numpy(), np.sqrt(hist).mean(axis=0), atol=1e-5)


def test_folder_config_anchor_weights_follow_the_layout(tmp_path):
    """configs/folder.toml's [anchor_with_classes]: with class folders (generator auto -> label) the served
    embedding takes those weights, without them the [encoder] ones; both checkpoints carry the gradient
    part's centre, the training images' mean orientation histogram."""
    from PIL import Image

    from training.trainer import build_data

    rng = np.random.default_rng(1)
    for layout in ("classes", "flat"):
        for i in range(16):
            sub = f"c{i % 2}/" if layout == "classes" else ""
            path = tmp_path / layout / f"{sub}{i:02d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(path)
    runs = {}
    for layout in ("classes", "flat"):
        cfg = load_train_config(
            ROOT / "configs" / "folder.toml",
            [
                f'data_root="{tmp_path / layout}"',
                f'out_dir="{tmp_path / ("run-" + layout)}"',
                "steps=2",
                "batch_size=8",
                "warmup_steps=1",
                "num_workers=0",
                "cache_workers=1",
                "progress=false",
                f'cache_dir="{tmp_path / "cache"}"',
                'device="cpu"',
            ],
        )
        runs[layout] = (cfg, train(cfg))
    cfg, _ = runs["flat"]
    assert cfg.anchor_with_classes and cfg.encoder.gradient_weight > 0
    expect = {
        "classes": cfg.anchor_with_classes,
        "flat": {k: getattr(cfg.encoder, k) for k in cfg.anchor_with_classes},
    }
    assert expect["classes"] != expect["flat"]
    for layout, (cfg, ckpt) in runs.items():
        enc, _ = load_checkpoint(ckpt)
        assert {k: getattr(enc.config, k) for k in expect[layout]} == expect[layout]
        meta = read_checkpoint_metadata(ckpt)
        assert meta["lineage"]["generator"]["name"] == ("label" if layout == "classes" else "neighbour")
        assert {k: meta["train_config"]["encoder"][k] for k in expect[layout]} == expect[layout]
        ds, _ = build_data(cfg)
        x = ds.tensors(np.arange(len(ds)))
        torch.testing.assert_close(
            enc.gradient_mean, enc.gradient_histogram(x).mean(dim=0), atol=1e-5, rtol=0
        )
    for bad, match in (
        ({"anchor_with_classes": {"tower_weight": 0.5}}, "anchor_with_classes takes"),
        ({"anchor_with_classes": {"pixel_weight": 0.2}, "generator": "neighbour"}, 'generator = "auto"'),
        (
            {"anchor_with_classes": {"pixel_weight": 0.6, "colour_weight": 0.5}, "generator": "auto"},
            "colour_weight",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad).validate()


def test_pixel_anchor_leaves_the_tower_training_unchanged(tmp_path):
    """encoder.pixel_weight > 0: the loss sees the tower alone, so the tower's weights equal a run without
    the anchor; the checkpoint carries the training images' mean grey thumbnail as the anchor's centre."""
    from training.trainer import build_data

    common = ["steps=3", "num_workers=0", "checkpoint_every=1000"]
    plain = train(load_train_config(TINY, [*common, f'out_dir="{tmp_path / "plain"}"']))
    cfg = load_train_config(TINY, [*common, f'out_dir="{tmp_path / "px"}"', "encoder.pixel_weight=0.5"])
    anchored = train(cfg)
    a, b = load_file(str(plain)), load_file(str(anchored))
    assert set(b) == set(a) | {"pixel_mean"}
    for name in a:
        torch.testing.assert_close(a[name], b[name])
    ds, _ = build_data(cfg)
    x = ds.tensors(np.arange(len(ds))).float()  # (N, 3, S, S)
    mean = torch.nn.functional.interpolate(x.mean(dim=1, keepdim=True), size=(32, 32), mode="area")
    torch.testing.assert_close(b["pixel_mean"], mean.flatten(1).mean(dim=0), atol=1e-5, rtol=0)
    init = load_file(str(tmp_path / "px" / "init.safetensors"))
    torch.testing.assert_close(init["pixel_mean"], b["pixel_mean"])  # --compare init scores the same anchor
