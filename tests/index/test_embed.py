"""index/embed.py: shards, skipping unreadable items, resume bookkeeping."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from index.embed import CpuStreams, collect_shards, dist_env, embed_dataset, prepare_cache
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder, embed

BAD = {3, 17, 18, 40}


class Flaky(torch.utils.data.Dataset):
    """A synthetic dataset whose items in BAD raise like a corrupt file would (picklable for workers)."""

    def __init__(self, base):
        self.base, self.image_size = base, base.image_size

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        if i in BAD:
            raise OSError(f"image file is truncated ({i})")
        return self.base[i]

    def tensors(self, idx):
        if BAD & set(int(i) for i in idx):
            raise OSError("a bad file in this batch")
        return self.base.tensors(idx)

    def item_id(self, i):
        return f"flaky/{i}"


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return create_encoder(EncoderConfig(width=32, layers=1, heads=2, embed_dim=16, patch_size=8)).eval()


@pytest.mark.parametrize("workers", [0, 1])
def test_skips_bad_items_and_writes_shards(tmp_path, encoder, workers):
    base = create_dataset("synthetic", size=45, seed=0)
    res = embed_dataset(
        encoder,
        Flaky(base),
        tmp_path,
        key="k",
        shard_size=10,
        batch_size=8,
        num_workers=workers,
        progress=False,
    )
    good = np.array([i for i in range(45) if i not in BAD])
    np.testing.assert_array_equal(res.rows, good)
    ref = embed(encoder, base.tensors(good), progress=False)
    np.testing.assert_allclose(res.embeddings, ref, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(res.embeddings, axis=1), 1, atol=1e-6)
    assert sorted(s["index"] for s in res.skipped) == sorted(BAD)
    assert all("truncated" in s["error"] and s["id"] == f"flaky/{s['index']}" for s in res.skipped)
    assert sorted(p.name for p in tmp_path.glob("shard_*.npy")) == [f"shard_{s:05d}.npy" for s in range(5)]
    meta = json.loads((tmp_path / "shard_00001.json").read_text())
    assert meta["rows"] == [10, 11, 12, 13, 14, 15, 16, 19] and len(meta["skipped"]) == 2
    # a second run finds every shard complete and reads the same result without embedding
    again = embed_dataset(
        encoder, Flaky(base), tmp_path, key="k", shard_size=10, batch_size=8, progress=False
    )
    assert again.resumed_shards == 5
    np.testing.assert_array_equal(again.embeddings, res.embeddings)


def test_changed_job_starts_over(tmp_path, encoder):
    base = create_dataset("synthetic", size=12, seed=0)
    embed_dataset(encoder, base, tmp_path, key="a", shard_size=5, progress=False)
    assert prepare_cache(tmp_path, "a", np.arange(12), 5) == 3
    assert prepare_cache(tmp_path, "b", np.arange(12), 5) == 0  # other key: old shards dropped
    assert list(tmp_path.glob("shard_*")) == []
    with pytest.raises(RuntimeError, match="missing"):
        collect_shards(tmp_path, np.arange(12), 5, 16)


def test_bad_arguments_and_env(tmp_path, encoder, monkeypatch):
    base = create_dataset("synthetic", size=4, seed=0)
    with pytest.raises(ValueError, match="shard_size"):
        embed_dataset(encoder, base, tmp_path, shard_size=0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert dist_env()[:2] == (1, 2)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        dist_env()


class NaNy(Flaky):
    """Item 5 decodes to NaN pixels (no exception): caught on the embedding instead."""

    def tensors(self, idx):
        x = self.base.tensors(idx).clone()
        for j, i in enumerate(idx):
            if int(i) == 5:
                x[j, 0, 0, 0] = float("nan")
        return x


def test_nan_images_are_skipped(tmp_path, encoder):
    base = create_dataset("synthetic", size=12, seed=0)
    res = embed_dataset(encoder, NaNy(base), tmp_path, shard_size=4, batch_size=6, progress=False)
    assert 5 not in res.rows and len(res.rows) == 11 and np.isfinite(res.embeddings).all()
    assert [s["index"] for s in res.skipped] == [5] and "non-finite" in res.skipped[0]["error"]


class Recording(torch.nn.Module):
    """Records, per forward, the calling thread's intra-op thread count and the input's layout."""

    prefers_channels_last = True

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, x):
        self.calls.append(
            (torch.get_num_threads(), x.is_contiguous(memory_format=torch.channels_last), len(x))
        )
        return self.inner(x)


def test_cpu_streams_equal_one_forward(tmp_path, encoder):
    """Chunks on single-threaded streams give one forward's rows; the process's thread count is restored."""
    torch.manual_seed(1)
    conv = create_encoder(
        EncoderConfig(image_size=32, width=16, layers=(1, 1, 1, 1), heads=2, embed_dim=16)
    ).eval()
    assert conv.prefers_channels_last and not encoder.prefers_channels_last  # ModifiedResNet vs ViT
    x = torch.randn(100, 3, 32, 32)
    with torch.inference_mode():
        ref = conv(x)  # one NCHW forward, all rows
    before = torch.get_num_threads()
    rec = Recording(conv)
    streams = CpuStreams(rec, 2, chunk=16)
    try:
        got = streams(x)
        assert torch.get_num_threads() == before
    finally:
        streams.close()
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert sorted(n for _, _, n in rec.calls) == [4] + [16] * 6
    assert all(threads == 1 and channels_last for threads, channels_last, _ in rec.calls)
    # the embedding loop uses them at batches larger than a chunk; same rows as the plain helper
    base = create_dataset("synthetic", size=70, seed=0, image_size=32)
    res = embed_dataset(conv, base, tmp_path, batch_size=64, progress=False)
    np.testing.assert_allclose(
        res.embeddings, embed(conv, base.tensors(np.arange(70)), progress=False), atol=1e-6
    )
    assert torch.get_num_threads() == before


def test_logs_the_shard_split_per_rank(tmp_path, encoder, caplog):
    """Each rank says which shards are its (s % world) and how many are left to embed."""
    import logging

    from index.embed import embed_shards

    base = create_dataset("synthetic", size=50, seed=0)
    with caplog.at_level(logging.INFO, logger="index.embed"):
        assert (
            embed_shards(
                encoder, base, tmp_path, np.arange(50), shard_size=10, rank=1, world_size=2, progress=False
            )
            == 2
        )  # shards 1 and 3 of 0..4
    msg = [r.getMessage() for r in caplog.records if "shard" in r.getMessage()][-1]
    assert "50 items in 5 shard(s) of 10 over 2 rank(s)" in msg
    assert "rank 1: shards [1, 3] (2 to embed, 0 already on disk)" in msg
    with caplog.at_level(logging.INFO, logger="index.embed"):  # a rerun finds them done
        assert (
            embed_shards(
                encoder, base, tmp_path, np.arange(50), shard_size=10, rank=1, world_size=2, progress=False
            )
            == 0
        )
    assert "(0 to embed, 2 already on disk)" in caplog.records[-1].getMessage()
