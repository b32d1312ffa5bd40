"""softsearch against a vector database's server and the plainest FastAPI + FAISS server, in one run.

Same vectors for all (bench/_vectordb_data.py: N unit vectors of dimension D around `--clusters` random
centres, `--queries` held-out queries drawn the same way), same load tool, same k:

* softsearch: `softsearch serve` over a flat version built from the vectors, exact normaliser (every
  answer carries p(j|x) over the whole index), default batching, 1 torch thread; POST /v1/search/vector
  with a JSON body (`json`) and with the binary float32 body (`binary`).
* softsearch-ann (`softsearch-ann-json`, `softsearch-ann-binary`): the same server over an approximate
  version (`--ann-kind`, default hnsw, its knob tuned at build to `--ann-target-recall` on stored rows)
  with `--ann-normaliser` (default bounded: log Z estimated within its standard error from a few thousand
  rows, the first 200 answers' log Z checked here against a float64 brute force). When these run, the
  exact systems and the plain server serve the same version (the exact path never searches its index).
* plain: bench/plain_server.py --vectors (FastAPI + faiss.IndexFlatIP, similarities only).
* chroma: `chroma run` (Chroma's Rust server), one collection with HNSW cosine and Chroma's defaults,
  filled through its Python client, queried with the JSON body its client sends for `collection.query`
  (the client's default `include`). Returns no probability.

Servers run one at a time on 127.0.0.1. The load tool is closed-loop: `c` threads in this process, each on
its own keep-alive connection (http.client, bodies built once: ~0.1 ms of client CPU per request), POSTing
a random held-out query and reading the whole answer before the next. Per server: recall@k over all
held-out queries against the exact float32 top-k, then QPS, p50/p99 and the server's CPU time per
answered query (its process tree's user + system time over the run: the figure the machine's other
load disturbs least) at each client count, then the resident memory of its process tree. softsearch's
probabilities are checked against a float64 brute force. The machine's load average (other processes share it)
is recorded before and after every server.

    python bench/vs_vectordb.py                              # 10^5 x 512: ~10 minutes on 2 shared cores
    python bench/vs_vectordb.py --n 20000 --duration 3 --systems softsearch-binary chroma
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import closed_loop, row, write_results  # noqa: E402
from _vectordb_data import flat_store  # noqa: E402

logger = logging.getLogger("bench.vs_vectordb")
SYSTEMS = (
    "softsearch-json",
    "softsearch-binary",
    "softsearch-ann-json",
    "softsearch-ann-binary",
    "plain",
    "chroma",
)
CHROMA_QUERY = "/api/v2/tenants/default_tenant/databases/default_database/collections/{}/query"


def tree_rss_mib(pid: int) -> float:
    """Resident memory (MiB) of a process and all its descendants, from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and its descendants (/proc/PID/stat; children
    that have exited are counted in their parent's cutime/cstime)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, IndexError, ValueError):
            continue
    return total


def load_ms(url: str, path: str, bodies: list[bytes], headers: dict, clients: int, duration: float) -> dict:
    """The shared closed-loop load (bench/_common.py), p50 and p99 in ms."""
    res = closed_loop(url, path, bodies, headers, clients, duration)
    return {**res, "p50": res["p50"] * 1e3, "p99": res["p99"] * 1e3}


def answers(url: str, path: str, bodies: list[bytes], headers: dict, threads: int = 4) -> list[dict]:
    """Every body POSTed once (in `threads` parallel connections); the parsed JSON answers, in order."""
    host, port = url.removeprefix("http://").split(":")
    out: list[dict | None] = [None] * len(bodies)

    def worker(part: range) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        for i in part:
            conn.request("POST", path, bodies[i], headers)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{path}: {resp.status} {data[:300]!r}")
            out[i] = json.loads(data)
        conn.close()

    ts = [threading.Thread(target=worker, args=(range(j, len(bodies), threads),)) for j in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(o is not None for o in out), "a request failed (see the log)"
    return out  # type: ignore[return-value]


def exact_top(base: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """The exact float32 top-k rows of every query (ground truth for recall)."""
    from search.serving.exact_scan import ExactScanner

    scan = ExactScanner(base)
    return np.concatenate(
        [
            scan(queries[i : i + 64], np.ones(len(queries[i : i + 64])), k).rows
            for i in range(0, len(queries), 64)
        ]
    )


def recall(found: list[list[str]], truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(f[:k]) & {str(t) for t in row_}) / k for f, row_ in zip(found, truth)]))


