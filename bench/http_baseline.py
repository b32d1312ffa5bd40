"""The product's POST /v1/search against the plainest server a user would write instead.

Both servers run at once, in subprocesses on 127.0.0.1, over the same index version: `softsearch
serve` (api/) and bench/plain_server.py (~30 lines: FastAPI + faiss.IndexFlatIP over the version's
embeddings, the version's checkpoint, the same decode and preprocessing, no probabilities, no
batching, no limits or metrics). One closed-loop client (threads in this process, each on a
keep-alive connection POSTing a random query image as multipart form data and reading the answer
before the next; http.client with pre-built bodies, so the client costs little of the machine the
servers share) drives one server at a time at 1, 8 and 32 clients, in interleaved rounds (the order alternates
every round), so the shared machine's load hits both alike; rows pool each server's rounds (QPS = answers /
seconds, p50 / p99 over all latencies) and give the product / plain ratio, with the median and the worst of
the per-round ratios. Both get the same torch thread count (`--torch-threads`, default 1), the product its
default batching.

Cases: a folder index of the tuxpaint clip-art corpus (configs/folder.toml's tower, queries = 64
of its real PNG files, uploaded as they are on disk) and a synthetic index (2000 items, the
default tower, queries = 64 held-out images as PNGs). Before timing, every query goes to both
servers and their top-10 ids are compared (the product's exact similarities vs FAISS's flat
scores: the same ranking, up to the order of exactly tied items). The folder encoder is trained
here for `--folder-train-steps` (80 steps of batch 32, a few minutes; an untrained tower ranks
clip art by near-ties) unless `--folder-checkpoint` names one; the synthetic one is seeded and
untrained unless `--synthetic-checkpoint` names one (speed does not depend on the weights).

    .venv/bin/python bench/http_baseline.py                  # ~7 minutes on 2 shared cores
    .venv/bin/python bench/http_baseline.py --rounds 2 --duration 4 --cases folder
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import torch
from _common import row, write_results
from http_load import multipart, percentile, query_payloads, run_load

from api.launch import free_port, http_ready, serve_argv, server_process

logger = logging.getLogger("bench.http_baseline")
ROOT = Path(__file__).resolve().parents[1]
TUXPAINT = Path("/usr/share/tuxpaint/stamps")
N_QUERIES = 64
TOP = 10


def _checkpoint(path: Path, encoder_config) -> Path:
    from training.checkpoint import save_checkpoint
    from training.encoder import create_encoder

    torch.manual_seed(0)
    return save_checkpoint(
        path,
        create_encoder(encoder_config),
        step=0,
        train_config={"bench": "http_baseline"},
        lineage={"objective": "untrained", "temperature": 0.1},
    )


def train_folder(work: Path, steps: int) -> Path:
    """A short configs/folder.toml run (batch 32): an untrained tower maps every clip-art image to
    nearly the same point (median pairwise cosine 0.99996), where top-10 lists are all near-ties."""
    from training.config import load_train_config
    from training.trainer import train

    config = load_train_config(
        ROOT / "configs" / "folder.toml",
        [
            f'out_dir="{work / "folder_train"}"',
            f"steps={steps}",
            "batch_size=32",
            "warmup_steps=8",
            "checkpoint_every=100000",
            "num_workers=0",
            "progress=false",
            f'cache_dir="{work / "image_cache"}"',
        ],
    )
    return train(config)


def build_case(name: str, work: Path, checkpoint: Path | None, train_steps: int = 80) -> dict:
    """{root, version_dir, checkpoint, square, payloads, items} for one case."""
    from index.build import BuildOptions, build_index
    from training.datasets import create_dataset
    from training.encoder import EncoderConfig

    if name == "folder":
        checkpoint = checkpoint or train_folder(work, train_steps)
        from training.checkpoint import load_checkpoint

        size = load_checkpoint(checkpoint)[0].image_size
        ds = create_dataset(
            "folder",
            split="all",
            root=str(TUXPAINT),
            image_size=size,
            cache_dir=str(work / "image_cache"),
            progress=False,
        )
        files = sorted(glob.glob(str(TUXPAINT / "**" / "*.png"), recursive=True))
        random.Random(0).shuffle(files)
        payloads = [Path(f).read_bytes() for f in files[:N_QUERIES]]
    else:
        checkpoint = checkpoint or _checkpoint(work / "synthetic.safetensors", EncoderConfig())
        ds = create_dataset("synthetic", split="train", size=2000, seed=0)
        payloads = query_payloads(N_QUERIES)
    root = work / f"{name}_index"
    version = build_index(checkpoint, ds, root, BuildOptions(progress=False))
    return {
        "root": root,
        "version_dir": root / "versions" / version,
        "checkpoint": checkpoint,
        "square": name == "folder",
        "payloads": payloads,
        "items": len(ds),
    }


class Proc:
    """A server subprocess (api.launch.server_process), ready once `ready_path` answers 200; it
    searches at `search_path`."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, search_path: str):
        self.cmd, self.port, self.ready_path, self.search_path = cmd, port, ready_path, search_path
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Proc":
        self._launch = server_process(
            self.cmd,
            self.port,
            ready=http_ready(self.ready_path, timeout_s=2),
            timeout_s=180,
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
        self._launch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._launch.__exit__(*exc)


def top(server: Proc, payload: bytes) -> list[tuple[str, float]]:
    """[(id, similarity)] of the top TOP answers."""
    r = httpx.post(
        server.url + server.search_path,
        files={"file": ("q.png", payload, "image/png")},
        data={"k": str(TOP)},
        timeout=60,
    )
    r.raise_for_status()
    body = r.json()
    if "results" in body:
        return [(h["id"], h["similarity"]) for h in body["results"]]
    return list(zip(body["ids"], body["scores"]))


def same_top(a: list[tuple[str, float]], b: list[tuple[str, float]], tol: float = 1e-6) -> tuple[bool, bool]:
    """(identical id lists, the same ranking up to ties): positions are grouped into runs of scores
    tied within `tol`; each run must hold the same ids on both sides, except the run at the cut,
    which may hold different members of a tie that continues past rank TOP (FAISS breaks ties
    either way)."""
    ids_a, ids_b = [i for i, _ in a], [i for i, _ in b]
    if ids_a == ids_b:
        return True, True
    if len(a) != len(b):
        return False, False
    runs, start = [], 0
    for j in range(1, len(a) + 1):
        if j == len(a) or abs(a[j][1] - a[j - 1][1]) > tol:
            runs.append((start, j))
            start = j
    for r, (lo, hi) in enumerate(runs):
        if any(abs(b[j][1] - a[j][1]) > tol for j in range(lo, hi)):
            return False, False
        if r < len(runs) - 1 and sorted(ids_a[lo:hi]) != sorted(ids_b[lo:hi]):
            return False, False
    return False, True


def batch_stats(server: Proc) -> tuple[float, float]:
    """(sum, count) of the product's softsearch_batch_size histogram."""
    vals = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("softsearch_batch_size_sum", "softsearch_batch_size_count")):
            vals[line.split()[0]] = float(line.split()[-1])
    return vals.get("softsearch_batch_size_sum", 0.0), vals.get("softsearch_batch_size_count", 0.0)


