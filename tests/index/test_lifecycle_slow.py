"""Crash safety and distributed embedding: real subprocesses (slow)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from index.build import BuildOptions, build_index
from index.store import IndexStore
from training.datasets import create_dataset

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.mark.slow
def test_sigkill_mid_build_leaves_current_loadable_and_resumes(tmp_path, tiny_checkpoint):
    root = tmp_path / "idx"
    small = create_dataset("synthetic", split="train", size=64, seed=0)
    v1 = build_index(tiny_checkpoint, small, root, BuildOptions(progress=False))
    store = IndexStore(root)
    before = store.load()
    queries = before.embeddings[:5]
    expected = before.search(queries, 5)

    script = (
        f"from index.build import BuildOptions, build_index; from training.datasets import create_dataset; "
        f"build_index({str(tiny_checkpoint)!r}, create_dataset('synthetic', size=2000, seed=3), "
        f"{str(root)!r}, BuildOptions(shard_size=64, batch_size=32, progress=False))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:  # kill as soon as embedding has written a shard
            if list(store.staging_dir.glob("embed-*/shard_*.json")):
                break
            assert proc.poll() is None, (
                f"build ended before it could be killed: {proc.stdout.read().decode()[-2000:]}"
            )
            time.sleep(0.05)
        else:
            pytest.fail("no embedding shard appeared within 90 s")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert store.current_version() == v1 and store.versions() == [v1]
    after = store.load(verify=True)
    for a, b in zip(after.search(queries, 5), expected):
        np.testing.assert_array_equal(a, b)
    # rerun: picks up the finished shards and produces the full version
    big = create_dataset("synthetic", size=2000, seed=3)
    v2 = build_index(tiny_checkpoint, big, root, BuildOptions(shard_size=64, batch_size=32, progress=False))
    m = store.manifest(v2)
    assert m.count == 2000 and m.sources[0]["resumed_shards"] >= 1
    assert store.current_version() == v2


@pytest.mark.slow
def test_two_process_torchrun_matches_single_process(tmp_path, tiny_checkpoint):
    args = [
        "--checkpoint",
        str(tiny_checkpoint),
        "--dataset",
        "synthetic",
        "--size",
        "300",
        "--shard-size",
        "32",
        "--batch-size",
        "64",
        "--no-progress",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "index.cli",
        "build",
        "--root",
        str(tmp_path / "dist"),
        *args,
    ]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("index build: version") == 1  # only rank 0 reports
    from index.cli import main

    assert main(["build", "--root", str(tmp_path / "single"), *args]) == 0
    dist, single = IndexStore(tmp_path / "dist").load(), IndexStore(tmp_path / "single").load()
    assert dist.manifest.world_size == 2 and single.manifest.world_size == 1
    assert dist.ids == single.ids
    np.testing.assert_allclose(dist.embeddings, single.embeddings, atol=1e-6)
    q = single.embeddings[:20]
    np.testing.assert_array_equal(dist.search(q, 10)[1], single.search(q, 10)[1])
    assert dist.manifest.dataset == single.manifest.dataset
