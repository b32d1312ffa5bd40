"""Benchmark the HTTP service: QPS and p50/p99 latency of POST /v1/search (image upload) at 1, 8
and 32 concurrent clients, with and without micro-batching, against the in-process
encode + search loop (one image per call, no HTTP) as the baseline.

The server is `softsearch serve` in a subprocess on 127.0.0.1 (torch threads 1 in both the
server and the baseline); clients are threads in this process, so on a small machine they
compete with the server for the same cores; the report states the machine.

    .venv/bin/python bench/http_load.py                       # builds a synthetic index (2000 items)
    .venv/bin/python bench/http_load.py --index ROOT --duration 10
"""

from __future__ import annotations

import argparse
import io
import logging
import tempfile
import time
from pathlib import Path

import httpx
import torch
from _common import closed_loop, percentile, row, write_results

from api.launch import serve_process

logger = logging.getLogger("bench.http_load")


def build_bench_index(workdir: Path, size: int) -> Path:
    """A synthetic index built with the default (untrained, seeded) encoder configuration."""
    from index.build import BuildOptions, build_index
    from training.checkpoint import save_checkpoint
    from training.datasets import create_dataset
    from training.encoder import EncoderConfig, create_encoder

    torch.manual_seed(0)
    ck = save_checkpoint(
        workdir / "encoder.safetensors",
        create_encoder(EncoderConfig()),
        step=0,
        train_config={"bench": "http"},
        lineage={"objective": "untrained", "temperature": 0.1},
    )
    root = workdir / "index"
    build_index(
        ck, create_dataset("synthetic", split="train", size=size, seed=0), root, BuildOptions(progress=False)
    )
    return root


def query_payloads(n: int = 32, image_size: int | None = None) -> list[bytes]:
    """`n` synthetic test images as PNG bytes (at `image_size` when given, else the dataset's default)."""
    from training.datasets import create_dataset

    size = {} if image_size is None else {"image_size": image_size, "resolution": image_size}
    ds = create_dataset("synthetic", split="test", size=n, seed=0, **size)
    out = []
    for i in range(n):
        buf = io.BytesIO()
        ds.image(i).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def in_process_baseline(root: Path, payloads: list[bytes], duration: float, batch: int = 1) -> dict:
    """`batch` queries per call: decode PNGs, encode, exact search + softmax; no HTTP, one thread.
    Latency is per call; qps counts queries."""
    from PIL import Image

    from search.serving.searcher import Searcher

    searcher = Searcher(root, load=True)
    lat: list[float] = []
    stop = time.perf_counter() + duration
    i = 0
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        images = [
            Image.open(io.BytesIO(payloads[(i + j) % len(payloads)])).convert("RGB") for j in range(batch)
        ]
        searcher.search_images(images, k=10)
        lat.append(time.perf_counter() - t0)
        i += batch
    lat.sort()
    return {
        "qps": len(lat) * batch / sum(lat),
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "n": len(lat) * batch,
    }


BOUNDARY = "softsearch-bench-boundary"


def multipart(payload: bytes, k: int = 10) -> bytes:
    """The POST body a browser form sends: the image as `file` and `k` (built once per query image)."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="q.png"\r\n'
        f"Content-Type: image/png\r\n\r\n"
    ).encode()
    tail = f'\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name="k"\r\n\r\n{k}\r\n--{BOUNDARY}--\r\n'
    return head + payload + tail.encode()


def run_load(url: str, clients: int, duration: float, bodies: list[bytes], path: str = "/v1/search") -> dict:
    """The closed-loop load (bench/_common.py) of multipart image queries on `path`."""
    return closed_loop(
        url, path, bodies, {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}, clients, duration
    )


def batch_mean(url: str) -> float:
    """Mean of the server's softsearch_batch_size histogram (queries per encoder batch)."""
    text = httpx.get(url + "/metrics").text
    vals = {
        line.split()[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(("softsearch_batch_size_sum", "softsearch_batch_size_count"))
    }
    return vals["softsearch_batch_size_sum"] / max(vals["softsearch_batch_size_count"], 1)


#: (label, batch max size, batch max wait ms, batch workers) of the served configurations
CONFIGS = (
    ("batched", 32, 0.0, 2),
    ("batched-1worker", 32, 0.0, 1),
    ("batched-wait2ms", 32, 2.0, 2),
    ("unbatched", 1, 0.0, 2),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, help="existing index root (default: build a synthetic one)")
    p.add_argument("--size", type=int, default=2000, help="items in the built index")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # same as the server, so the baseline is comparable

    with tempfile.TemporaryDirectory(prefix="bench_http_") as tmp:
        root = args.index or build_bench_index(Path(tmp), args.size)
        payloads = query_payloads()
        base = in_process_baseline(root, payloads, args.duration)
        rows = [
            row("in-process encode+search qps (1 thread)", base["qps"], "req/s", None),
            row("in-process p50", base["p50"] * 1e3, "ms", None),
            row("in-process p99", base["p99"] * 1e3, "ms", None),
        ]
        batched = in_process_baseline(root, payloads, args.duration, batch=32)
        rows.append(row("in-process batch=32 qps (1 thread)", batched["qps"], "req/s", base["qps"]))
        for label, size, wait, workers in CONFIGS:
            with serve_process(
                root, "--batch-max-size", size, "--batch-max-wait-ms", wait, "--batch-workers", workers
            ) as server:
                bodies = [multipart(p) for p in payloads]
                run_load(server.url, 4, 1.0, bodies)  # warm-up
                for c in args.clients:
                    res = run_load(server.url, c, args.duration, bodies)
                    case = f"http {label} c={c}"
                    rows += [
                        row(f"{case} qps", res["qps"], "req/s", base["qps"]),
                        row(f"{case} p50", res["p50"] * 1e3, "ms", base["p50"] * 1e3),
                        row(f"{case} p99", res["p99"] * 1e3, "ms", base["p99"] * 1e3),
                        row(f"{case} errors", res["errors"], "count", None),
                    ]
                rows.append(row(f"http {label} mean batch size", batch_mean(server.url), "queries", None))
    write_results("http", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