@contextlib.contextmanager
def softsearch_server(
    root: Path,
    mapped_pages: str,
    batch_workers: int | str = "auto",
    normaliser: str = "exact",
    workers: int = 1,
    linger_ms: float | str = "auto",
    overlap: str = "off",
    balance: str = "on",
):
    from api.launch import serve_process

    with serve_process(
        root,
        "--workers",
        workers,
        "--normaliser",
        normaliser,
        "--mapped-pages",
        mapped_pages,
        "--watch-interval-s",
        0,
        "--batch-workers",
        batch_workers,
        "--batch-linger-ms",
        linger_ms,
        "--normaliser-overlap",
        overlap,
        "--balance-connections",
        balance,
        torch_threads=1,
        timeout_s=300,
        ready=_all_workers_ready(workers),
    ) as server:
        yield server


def _all_workers_ready(workers: int):
    """A ready check: every worker process has its index loaded (softsearch_workers in GET /metrics), then a
    moment for the last one to start listening, so the load's connections spread over all of them."""

    def check(server) -> bool:
        try:
            text = http_get(server.url, "/metrics").decode()
        except OSError:
            return False
        found = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        if (
            float(found.get("softsearch_ready", 0)) != 1
            or float(found.get("softsearch_workers", 0)) < workers
        ):
            return False
        time.sleep(2.0 if workers > 1 else 0.0)
        return True

    return check


def http_get(url: str, path: str) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        return conn.getresponse().read()
    finally:
        conn.close()


@contextlib.contextmanager
def plain_server(root: Path):
    from api.launch import free_port, server_process
    from index.store import IndexStore

    store = IndexStore(root)
    version_dir = root / "versions" / store.current_version()
    port = free_port()
    argv = [
        sys.executable,
        str(Path(__file__).resolve().parent / "plain_server.py"),
        "--vectors",
        str(version_dir),
        str(port),
    ]
    with server_process(argv, port, ready=_ready("/openapi.json"), timeout_s=300) as server:
        yield server


def _ready(path: str):
    from api.launch import http_ready

    return http_ready(path)


def fill_chroma(path: Path, base: np.ndarray, batch: int = 4096) -> float | None:
    """Add to collection `bench` of the persistent Chroma directory `path` the rows of `base` it lacks (ids
    are row numbers), a chunk at a time through Chroma's in-process client, logging progress: an interrupted
    fill resumes where it stopped. Returns the seconds spent adding, None when nothing was missing."""
    import chromadb

    client = chromadb.PersistentClient(path=str(path))
    col = client.get_or_create_collection("bench", metadata={"hnsw:space": "cosine"})
    have = col.count()
    if have == base.shape[0]:
        return None
    batch = min(batch, client.get_max_batch_size())
    logger.info("chroma %s: %d of %d rows present, adding the rest", path, have, base.shape[0])
    t0, added = time.perf_counter(), 0
    for start in range(0, base.shape[0], batch):
        stop = min(base.shape[0], start + batch)
        ids = [str(i) for i in range(start, stop)]
        present = set(col.get(ids=ids, include=[])["ids"]) if have else set()
        missing = [i for i in range(start, stop) if str(i) not in present]
        if missing:
            col.add(ids=[str(i) for i in missing], embeddings=base[missing])
            added += len(missing)
            dt = time.perf_counter() - t0
            logger.info(
                "chroma fill: %d / %d rows (%.0f rows/s, %.0f s left at this rate)",
                stop,
                base.shape[0],
                added / dt,
                (base.shape[0] - stop) / max(added / dt, 1e-9),
            )
    return time.perf_counter() - t0


