"""bench/gpu_check.sh on a machine without a CUDA GPU (CUDA_VISIBLE_DEVICES hides any): it says so and exits
0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_says_there_is_no_gpu_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "gpu_check: no CUDA GPU on this machine" in done.stdout
    assert "nothing to check here" in done.stdout
    assert not (tmp_path / "out").exists()  # nothing was trained or written


def test_gpu_check_helper_without_a_gpu_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--checkpoint", str(tmp_path / "none")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT / "bench",
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU on this machine" in done.stdout
