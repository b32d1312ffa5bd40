"""The serving forward (search/serving/inference.py) per backend against the eager torch encoder.

For each tower — the default ViT (configs/synthetic.toml's) and configs/folder.toml's 32-pixel
ResNet — and each batch size (1: a lone request; 8 and 32: micro-batches under load), CPU time of
one forward (`time.thread_time`, one torch / ONNX Runtime thread) for eager torch under
`inference_mode` (the baseline: what `encoder(x)` costs a plain server), the traced + frozen
TorchScript copy and the ONNX Runtime session. Backends run interleaved, in alternating order,
for `--rounds` rounds of `--calls` calls; rows give the median over rounds and the ratio to
eager (< 1 = less CPU). Every copy is checked against eager first (max |dz|).

    .venv/bin/python bench/serving_encoder.py          # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from _common import row, write_results

from search.serving.inference import InferenceEncoder
from training.config import load_train_config
from training.encoder import create_encoder

ROOT = Path(__file__).resolve().parents[1]
TOWERS = {"default ViT": "synthetic.toml", "folder ResNet": "folder.toml"}


def forward_cpu_us(fn, x: torch.Tensor, calls: int) -> float:
    """CPU microseconds per call of fn(x), averaged over `calls` calls (one round)."""
    t0 = time.thread_time()
    for _ in range(calls):
        fn(x)
    return (time.thread_time() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--calls", type=int, default=200, help="calls per backend and round at batch 1 (fewer for larger)"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for tower, config_file in TOWERS.items():
        config = load_train_config(ROOT / "configs" / config_file, [])
        torch.manual_seed(0)
        encoder = create_encoder(config.encoder).eval()
        copies = {"eager": InferenceEncoder(encoder, optimise=False)}
        for backend in ("torchscript", "onnxruntime"):
            copy = InferenceEncoder(encoder, backends=(backend,))
            if copy.kind == backend:
                copies[backend] = copy
                rows.append(row(f"{tower}: {backend} build time", copy.build_s, "s", None))
        for batch in args.batch_sizes:
            x = (
                torch.rand(
                    batch,
                    3,
                    encoder.image_size,
                    encoder.image_size,
                    generator=torch.Generator().manual_seed(batch),
                )
                * 2
                - 1
            )
            ref = copies["eager"](x)
            calls = max(5, args.calls // batch)
            times: dict[str, list[float]] = {name: [] for name in copies}
            for name, copy in copies.items():
                copy(x)  # warm-up (first ONNX Runtime / TorchScript runs allocate)
                if name != "eager":
                    err = float(np.abs(copy(x) - ref).max())
                    rows.append(row(f"{tower}: {name} b={batch} max |z - z_eager|", err, "abs", None))
            for r in range(args.rounds):
                order = list(copies.items())
                for name, copy in order if r % 2 == 0 else order[::-1]:
                    times[name].append(forward_cpu_us(copy, x, calls))
            base = statistics.median(times["eager"])
            for name in copies:
                value = statistics.median(times[name])
                rows.append(row(f"{tower}: {name} b={batch} CPU per forward", value, "us", base))
                print(f"{tower} b={batch} {name}: {value:.0f} us ({value / base:.2f}x eager)", flush=True)
    write_results("serving_encoder", rows)


if __name__ == "__main__":
    main()
