"""Where the milliseconds of one query go: POST /v1/search/vector and POST /v1/search (image) at 10^5 x 512.

Each serving step is timed on its own, in this process, on the same index version the server loads,
one query at a time, 1 torch thread: the median CPU time of `--repeats` runs on this thread (each
row's baseline column holds the median wall time; on a machine other processes load, CPU time is
the figure to read). Steps: JSON parsing and validation (the standard library's and orjson's), the
binary body, the per-query path the server had before (the exact normaliser's pass, mapped pages
released after each block and kept, then FAISS's flat search), the one-pass exact scan that
replaced both (search/serving/exact_scan.py: log Z and the top-k; alone, and per query in a batch
of 16), the response, the metrics; the image query adds the upload's decode and the encoder forward
(a default tower with 512-dimensional output over the same vectors, so its search half is the
vector query's). Then whole requests over HTTP at one client, as the server process tree's CPU time
per request (`softsearch serve` in a subprocess for the vector route; the image route on the same
snapshot served by uvicorn in a subprocess; mapped pages kept): what the steps do not account for is
the HTTP server, the ASGI middleware and the event loop. The database is bench/_vectordb_data.py's
clustered vectors (the vs_vectordb.py setting).

    python bench/profile_query.py                    # ~2 minutes on 2 shared cores
    python bench/profile_query.py --n 20000 --repeats 20
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import row, write_results  # noqa: E402
from _vectordb_data import flat_store  # noqa: E402

logger = logging.getLogger("bench.profile_query")


#: wall-clock medians of each step, next to the CPU-time medians `timed` returns
WALL: dict[str, float] = {}


def timed(fn, repeats: int, name: str | None = None) -> float:
    """Median CPU time of `fn()` on this thread, in ms (one untimed warm-up call first): on a machine other
    processes load, a step's own CPU time is what its wall time would be on a quiet one (every step here
    runs on the calling thread: numpy and torch with 1 thread). The wall-clock median goes to WALL."""
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append((time.thread_time() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    if name is not None:
        WALL[name] = statistics.median(wall)
    return statistics.median(cpu)


def http_median(
    url: str, path: str, bodies: list[bytes], content_type: str, repeats: int, pid: int, name: str
) -> float:
    """The server's CPU time (its process tree) per request, in ms, over `repeats` sequential POSTs on one
    keep-alive connection; their median wall latency goes to WALL[name]."""
    import http.client

    from vs_vectordb import tree_cpu_s

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    lat = []
    for i in range(repeats + 3):
        if i == 3:
            cpu0 = tree_cpu_s(pid)
        t0 = time.perf_counter()
        conn.request("POST", path, bodies[i % len(bodies)], {"Content-Type": content_type})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, resp.status
        if i >= 3:
            lat.append((time.perf_counter() - t0) * 1e3)
    cpu = (tree_cpu_s(pid) - cpu0) * 1e3 / repeats
    conn.close()
    WALL[name] = statistics.median(lat)
    return cpu


def image_server(version_dir: str, port: int) -> None:
    """Child process: the app over Searcher.from_parts(a 512-d default tower, the version), served by
    uvicorn."""
    import torch
    import uvicorn

    from api.app import create_app
    from api.config import Settings
    from index.store import IndexStore
    from search.serving.normaliser import NormaliserConfig
    from search.serving.searcher import Searcher
    from training.encoder import EncoderConfig, create_encoder

    torch.set_num_threads(1)
    torch.manual_seed(0)
    store = IndexStore(Path(version_dir))
    version = store.load()
    encoder = create_encoder(EncoderConfig(embed_dim=version.embeddings.shape[1])).eval()
    app = create_app(
        Settings(port=port),
        Searcher.from_parts(encoder, version, normaliser=NormaliserConfig("exact", release_pages=False)),
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--work", type=Path, default=Path("/tmp/softsearch_vectordb"))
    p.add_argument("--name", default="profile_query")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)
    from api.batching import QueryResult
    from api.config import Settings
    from api.deps import decode_image
    from api.launch import free_port, serve_process, server_process
    from api.metrics import Metrics
    from api.routes.models import VectorQuery
    from api.routes.search import result_body
    from index.store import IndexStore
    from search.serving.normaliser import NormaliserConfig, log_normaliser
    from search.serving.queries import unit_queries
    from search.serving.searcher import Searcher
    from training.encoder import EncoderConfig, create_encoder
    from training.images import cache_resolution

    args.work.mkdir(parents=True, exist_ok=True)
    root, base, queries = flat_store(args.work, args.n, args.dim, args.clusters, 100)
    version = IndexStore(root).load()
    snap = Searcher.from_parts(
        create_encoder(EncoderConfig(embed_dim=args.dim)).eval(),
        version,
        normaliser=NormaliserConfig("exact", release_pages=False),
    ).snapshot()
    emb = snap.index.embeddings
    q = queries[:1]
    body = json.dumps({"vector": q[0].tolist(), "k": 10}).encode()
    taus = np.array([snap.temperature])
    r = {}
    r["parse: json.loads"] = timed(lambda: json.loads(body), args.repeats, "parse: json.loads")
    name = "validate: VectorQuery"
    r[name] = (
        timed(lambda: VectorQuery.model_validate(json.loads(body)), args.repeats, name)
        - r["parse: json.loads"]
    )
    WALL[name] -= WALL["parse: json.loads"]
    r["unit vector"] = timed(lambda: unit_queries(q[0], args.dim), args.repeats, "unit vector")
    r["normaliser pass (pages released)"] = timed(
        lambda: log_normaliser(q, emb, taus, release=True), args.repeats, "normaliser pass (pages released)"
    )
    r["normaliser pass (pages kept)"] = timed(
        lambda: log_normaliser(q, emb, taus, release=False), args.repeats, "normaliser pass (pages kept)"
    )
    r["FAISS flat search k=10"] = timed(
        lambda: snap.index.search(q, 10), args.repeats, "FAISS flat search k=10"
    )
    from search.serving.exact_scan import ExactScanner

    for release in (False, True):
        scan = ExactScanner(emb, release=release)
        r[f"exact scan, log Z + top-10 in one pass ({'pages released' if release else 'pages kept'})"] = (
            timed(lambda: scan(q, taus, 10), args.repeats, "scan1" if not release else "scan1r")
        )
    q16, taus16 = queries[:16], np.full(16, snap.temperature)
    scan = ExactScanner(emb)
    name = "exact scan, batch of 16, per query (pages kept)"
    r[name] = timed(lambda: scan(q16, taus16, 10), args.repeats, name) / 16
    WALL[name] /= 16
    raw = q[0].astype("<f4").tobytes()
    r["binary body: np.frombuffer"] = timed(
        lambda: np.frombuffer(raw, dtype="<f4"), args.repeats, "binary body: np.frombuffer"
    )
    import orjson

    r["orjson.loads + VectorQuery"] = timed(
        lambda: VectorQuery.model_validate(orjson.loads(body)), args.repeats, "orjson.loads + VectorQuery"
    )
    r["searcher.search (unit vector, scan, hits)"] = timed(
        lambda: snap.search(q, 10), args.repeats, "searcher.search (unit vector, scan, hits)"
    )
    answer = snap.search(q, 10)
    result = QueryResult(
        answer[0],
        answer.version,
        answer.temperatures[0],
        answer.log_normalisers[0],
        1,
        snap.count,
        answer.normalisers[0],
    )
    r["response: model + JSON"] = timed(
        lambda: result_body(result, 10).model_dump_json(), args.repeats, "response: model + JSON"
    )
    r["response: model + orjson (served)"] = timed(
        lambda: orjson.dumps(result_body(result, 10).model_dump()),
        args.repeats,
        "response: model + orjson (served)",
    )
    metrics = Metrics()
    r["metrics: counter + histogram"] = timed(
        lambda: (
            metrics.queries.labels(kind="vector").inc(),
            metrics.latency.labels(route="/v1/search/vector", method="POST").observe(0.01),
            metrics.requests.labels(route="/v1/search/vector", method="POST", status="200").inc(),
        ),
        args.repeats,
        "metrics: counter + histogram",
    )
    # image steps: decode a PNG upload, one encoder forward
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    png = buf.getvalue()
    side = cache_resolution(snap.encoder.image_size)
    settings = Settings()
    pixels = decode_image(png, settings, side=side)
    r["image: decode PNG"] = timed(
        lambda: decode_image(png, settings, side=side), args.repeats, "image: decode PNG"
    )
    r["image: encoder forward (1 image)"] = timed(
        lambda: snap.encode([pixels]), args.repeats, "image: encoder forward (1 image)"
    )

    # whole requests over HTTP, one client
    bodies = [json.dumps({"vector": v.tolist(), "k": 10}).encode() for v in queries[:32]]
    with serve_process(root, "--normaliser", "exact", "--mapped-pages", "keep") as server:
        name = "HTTP vector request, JSON (1 client)"
        r[name] = http_median(
            server.url, "/v1/search/vector", bodies, "application/json", args.repeats, server.proc.pid, name
        )
        name = "HTTP vector request, binary (1 client)"
        r[name] = http_median(
            server.url,
            "/v1/search/vector?k=10",
            [v.astype("<f4").tobytes() for v in queries[:32]],
            "application/octet-stream",
            args.repeats,
            server.proc.pid,
            name,
        )
    from http_load import BOUNDARY, multipart

    port = free_port()
    argv = [sys.executable, __file__, "--image-server", str(root), str(port)]
    with server_process(argv, port, timeout_s=300) as server:
        name = "HTTP image request (1 client)"
        r[name] = http_median(
            server.url,
            "/v1/search",
            [multipart(png)],
            f"multipart/form-data; boundary={BOUNDARY}",
            args.repeats,
            server.proc.pid,
            name,
        )
    steps_vec = (
        r["orjson.loads + VectorQuery"]
        + r["searcher.search (unit vector, scan, hits)"]
        + r["response: model + orjson (served)"]
        + r["metrics: counter + histogram"]
    )
    r["vector: HTTP, middleware, event loop (JSON request - steps)"] = (
        r["HTTP vector request, JSON (1 client)"] - steps_vec
    )
    steps_img = (
        r["image: decode PNG"]
        + r["image: encoder forward (1 image)"]
        + r["searcher.search (unit vector, scan, hits)"]
        + r["response: model + orjson (served)"]
        + r["metrics: counter + histogram"]
    )
    r["image: HTTP, multipart, middleware, event loop (request - steps)"] = (
        r["HTTP image request (1 client)"] - steps_img
    )
    WALL["scan1"], WALL["scan1r"] = WALL.get("scan1"), WALL.get("scan1r")
    walls = {
        "exact scan, log Z + top-10 in one pass (pages kept)": WALL["scan1"],
        "exact scan, log Z + top-10 in one pass (pages released)": WALL["scan1r"],
    }
    # value: CPU ms (this thread, or the server's process tree per request); baseline: the wall-clock median
    rows = [row(case, value, "ms CPU", walls.get(case, WALL.get(case))) for case, value in r.items()]
    load = os.getloadavg()
    write_results(
        args.name,
        rows,
        machine_note=f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end; "
        f"{args.n} x {args.dim}, {args.repeats} repeats",
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--image-server":
        image_server(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(main())