def run_case(name: str, case: dict, args) -> list[dict]:
    threads = str(args.torch_threads)
    product_port, plain_port = free_port(), free_port()
    product = Proc(
        serve_argv(case["root"], product_port, torch_threads=args.torch_threads),
        product_port,
        "/readyz",
        "/v1/search",
    )
    plain = Proc(
        [
            sys.executable,
            str(ROOT / "bench" / "plain_server.py"),
            str(case["version_dir"]),
            str(case["checkpoint"]),
            str(plain_port),
            "1" if case["square"] else "0",
            threads,
        ],
        plain_port,
        "/openapi.json",
        "/search",
    )
    rows = []
    with product, plain:
        checks = [same_top(top(product, p), top(plain, p)) for p in case["payloads"]]
        n = len(checks)
        rows += [
            row(
                f"{name}: queries with the same top-{TOP} ids (ties at the cut in either order)",
                sum(t for _, t in checks),
                "queries",
                n,
            ),
            row(
                f"{name}: queries with identical top-{TOP} id lists", sum(i for i, _ in checks), "queries", n
            ),
        ]
        bodies = [multipart(p, TOP) for p in case["payloads"]]
        for server in (product, plain):
            run_load(server.url, 4, 1.0, bodies, server.search_path)  # warm-up
        lat = {(s, c): [] for s in ("product", "plain") for c in args.clients}
        seconds = {key: 0.0 for key in lat}
        count = {key: 0 for key in lat}
        ratios = {c: [] for c in args.clients}
        batches = {c: [0.0, 0.0] for c in args.clients}
        for r in range(args.rounds):
            for ci, c in enumerate(args.clients):
                order = [("product", product), ("plain", plain)]
                if (r + ci) % 2:
                    order.reverse()
                qps = {}
                for label, server in order:
                    if (
                        args.warmup > 0
                    ):  # discarded: the server that sat idle during the other's run warms up first
                        run_load(server.url, c, args.warmup, bodies, server.search_path)
                    before = batch_stats(server) if label == "product" else None
                    res = run_load(server.url, c, args.duration, bodies, server.search_path)
                    if res["errors"]:
                        raise RuntimeError(
                            f"{label} answered {res['errors']} requests with errors at {c} clients"
                        )
                    lat[label, c] += res["latencies"]
                    seconds[label, c] += res["elapsed"]
                    count[label, c] += res["n"]
                    qps[label] = res["qps"]
                    if before is not None:
                        after = batch_stats(server)
                        batches[c][0] += after[0] - before[0]
                        batches[c][1] += after[1] - before[1]
                ratios[c].append(qps["product"] / qps["plain"])
                logger.info(
                    "%s round %d, %d clients: product %.1f qps, plain %.1f qps",
                    name,
                    r,
                    c,
                    qps["product"],
                    qps["plain"],
                )
    for c in args.clients:
        q = {s: count[s, c] / seconds[s, c] for s in ("product", "plain")}
        p = {s: sorted(lat[s, c]) for s in ("product", "plain")}
        rows += [
            row(f"{name}: c={c} qps", q["product"], "req/s", q["plain"]),
            row(
                f"{name}: c={c} p50",
                percentile(p["product"], 50) * 1e3,
                "ms",
                percentile(p["plain"], 50) * 1e3,
            ),
            row(
                f"{name}: c={c} p99",
                percentile(p["product"], 99) * 1e3,
                "ms",
                percentile(p["plain"], 99) * 1e3,
            ),
            row(f"{name}: c={c} qps ratio, median of rounds", statistics.median(ratios[c]), "ratio", None),
            row(f"{name}: c={c} qps ratio, worst round", min(ratios[c]), "ratio", None),
            row(
                f"{name}: c={c} product mean batch size",
                batches[c][0] / max(batches[c][1], 1),
                "queries",
                None,
            ),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["folder", "synthetic"], choices=["folder", "synthetic"])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument(
        "--duration", type=float, default=4.0, help="seconds per server per round and client count"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds of discarded load before each timed run (same clients), so neither server is "
        "timed straight out of idling through the other's run",
    )
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads of both servers")
    p.add_argument("--folder-checkpoint", type=Path)
    p.add_argument("--synthetic-checkpoint", type=Path)
    p.add_argument("--folder-train-steps", type=int, default=80)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_http_baseline_") as tmp:
        for name in args.cases:
            case = build_case(name, Path(tmp), getattr(args, f"{name}_checkpoint"), args.folder_train_steps)
            logger.info("%s: %d items indexed", name, case["items"])
            rows += run_case(name, case, args)
    load_end = os.getloadavg()
    note = (
        f"shared with other work: 1-min load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at "
        f"the end (5-min {load_end[1]:.1f}); both servers torch threads {args.torch_threads}; "
        f"{args.rounds} interleaved rounds x {args.duration:g} s per server and client count, each after "
        f"{args.warmup:g} s of discarded warm-up load"
    )
    write_results("http_baseline", rows, machine_note=note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
