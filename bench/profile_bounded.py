"""Where a bounded-normaliser query's milliseconds go over an ANN version (issue #50, round two), 10^5 x 512.

Each step is timed in this process on the version the server loads (bench/vs_vectordb.py's clustered
vectors, the ANN store it builds: `--kind`, default hnsw), 1 torch thread, as the median CPU time of
`--repeats` runs on this thread (wall median beside it; on a loaded machine CPU time is the figure to
read): the index search for the top 100 rows, the bounded normaliser (alone and per query in a batch
of 16), the whole `SearchSnapshot.search` (alone and batched), then whole requests over HTTP at one
client as the server process tree's CPU per request (JSON and binary bodies): the difference is the
HTTP server, the middleware, the route and the event loop. The repeated query is a warm best case (its rows
stay in the cache, it never draws a second sample); the rows "mean over varied queries" time one call per
different held-out query (`--varied`), as the HTTP requests come, and the difference is taken from those.

    python bench/profile_bounded.py                    # after bench/vs_vectordb.py built the ANN store
    python bench/profile_bounded.py --n 20000 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

# as `softsearch serve` sets them (api/server.py): one OpenBLAS / OpenMP thread per call, before numpy loads
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import row, write_results  # noqa: E402
from _vectordb_data import flat_store  # noqa: E402
from profile_query import WALL, http_median, timed  # noqa: E402


def mean_cpu(fn, n: int) -> float:
    """Mean CPU time of fn(0), ..., fn(n - 1) on this thread, in ms (fn(0) once untimed first)."""
    import time

    fn(0)
    c0 = time.thread_time()
    for i in range(n):
        fn(i)
    return (time.thread_time() - c0) * 1e3 / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--kind", default="hnsw")
    p.add_argument("--target-recall", type=float, default=0.999)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--varied", type=int, default=400, help="different held-out queries for the mean rows")
    p.add_argument("--work", type=Path, default=Path("/tmp/softsearch_vectordb"))
    p.add_argument("--name", default="profile_bounded")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    from api.launch import serve_process
    from search.serving.normaliser import NormaliserConfig
    from search.serving.searcher import Searcher

    torch.set_num_threads(1)
    root, base, queries = flat_store(
        args.work, args.n, args.dim, args.clusters, 1000, kind=args.kind, target_recall=args.target_recall
    )
    snap = Searcher(root, normaliser=NormaliserConfig("bounded"), load=True).snapshot()
    norm, index, emb = snap.normaliser, snap.index, snap.index.embeddings
    q1, q16 = queries[:1], queries[:16]
    taus1, taus16 = np.full(1, snap.temperature), np.full(16, snap.temperature)
    top1, top16 = index.search(q1, 100)[1], index.search(q16, 100)[1]
    steps = {
        "index search, top 100, one query": timed(lambda: index.search(q1, 100), args.repeats, "search1"),
        "index search, top 100, batch of 16, per query": timed(
            lambda: index.search(q16, 100), args.repeats, "search16"
        )
        / 16,
        "bounded normaliser, one query": timed(
            lambda: norm(q1, emb, taus1, top_rows=top1), args.repeats, "norm1"
        ),
        "bounded normaliser, batch of 16, per query": timed(
            lambda: norm(q16, emb, taus16, top_rows=top16), args.repeats, "norm16"
        )
        / 16,
        "SearchSnapshot.search (search, normaliser, hits), one query": timed(
            lambda: snap.search(q1, 10), args.repeats, "snap1"
        ),
        "SearchSnapshot.search, batch of 16, per query": timed(
            lambda: snap.search(q16, 10), args.repeats, "snap16"
        )
        / 16,
    }
    # the same steps over `--varied` different held-out queries (mean CPU: each query reads its own rows, and
    # a few draw a second sample; the HTTP figures below average over different queries too)
    many = queries[: args.varied]
    tops = index.search(many, 100)[1]
    one_tau = np.full(1, snap.temperature)
    varied = {
        "index search, top 100, one query at a time, mean over varied queries": mean_cpu(
            lambda i: index.search(many[i : i + 1], 100), len(many)
        ),
        "bounded normaliser, one query at a time, mean over varied queries": mean_cpu(
            lambda i: norm(many[i : i + 1], emb, one_tau, top_rows=tops[i : i + 1]), len(many)
        ),
        "bounded normaliser, batches of 16, per query, mean over varied queries": mean_cpu(
            lambda i: norm(
                many[16 * i : 16 * i + 16],
                emb,
                np.full(16, snap.temperature),
                top_rows=tops[16 * i : 16 * i + 16],
            ),
            len(many) // 16,
        )
        / 16,
        "SearchSnapshot.search, one query at a time, mean over varied queries": mean_cpu(
            lambda i: snap.search(many[i : i + 1], 10), len(many)
        ),
        "SearchSnapshot.search, batches of 16, per query, mean over varied queries": mean_cpu(
            lambda i: snap.search(many[16 * i : 16 * i + 16], 10), len(many) // 16
        )
        / 16,
    }
    steps.update(varied)
    for key, name in (
        ("search16", "index search, top 100, batch of 16, per query"),
        ("norm16", "bounded normaliser, batch of 16, per query"),
        ("snap16", "SearchSnapshot.search, batch of 16, per query"),
    ):
        WALL[name] = WALL.pop(key) / 16
    for key, name in (
        ("search1", "index search, top 100, one query"),
        ("norm1", "bounded normaliser, one query"),
        ("snap1", "SearchSnapshot.search (search, normaliser, hits), one query"),
    ):
        WALL[name] = WALL.pop(key)
    rows_read = norm(q16, emb, taus16, top_rows=top16).rows
    with serve_process(
        root, "--normaliser", "bounded", "--watch-interval-s", 0, torch_threads=1, timeout_s=300
    ) as server:
        json_bodies = [json.dumps({"vector": x.tolist(), "k": 10}).encode() for x in queries]
        bin_bodies = [x.astype("<f4").tobytes() for x in queries]
        steps["HTTP request, JSON body, server CPU"] = http_median(
            server.url,
            "/v1/search/vector",
            json_bodies,
            "application/json",
            args.repeats * 5,
            server.proc.pid,
            "HTTP request, JSON body, server CPU",
        )
        steps["HTTP request, binary body, server CPU"] = http_median(
            server.url,
            "/v1/search/vector?k=10",
            bin_bodies,
            "application/octet-stream",
            args.repeats * 5,
            server.proc.pid,
            "HTTP request, binary body, server CPU",
        )
    alone = steps["SearchSnapshot.search, one query at a time, mean over varied queries"]
    steps["left for HTTP, middleware, route, event loop (JSON)"] = (
        steps["HTTP request, JSON body, server CPU"] - alone
    )
    steps["left for HTTP, middleware, route, event loop (binary)"] = (
        steps["HTTP request, binary body, server CPU"] - alone
    )
    print(
        f"\n{args.n} x {args.dim} {args.kind} ({index.manifest.params}), bounded "
        f"normaliser, rows read per query {rows_read.mean():.0f}"
    )
    print("| step | CPU ms | wall ms |\n|---|---|---|")
    for name, ms in steps.items():
        print(f"| {name} | {ms:.3f} | {WALL.get(name, float('nan')):.3f} |")
    load = os.getloadavg()
    write_results(
        args.name,
        [row(name, ms, "ms CPU", WALL.get(name)) for name, ms in steps.items()]
        + [row("bounded rows read per query", float(rows_read.mean()), "rows", None)],
        machine_note=f"{args.n} x {args.dim} {args.kind}, bounded normaliser, 1 torch thread; baseline "
        f"column = wall median; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
        "(other processes share this machine)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
