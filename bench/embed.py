"""Embedding throughput: index.embed (DataLoader, skip handling, resumable shards) vs a plain loop.

The plain loop is the least a caller could write: `encoder(dataset.tensors(batch))` under
`torch.inference_mode()` over the same items with the same batch size and model. The ratio
column is images/s of index.embed over the loop's (1.0 = no overhead from sharding, skip
checks and shard writes).

    .venv/bin/python bench/embed.py [--size 2048] [--batch-size 256] [--workers 0 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
import torch
from _common import row, write_results

from index.embed import embed_dataset
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder


def plain_loop(encoder, dataset, batch_size: int) -> np.ndarray:
    out = []
    with torch.inference_mode():
        for start in range(0, len(dataset), batch_size):
            idx = np.arange(start, min(start + batch_size, len(dataset)))
            out.append(encoder(dataset.tensors(idx)).numpy())
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2048, help="synthetic images to embed")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--shard-size", type=int, default=8192)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1], help="DataLoader num_workers values")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--width", type=int, default=64, help="encoder width (default: the EncoderConfig default)")
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    encoder = create_encoder(EncoderConfig(width=args.width, layers=args.layers)).eval()
    dataset = create_dataset("synthetic", split="train", size=args.size, seed=0)
    n = len(dataset)

    plain_loop(encoder, dataset, args.batch_size)  # warm-up: lazy inits and allocator growth are not timed
    best_plain, cpu_plain, ref = float("inf"), float("inf"), None
    best = {w: float("inf") for w in args.workers}
    cpu0 = float("inf")
    for _ in range(args.repeats):  # interleave so both see the same background load
        t0, c0 = time.perf_counter(), time.process_time()
        ref = plain_loop(encoder, dataset, args.batch_size)
        best_plain = min(best_plain, time.perf_counter() - t0)
        cpu_plain = min(cpu_plain, time.process_time() - c0)
        for w in args.workers:
            with tempfile.TemporaryDirectory() as tmp:  # fresh cache: no resumed shards
                t0, c0 = time.perf_counter(), time.process_time()
                res = embed_dataset(
                    encoder,
                    dataset,
                    tmp,
                    key="bench",
                    shard_size=args.shard_size,
                    batch_size=args.batch_size,
                    num_workers=w,
                    progress=False,
                )
                best[w] = min(best[w], time.perf_counter() - t0)
                if w == 0:
                    cpu0 = min(cpu0, time.process_time() - c0)
            # same numbers as the plain loop, or the comparison is meaningless
            assert np.allclose(res.embeddings, ref, atol=1e-5), "index.embed disagrees with the plain loop"
    rows = [row(f"plain loop b{args.batch_size} wall", n / best_plain, "img/s", None)]
    for w in args.workers:
        rows.append(
            row(f"index.embed b{args.batch_size} workers={w} wall", n / best[w], "img/s", n / best_plain)
        )
    if 0 in args.workers:
        # CPU seconds of this process: less sensitive to other users of the machine than wall time
        rows.append(
            row(f"index.embed b{args.batch_size} workers=0 cpu", n / cpu0, "img/cpu-s", n / cpu_plain)
        )
    write_results("embed", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