@contextlib.contextmanager
def chroma_server(work: Path, base: np.ndarray):
    """Chroma's server over a persistent directory holding collection `bench` (its missing rows added first,
    `fill_chroma`). Yields (server, collection id, fill seconds or None when nothing was added)."""
    import chromadb

    from api.launch import free_port, server_process

    path = work / f"chroma_{base.shape[0]}x{base.shape[1]}"
    fill_s = fill_chroma(path, base)
    if fill_s is not None:
        logger.info("chroma: rows added in %.0f s", fill_s)
    port = free_port()
    argv = [
        shutil.which("chroma") or str(Path(sys.executable).parent / "chroma"),
        "run",
        "--path",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with server_process(argv, port, ready=_ready("/api/v2/heartbeat"), timeout_s=300) as server:
        client = chromadb.HttpClient(host="127.0.0.1", port=port)
        col = client.get_collection("bench")
        if col.count() != base.shape[0]:
            raise RuntimeError(f"chroma {path}: {col.count()} rows, expected {base.shape[0]}")
        yield server, str(col.id), fill_s


def measure(
    name: str,
    server,
    path: str,
    bodies: list[bytes],
    headers: dict,
    ids_of,
    truth: np.ndarray,
    clients: list[int],
    duration: float,
) -> tuple[dict, list[dict]]:
    load_before = os.getloadavg()[0]
    got = answers(server.url, path, bodies, headers)
    out = {"recall": recall([ids_of(a) for a in got], truth), "answers": got, "load_before": load_before}
    load_ms(server.url, path, bodies, headers, 4, min(2.0, duration))  # warm-up
    for c in clients:
        batches0 = batch_sizes(server.url) if name.startswith("softsearch") else None
        cpu0, own0 = tree_cpu_s(server.proc.pid), time.process_time()
        res = load_ms(server.url, path, bodies, headers, c, duration)
        res["cpu_ms"] = (tree_cpu_s(server.proc.pid) - cpu0) * 1e3 / max(res["n"], 1)
        res["client_cpu_ms"] = (time.process_time() - own0) * 1e3 / max(res["n"], 1)
        if batches0 is not None:  # queries per batch the server formed during this load
            (q0, b0), (q1, b1) = batches0, batch_sizes(server.url)
            res["mean_batch"] = (q1 - q0) / max(b1 - b0, 1)
        out[c] = res
        logger.info(
            "%s c=%d: %.0f qps, p50 %.1f ms, p99 %.1f ms, %d errors, CPU ms/query server %.2f client %.2f",
            name,
            c,
            res["qps"],
            res["p50"],
            res["p99"],
            res["errors"],
            res["cpu_ms"],
            res["client_cpu_ms"],
        )
    out["rss"] = tree_rss_mib(server.proc.pid)
    out["load_after"] = os.getloadavg()[0]
    return out, got


def batch_sizes(url: str) -> tuple[float, float]:
    """(queries, batches) so far from softsearch's softsearch_batch_size histogram (GET /metrics)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for key in found:
            if line.startswith(f"softsearch_batch_size_{key} "):
                found[key] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def probability_error(
    got: list[dict], base: np.ndarray, queries: np.ndarray, tau: float, m: int = 200
) -> tuple[float, float]:
    """(largest |p - p_exact| over the hits, largest |log Z - log Z_exact|) over the first `m` answers, the
    exact values by float64 brute force."""
    worst = worst_z = 0.0
    for start in range(0, min(m, len(got)), 50):
        stop = min(m, len(got), start + 50)
        x = queries[start:stop].astype(np.float64)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        s = np.concatenate(
            [x @ base[i : i + 65536].astype(np.float64).T for i in range(0, len(base), 65536)], axis=1
        )
        log_z = np.logaddexp.reduce(s / tau, axis=1)
        for a, row_s, lz in zip(got[start:stop], s, log_z):
            worst_z = max(worst_z, abs(a["log_normaliser"] - lz))
            for h in a["results"]:
                worst = max(worst, abs(h["probability"] - math.exp(row_s[int(h["id"])] / tau - lz)))
    return worst, worst_z


def _get_json(url: str, path: str) -> dict:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path)
    data = conn.getresponse().read()
    conn.close()
    return json.loads(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per load measurement")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument(
        "--mapped-pages",
        default="auto",
        choices=("auto", "release", "keep"),
        help="softsearch's serve --mapped-pages",
    )
    p.add_argument(
        "--batch-workers",
        nargs="+",
        default=["auto"],
        help="softsearch's serve --batch-workers (a number or auto, the default); several: each softsearch "
        "system runs with each",
    )
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1],
        help="softsearch's serve --workers (default 1); several: each softsearch system runs with each",
    )
    p.add_argument(
        "--batch-linger-ms",
        nargs="+",
        default=["auto"],
        help="softsearch's serve --batch-linger-ms (ms or auto, the default); several: each softsearch "
        "system runs with each",
    )
    p.add_argument(
        "--overlap",
        nargs="+",
        default=["off"],
        choices=("on", "off"),
        help="softsearch's serve --normaliser-overlap (default off); both: each softsearch system runs "
        "with each",
    )
    p.add_argument(
        "--balance",
        nargs="+",
        default=["on"],
        choices=("on", "off"),
        help="softsearch's serve --balance-connections (default on); both: each softsearch system runs "
        "with each",
    )
    p.add_argument(
        "--ann-kind", default="hnsw", help="index kind of the softsearch-ann systems (default hnsw)"
    )
    p.add_argument(
        "--ann-target-recall",
        type=float,
        default=0.999,
        help="recall@10 on stored rows the ANN knob is tuned to at build (held-out queries recall less)",
    )
    p.add_argument("--ann-normaliser", default="bounded", choices=("exact", "bounded", "auto"))
    p.add_argument(
        "--ann-params", type=json.loads, default=None, help="index params as JSON, e.g. '{\"nlist\": 1024}'"
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/softsearch_vectordb"),
        help="folder of the stores and Chroma's directory, kept and reused between runs",
    )
    p.add_argument(
        "--fill-only",
        action="store_true",
        help="only build the softsearch store and add Chroma's missing rows (resumable), then exit",
    )
    p.add_argument("--name", default="vs_vectordb")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if "chroma" in args.systems:
        try:
            import chromadb  # noqa: F401
        except ImportError:  # `make bench` without the bench extra: the rest still runs
            logger.warning("chromadb is not installed (pip install -e '.[bench]'): Chroma is left out")
            args.systems = [s for s in args.systems if s != "chroma"]
    args.work.mkdir(parents=True, exist_ok=True)
    # with an ANN version at hand the exact systems serve it too: the exact path never searches the index
    # (one pass gives log Z and the exact top-k), and the plain server builds its own flat index
    ann_root = None
    if any(s.startswith("softsearch-ann") for s in args.systems):
        ann_root, base, queries = flat_store(
            args.work,
            args.n,
            args.dim,
            args.clusters,
            args.queries,
            kind=args.ann_kind,
            params=args.ann_params,
            target_recall=args.ann_target_recall,
        )
        root = ann_root
    else:
        root, base, queries = flat_store(args.work, args.n, args.dim, args.clusters, args.queries)
    if args.fill_only:
        if "chroma" in args.systems:
            fill_chroma(args.work / f"chroma_{base.shape[0]}x{base.shape[1]}", base)
        logger.info("filled: store %s%s", root, ", chroma" if "chroma" in args.systems else "")
        return 0
    truth = exact_top(base, queries, args.k)
    from index.store import IndexStore

    tau = IndexStore(root).load().manifest.temperature
    json_bodies = [json.dumps({"vector": q.tolist(), "k": args.k}).encode() for q in queries]
    results: dict[str, dict] = {}
    notes: dict[str, str] = {}
    variants = [
        (w, b, g, o, bal)
        for w in args.workers
        for b in args.batch_workers
        for g in args.batch_linger_ms
        for o in args.overlap
        for bal in args.balance
    ]

    def label_of(system: str, w: int, b, g: str, o: str, bal: str) -> str:
        if len(variants) == 1 or not system.startswith("softsearch"):
            return system
        linger = f" linger{g}" if len(args.batch_linger_ms) > 1 or g != "auto" else ""
        over = f" overlap-{o}" if len(args.overlap) > 1 else ""
        bal_ = f" balance-{bal}" if len(args.balance) > 1 else ""
        return f"{system} w{w} bw{b}{linger}{over}{bal_}"

    runs = [
        (label_of(s, w, b, g, o, bal), s, w, b, g, o, bal)
        for s in args.systems
        for w, b, g, o, bal in (variants if s.startswith("softsearch") else [(1, 1, "auto", "off", "on")])
    ]
    for label, system, workers, batch_workers, linger_ms, overlap, balance in runs:
        logger.info("%s ...", label)
        if system.startswith("softsearch"):
            binary = system.endswith("binary")
            ann = system.startswith("softsearch-ann")
            with softsearch_server(
                ann_root if ann else root,
                args.mapped_pages,
                batch_workers,
                args.ann_normaliser if ann else "exact",
                workers,
                linger_ms,
                overlap,
                balance,
            ) as server:
                described = _get_json(server.url, "/v1/index")
                path = f"/v1/search/vector?k={args.k}" if binary else "/v1/search/vector"
                bodies = [q.astype("<f4").tobytes() for q in queries] if binary else json_bodies
                headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
                out, got = measure(
                    label,
                    server,
                    path,
                    bodies,
                    headers,
                    lambda a: [h["id"] for h in a["results"]],
                    truth,
                    args.clients,
                    args.duration,
                )
            out["prob_error"], out["log_z_error"] = probability_error(got, base, queries, tau)
            methods = {a["normaliser"]["method"] for a in got}
            manifest = described.get("manifest") or {}
            notes[label] = (
                f"{manifest.get('kind')} {manifest.get('params')}, normaliser "
                f"{'/'.join(sorted(methods))} (served: {described.get('normaliser')}), "
                f"max |log Z - exact| {out['log_z_error']:.1e}, max |p - p_exact| {out['prob_error']:.1e}"
            )
        elif system == "plain":
            with plain_server(root) as server:
                out, _ = measure(
                    system,
                    server,
                    "/search/vector",
                    json_bodies,
                    {"Content-Type": "application/json"},
                    lambda a: a["ids"],
                    truth,
                    args.clients,
                    args.duration,
                )
            notes[system] = "FastAPI + faiss.IndexFlatIP, no probabilities"
        else:
            with chroma_server(args.work, base) as (server, col_id, fill_s):
                bodies = [
                    json.dumps(
                        {
                            "ids": None,
                            "query_embeddings": [q.tolist()],
                            "n_results": args.k,
                            "where": None,
                            "where_document": None,
                            "include": ["metadatas", "documents", "distances"],
                        }
                    ).encode()
                    for q in queries
                ]
                out, _ = measure(
                    system,
                    server,
                    CHROMA_QUERY.format(col_id),
                    bodies,
                    {"Content-Type": "application/json"},
                    lambda a: a["ids"][0],
                    truth,
                    args.clients,
                    args.duration,
                )
            import chromadb

            notes[system] = (
                f"Chroma {chromadb.__version__} server, HNSW cosine defaults, no probabilities"
                + (f"; filled in {fill_s:.0f} s" if fill_s else "")
            )
        out.pop("answers", None)
        results[label] = out

    rows = []
    ref = results.get("chroma")
    for system, out in results.items():
        rows.append(
            row(f"{system} recall@{args.k}", out["recall"], "fraction", ref["recall"] if ref else None)
        )
        for c in args.clients:
            r, b = out[c], (ref[c] if ref else None)
            rows += [
                row(f"{system} c={c} qps", r["qps"], "req/s", b["qps"] if b else None),
                row(f"{system} c={c} p50", r["p50"], "ms", b["p50"] if b else None),
                row(f"{system} c={c} p99", r["p99"], "ms", b["p99"] if b else None),
                row(f"{system} c={c} server CPU per query", r["cpu_ms"], "ms", b["cpu_ms"] if b else None),
                row(f"{system} c={c} errors", r["errors"], "count", None),
            ]
            if "mean_batch" in r:
                rows.append(row(f"{system} c={c} mean batch", r["mean_batch"], "queries", None))
        rows.append(row(f"{system} rss", out["rss"], "MiB", ref["rss"] if ref else None))
        rows.append(
            row(f"{system} load average before / after", out["load_before"], "load", out["load_after"])
        )
        if "prob_error" in out:
            rows.append(row(f"{system} max |p - p_exact|", out["prob_error"], "probability", None))
            rows.append(row(f"{system} max |log Z - exact|", out["log_z_error"], "nats", None))
    print()
    header = (
        "| system | recall@{k} | QPS {cs} | p50 ms {cs} | p99 ms {cs} | server CPU ms / query {cs} | RSS MiB "
        "| load avg |"
    ).format(k=args.k, cs=" / ".join(f"c={c}" for c in args.clients))
    print(header)
    print("|" + "---|" * 8)
    for system, out in results.items():
        cs = args.clients
        qps = " / ".join(f"{out[c]['qps']:.0f}" for c in cs)
        p50 = " / ".join(f"{out[c]['p50']:.1f}" for c in cs)
        p99 = " / ".join(f"{out[c]['p99']:.1f}" for c in cs)
        cpu = " / ".join(f"{out[c]['cpu_ms']:.1f}" for c in cs)
        print(
            f"| {system} | {out['recall']:.3f} | {qps} | {p50} | {p99} | {cpu} | {out['rss']:.0f} | "
            f"{out['load_before']:.1f} -> {out['load_after']:.1f} |"
        )
    for system, note in notes.items():
        print(f"  {system}: {note}")
    load = os.getloadavg()
    policy = os.sched_getscheduler(0)
    sched = (
        f"scheduling SCHED_RR priority {os.sched_getparam(0).sched_priority} (servers and load tool alike)"
        if policy == os.SCHED_RR
        else "scheduling SCHED_FIFO (servers and load tool alike)"
        if policy == os.SCHED_FIFO
        else f"scheduling normal, nice {os.nice(0)} (servers and load tool alike)"
    )
    print(f"  {sched}")
    write_results(
        args.name,
        rows,
        machine_note=(
            f"{args.n} x {args.dim}, {args.clusters} clusters, {args.queries} held-out queries, k={args.k}, "
            f"{args.duration:g} s per load; softsearch --mapped-pages {args.mapped_pages} --workers "
            f"{'/'.join(map(str, args.workers))} --batch-workers {'/'.join(map(str, args.batch_workers))} "
            f"--batch-linger-ms {'/'.join(args.batch_linger_ms)} "
            f"--normaliser-overlap {'/'.join(args.overlap)} --balance-connections {'/'.join(args.balance)}; "
            f"{sched}; load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
            f"(other processes share this machine); " + "; ".join(f"{s}: {n}" for s, n in notes.items())
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
