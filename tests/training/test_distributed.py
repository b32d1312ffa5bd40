"""DDP: one 2-process step equals a single-process step on the concatenated batch; a 2-process
torchrun training run equals the single-process run with the same (global) batch."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from training.distributed import DistInfo, average_gradients, distributed_session
from training.losses import available_losses, create_loss
from training.trainer import contrastive_step

ROOT = Path(__file__).resolve().parents[2]
N_PAIRS, WORLD = 8, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch():
    # float64 end to end, so rounding cannot hide (or fake) a mismatch: tolerances are 1e-7.
    g = torch.Generator().manual_seed(123)
    shape = (N_PAIRS, 3, 32, 32)
    return (
        torch.randn(shape, generator=g, dtype=torch.float64),
        torch.randn(shape, generator=g, dtype=torch.float64),
    )


class _SmallEncoder(torch.nn.Module):
    """A stand-in for the ViT: the DDP identity is model-agnostic, and this keeps the spawned
    processes from importing open_clip (seconds each on 2 busy cores)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 8, stride=8),
            torch.nn.GELU(),
            torch.nn.Flatten(),
            torch.nn.Linear(4 * 4 * 4, 8),
        )

    def forward(self, x):
        return torch.nn.functional.normalize(self.net(x), dim=-1)  # (B, 8) unit rows


def _encoder():
    torch.manual_seed(0)
    return _SmallEncoder().double()


def _cases() -> dict[str, tuple[str, dict]]:
    """Every registered loss with its defaults (WEINCE: the paper variant), plus WEINCE's blend variant."""
    return {
        **{name: (name, {}) for name in available_losses()},
        "weince-blend": ("weince", {"variant": "blend"}),
    }


def _one_step(model, encoder, case, view_a, view_b, info):
    """loss, encoder grads and temperature grad of one step (learnable tau to test its averaging)."""
    log_tau = torch.tensor(np.log(0.2), dtype=torch.float64, requires_grad=True)
    loss_name, options = _cases()[case]
    out = contrastive_step(model, create_loss(loss_name, **options), view_a, view_b, log_tau.exp(), info)
    encoder.zero_grad(set_to_none=True)
    out.loss.backward()
    average_gradients([log_tau], info)
    grads = {k: p.grad.detach().clone().numpy() for k, p in encoder.named_parameters()}
    return out.loss.item(), grads, log_tau.grad.item(), out.stats


def _worker(rank, port, out_dir):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    with distributed_session("cpu") as info:
        encoder = _encoder()
        model = torch.nn.parallel.DistributedDataParallel(encoder)
        view_a, view_b = _batch()
        n = N_PAIRS // WORLD
        local = slice(rank * n, (rank + 1) * n)
        result = {}
        for name in _cases():
            loss, grads, tau_grad, stats = _one_step(model, encoder, name, view_a[local], view_b[local], info)
            loss = torch.tensor(loss, dtype=torch.float64)
            torch.distributed.all_reduce(loss)  # mean of the per-rank losses = global mean
            result[name] = {"loss": float(loss) / WORLD, "tau_grad": tau_grad, "stats": stats}
            if rank == 0:
                np.savez(Path(out_dir) / f"{name}.npz", **grads)
        if rank == 0:
            (Path(out_dir) / "result.json").write_text(json.dumps(result))


def test_ddp_step_equals_single_process(tmp_path, monkeypatch):
    """(a) loss and every parameter gradient of one 2-rank DDP step == the single-process step (1e-5)."""
    monkeypatch.syspath_prepend(str(ROOT))  # spawned children import this module as tests.training...
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    view_a, view_b = _batch()
    assert set(result) == set(_cases())
    for name in _cases():
        encoder = _encoder()
        loss, grads, tau_grad, stats = _one_step(encoder, encoder, name, view_a, view_b, DistInfo())
        assert result[name]["loss"] == pytest.approx(loss, rel=1e-7), name
        assert result[name]["tau_grad"] == pytest.approx(tau_grad, rel=1e-7, abs=1e-12), name
        for key, value in stats.items():  # batch statistics are global on every rank
            assert result[name]["stats"][key] == pytest.approx(value, rel=1e-7, abs=1e-9), (name, key)
        ddp = np.load(tmp_path / f"{name}.npz")
        assert set(ddp.files) == set(grads)
        for key, ref in grads.items():
            err = np.linalg.norm(ddp[key] - ref)
            assert err <= 1e-7 * np.linalg.norm(ref) + 1e-12, (name, key, err, np.linalg.norm(ref))


@pytest.mark.slow
def test_torchrun_two_processes_match_single_process(tmp_path):
    """(b) `torchrun --nproc-per-node 2` == one process with the same global batch, 20 steps."""
    common = [
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--set",
        "steps=20",
        "--set",
        "checkpoint_every=10",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # the same entry point as the `softsearch train` console script
    launcher = tmp_path / "softsearch_train.py"
    launcher.write_text("import sys\nfrom training.trainer import main\nsys.exit(main())\n")
    # `python -m torch.distributed.run` is torchrun (also where a venv has no torchrun script)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(launcher),
        *common,
        "--out",
        str(tmp_path / "ddp"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]

    from safetensors.torch import load_file

    from training.checkpoint import read_checkpoint_metadata
    from training.trainer import main

    assert main([*common, "--out", str(tmp_path / "single")]) == 0
    rows = {
        k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
        for k in ("ddp", "single")
    }
    assert len(rows["ddp"]) == len(rows["single"]) == 20
    for a, b in zip(rows["ddp"], rows["single"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), (a["step"], a["loss"], b["loss"])
    meta = read_checkpoint_metadata(tmp_path / "ddp" / "checkpoint.safetensors")
    assert meta["step"] == 20 and meta["lineage"]["world_size"] == 2
    ddp, single = (load_file(str(tmp_path / k / "checkpoint.safetensors")) for k in ("ddp", "single"))
    init = load_file(str(tmp_path / "single" / "init.safetensors"))
    # Adam amplifies float rounding on near-zero gradients, so compare the whole update, not each entry:
    # |theta_ddp - theta_single| must be tiny next to |theta_single - theta_init|.
    diff = torch.sqrt(sum(((ddp[k] - single[k]) ** 2).sum() for k in single))
    moved = torch.sqrt(sum(((single[k] - init[k]) ** 2).sum() for k in single))
    assert float(diff) < 1e-2 * float(moved), (float(diff), float(moved))


def test_one_torchrun_environment_reader(monkeypatch):
    """training.distributed.torchrun_env is what index embedding reads too (index.embed.dist_env)."""
    from index.embed import dist_env
    from training.distributed import torchrun_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() == dist_env() == (0, 1, 0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchrun_env() == dist_env() == (3, 4, 1)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match="LOCAL_RANK='one' is not an integer"):
        dist_env()
