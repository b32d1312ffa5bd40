"""Checkpoints: exact round trip, no pickle, metadata, clear errors; train-state round trip."""

import json
import random
import struct

import numpy as np
import pytest
import torch

from training.checkpoint import (
    checkpoint_sha256,
    config_hash,
    load_checkpoint,
    load_train_state,
    read_checkpoint_metadata,
    save_checkpoint,
    save_train_state,
)
from training.encoder import EncoderConfig, create_encoder

TINY = EncoderConfig(width=16, layers=1, heads=2, patch_size=8, mlp_ratio=1.0, embed_dim=8)


def _save(tmp_path, enc, **kw):
    return save_checkpoint(
        tmp_path / "ck.safetensors",
        enc,
        step=7,
        train_config={"lr": 0.1, "steps": 3},
        lineage={"objective": "infonce", "temperature_schedule": "fixed", "dataset": {"name": "x"}},
        metrics={"loss": 1.5},
        **kw,
    )


@pytest.mark.parametrize(
    "config", [TINY, EncoderConfig(width=8, layers=(1, 1, 1, 1), heads=2, embed_dim=8)], ids=["vit", "resnet"]
)
def test_round_trip_exact(tmp_path, config):
    torch.manual_seed(0)
    enc = create_encoder(config).eval()
    path = _save(tmp_path, enc)
    loaded, meta = load_checkpoint(path)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(enc(x), loaded(x))
    for (k, a), (k2, b) in zip(enc.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert meta["step"] == 7 and meta["metrics"] == {"loss": 1.5}
    assert meta["encoder"]["layers"] == (
        list(config.layers) if isinstance(config.layers, tuple) else config.layers
    )
    assert meta["lineage"]["train_config_hash"] == config_hash({"steps": 3, "lr": 0.1})
    assert read_checkpoint_metadata(path) == meta


def test_file_is_safetensors_not_pickle(tmp_path):
    path = _save(tmp_path, create_encoder(TINY))
    raw = path.read_bytes()
    # safetensors layout: 8-byte little-endian header length, then a JSON header.
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert "__metadata__" in header and "softsearch" in header["__metadata__"]
    assert raw[:2] != b"\x80\x02" and b"PK\x03\x04" not in raw[:4]  # no pickle / torch zip


def test_config_hash_canonical():
    import hashlib

    cfg = {"b": 1, "a": [1, 2], "c": {"y": 0.5, "x": None}}
    expected = hashlib.sha256(b'{"a":[1,2],"b":1,"c":{"x":null,"y":0.5}}').hexdigest()
    assert config_hash(cfg) == expected


def test_sha256_matches_hashlib(tmp_path):
    import hashlib

    path = _save(tmp_path, create_encoder(TINY))
    assert checkpoint_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError):
        checkpoint_sha256(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-garbage!")
    with pytest.raises(ValueError, match="bad.safetensors"):
        load_checkpoint(bad)
    path = _save(tmp_path, create_encoder(TINY))
    truncated = tmp_path / "trunc.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="trunc.safetensors"):
        load_checkpoint(truncated)
    # weights that do not fit the stored config
    from safetensors.torch import save_file

    meta = read_checkpoint_metadata(path)
    meta["encoder"]["width"] = 32
    meta["encoder"]["heads"] = 2
    mismatch = tmp_path / "mismatch.safetensors"
    state = {k: v.contiguous().clone() for k, v in create_encoder(TINY).state_dict().items()}
    save_file(state, str(mismatch), metadata={"softsearch": json.dumps(meta)})
    with pytest.raises(ValueError, match="mismatch.safetensors"):
        load_checkpoint(mismatch)
    # a train-state file is not a checkpoint
    opt = torch.optim.AdamW(create_encoder(TINY).parameters())
    ts = save_train_state(tmp_path / "ts.safetensors", step=1, optimizer=opt)
    with pytest.raises(ValueError, match="softsearch-train-state"):
        load_checkpoint(ts)


def test_atomic_write_leaves_no_temp(tmp_path):
    enc = create_encoder(TINY)
    _save(tmp_path, enc)
    _save(tmp_path, enc)  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors"]


def test_train_state_round_trip(tmp_path):
    torch.manual_seed(0)
    enc = create_encoder(TINY)
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(2):
        opt.zero_grad()
        enc(torch.randn(4, 3, 32, 32)).sum().backward()
        opt.step()
    rng = np.random.default_rng(3)
    rng.random()
    random.seed(5)
    path = save_train_state(
        tmp_path / "ts.safetensors",
        step=2,
        optimizer=opt,
        schedule_state={"log_tau": torch.tensor(-2.0)},
        rng_tensors={"torch": torch.get_rng_state()},
        extra_json={"numpy": rng.bit_generator.state, "python": random.getstate()},
    )
    st = load_train_state(path)
    assert st["step"] == 2
    assert torch.equal(st["rng"]["torch"], torch.get_rng_state())
    assert torch.equal(st["schedule"]["log_tau"], torch.tensor(-2.0))
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = st["extra"]["numpy"]
    assert rng2.random() == rng.random()
    # the optimizer continues identically after reload
    enc2 = create_encoder(TINY)
    enc2.load_state_dict(enc.state_dict())
    opt2 = torch.optim.AdamW(enc2.parameters(), lr=1.0)
    opt2.load_state_dict(st["optimizer"])
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95) and opt2.param_groups[0]["lr"] == 1e-2
    x = torch.randn(4, 3, 32, 32)
    for e, o in ((enc, opt), (enc2, opt2)):
        o.zero_grad()
        e(x).sum().backward()
        o.step()
    for a, b in zip(enc.parameters(), enc2.parameters()):
        assert torch.equal(a, b)
