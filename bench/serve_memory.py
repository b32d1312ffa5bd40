"""Resident memory of `softsearch serve` at N = 10^6 with an IVF-PQ index.

The acceptance bound is "index file + model + 300 MiB". "Model" is measured, not guessed: the RSS
of the same server (same encoder, same code, torch and its libraries) on a 2000-item store, i.e.
what serving that model costs before the index grows. The 10^6 store is bench/_scale.py's
(d = 128, IVF-PQ nlist 1024, 32-byte codes: index.faiss ~ 40 MB; embeddings.npy 488 MiB).

Each figure is read from /proc/PID/status (VmRSS = RssAnon + RssFile + RssShmem, VmHWM = peak)
and /proc/PID/smaps_rollup (Pss: shared pages split between the processes mapping them):

- after load: the server answers /readyz (index, ids and encoder loaded, embeddings mapped);
- after queries: `--queries` image uploads later. With the exact normaliser (what `auto` picks at
  N * d = 1.28e8) every query's log Z reads all N rows of the memory-mapped embeddings file, so
  its pages are resident as *file* pages: the OS page cache, shared by every process mapping the
  file and reclaimable, not a private copy. RssAnon is what the process holds privately. The
  `bounded` normaliser (search/serving/normaliser.py) reads a few IVF lists per query instead. Servers:
  auto, bounded, and bounded with `--mapped-pages release` (the default `auto` setting releases the
  exact scan's pages once read and keeps the bounded estimate's scattered reads mapped);
- `--workers 2`: the same after-queries figures for each worker, and the sum of their Pss (the
  machine's real cost of the two) against two separate single-worker servers (2 x RSS).
- the cost of releasing the pages the normaliser read (search/serving/normaliser.py `release_pages`, what
  keeps the mapped file out of the RSS after queries): time per query of `log_normaliser` and of
  `bounded_log_normaliser` on the 10^6 memory map with and without it, interleaved in one process
  (one BLAS thread, like the servers), the baseline without.

    .venv/bin/python bench/serve_memory.py [--root /tmp/softsearch-million] [--queries 64]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _common import row, write_results
from _scale import MILLION, encoder_checkpoint, synthetic_store
from http_load import query_payloads

from api.launch import http_ready, serve_process

logger = logging.getLogger("bench.serve_memory")
MIB = 1 << 20
BUDGET_MIB = 300


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem (status) and Pss (smaps_rollup) of `pid`, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key == "Pss":
                out["Pss"] = int(value.split()[0]) * 1024
    return out


def workers_of(pid: int) -> list[int]:
    """uvicorn's worker processes under `pid` (multiprocessing spawn children; not its resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        kids = [int(c) for c in fh.read().split()]
    out = []
    for kid in kids:
        try:
            with open(f"/proc/{kid}/cmdline", "rb") as fh:
                if b"spawn_main" in fh.read():
                    out.append(kid)
        except FileNotFoundError:
            pass
    return out


class Serve:
    """`softsearch serve` on `root` (api.launch.serve_process) until /readyz answers in every worker
    (with --workers); `url`, `proc`, `ready_s` (start to ready: checksums, index, ids, encoder,
    normaliser)."""

    def __init__(self, root: Path, workers: int = 1, extra: tuple[str, ...] = ()):
        self.root, self.workers, self.extra = root, workers, extra

    def __enter__(self) -> "Serve":
        with contextlib.ExitStack() as stack:
            metrics = stack.enter_context(tempfile.TemporaryDirectory(prefix="serve_memory_metrics_"))
            server = stack.enter_context(
                serve_process(
                    self.root,
                    "--workers",
                    self.workers,
                    *self.extra,
                    timeout_s=600,
                    poll_s=0.5,
                    stop_timeout_s=30,
                    env={"PROMETHEUS_MULTIPROC_DIR": metrics, "OMP_NUM_THREADS": "1"},
                    ready=self._ready,
                )
            )
            self._stack = stack.pop_all()
        self.url, self.proc, self.ready_s = server.url, server.proc, server.ready_s
        return self

    def _ready(self, server) -> bool:
        """/readyz answers and every worker process is up and has loaded the index."""
        self.proc = server.proc
        if not http_ready()(server) or len(self.pids()) != self.workers:
            return False
        self.url = server.url
        return self.workers == 1 or self._live_workers() == self.workers

    def _live_workers(self) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("softsearch_workers "):
                return float(line.split()[-1])
        return 0.0

    def pids(self) -> list[int]:
        """The processes holding the index: the server itself, or its uvicorn workers."""
        return [self.proc.pid] if self.workers == 1 else workers_of(self.proc.pid)

    def query(self, data: list[bytes], n: int) -> None:
        for i in range(n):  # a fresh connection each time, so every worker gets some
            r = httpx.post(
                self.url + "/v1/search",
                files={"file": ("q.png", data[i % len(data)], "image/png")},
                data={"k": "10"},
                headers={"Connection": "close"},
                timeout=120,
            )
            r.raise_for_status()
            self.last = r.json()

    def normaliser_method(self) -> str:
        """How the server computed log Z for a query (the response's normaliser.method)."""
        return self.last.get("normaliser", {}).get("method", "exact")

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


def release_cost(vdir: Path, rounds: int = 8, per_round: int = 8) -> dict[str, list[float]]:
    """Seconds per one-query log Z call on the version's memory map, {"<method> <release|keep>": [per
    round]}; rounds alternate which goes first, and each starts with one untimed call, so `keep` is
    measured in its steady state (every page already mapped) and `release` in its own."""
    import numpy as np

    from index.store import IndexVersion
    from search.serving.normaliser import NormaliserConfig, bounded_log_normaliser, log_normaliser

    version = IndexVersion.load(vdir, verify=False, gpu=False)
    emb, stats = version.embeddings, version.list_stats()
    rng = np.random.default_rng(0)
    q = np.asarray(emb[np.sort(rng.choice(len(version), per_round, replace=False))])
    q = q + 0.05 * rng.standard_normal(q.shape).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    tau = np.array([float(version.manifest.temperature or 0.1)])
    cfg = NormaliserConfig("bounded")
    calls = {
        "exact": lambda x, release: log_normaliser(x, emb, tau, release=release),
        "bounded": lambda x, release: bounded_log_normaliser(x, emb, stats, tau, cfg, release=release),
    }
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for method, call in calls.items():
            for release in (True, False) if r % 2 == 0 else (False, True):
                call(q[:1], release)
                t0 = time.perf_counter()
                for i in range(per_round):
                    call(q[i : i + 1], release)
                out.setdefault(f"{method} {'release' if release else 'keep'}", []).append(
                    (time.perf_counter() - t0) / per_round
                )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--root",
        type=Path,
        default=Path(tempfile.gettempdir()) / "softsearch-million",
        help="directory for the at-scale stores (built once, reused)",
    )
    p.add_argument("--queries", type=int, default=64)
    p.add_argument(
        "--normalisers",
        nargs="+",
        default=["auto", "bounded", "bounded:release"],
        choices=["auto", "exact", "bounded", "auto:keep", "exact:keep", "bounded:release"],
        help="one 10^6 server per normaliser[:--mapped-pages setting] (auto is exact at this N * d; "
        "the default --mapped-pages auto releases the exact scan's pages and keeps bounded's); "
        "--workers 2 uses the first",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help=(
            "extra `softsearch serve` option for the N=1e6 servers (repeatable), e.g. --serve-arg=--max-k=50"
        ),
    )
    p.add_argument("--release-cost", type=Path, default=None, help=argparse.SUPPRESS)  # the timing subprocess
    args = p.parse_args(argv)
    if args.release_cost is not None:
        import json

        print(json.dumps(release_cost(args.release_cost)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.root.mkdir(parents=True, exist_ok=True)
    ck = encoder_checkpoint(args.root / "scale_encoder.safetensors")
    big, big_version = synthetic_store(args.root / "million", MILLION, checkpoint=ck)
    small, _ = synthetic_store(args.root / "small", 2000, kind="flat", checkpoint=ck)
    vdir = big / "versions" / big_version
    index_bytes = (vdir / "index.faiss").stat().st_size
    emb_bytes = (vdir / "embeddings.npy").stat().st_size
    ids_bytes = (vdir / "ids.json").stat().st_size
    from training.checkpoint import load_checkpoint

    data = query_payloads(16, load_checkpoint(ck)[0].image_size)

    with Serve(small) as s:
        s.query(data, args.queries)
        model = proc_memory(s.proc.pid)
    budget = index_bytes + model["VmRSS"] + BUDGET_MIB * MIB
    rows = [
        row("index.faiss (N=1e6, IVF-PQ)", index_bytes / MIB, "MiB", None),
        row("embeddings.npy (N=1e6, d=128, memory-mapped)", emb_bytes / MIB, "MiB", None),
        row("ids.json (N=1e6)", ids_bytes / MIB, "MiB", None),
        row("model: serve RSS on a 2000-item store", model["VmRSS"] / MIB, "MiB", None),
        row("budget: index file + model + 300 MiB", budget / MIB, "MiB", None),
    ]
    extra = tuple(args.serve_arg)
    queried_default = None
    for variant in args.normalisers:
        normaliser, _, pages = variant.partition(":")
        flags = ("--normaliser", normaliser) + (("--mapped-pages", pages) if pages else ())
        tag = f"serve N=1e6 {' '.join(flags)}"
        with Serve(big, extra=(*flags, *extra)) as s:
            loaded = proc_memory(s.proc.pid)
            t0 = time.perf_counter()
            s.query(data, args.queries)
            per_query = (time.perf_counter() - t0) / args.queries
            queried = proc_memory(s.proc.pid)
            method = s.normaliser_method()
        queried_default = queried_default or queried
        rows.append(
            row(
                f"{tag}: normaliser used at this N and d",
                {"exact": 0, "bounded": 1}[method],
                "0 exact / 1 bounded",
                None,
            )
        )
        for label, m in (("after load", loaded), (f"after {args.queries} queries", queried)):
            rows += [
                row(f"{tag}: RSS {label}", m["VmRSS"] / MIB, "MiB", budget / MIB),
                row(f"{tag}: RssAnon {label} (private)", m["RssAnon"] / MIB, "MiB", None),
                row(
                    f"{tag}: RssFile {label} (mapped files: libraries, embeddings)",
                    m["RssFile"] / MIB,
                    "MiB",
                    None,
                ),
                row(
                    f"{tag}: RSS growth over the model {label}",
                    (m["VmRSS"] - model["VmRSS"]) / MIB,
                    "MiB",
                    (index_bytes + BUDGET_MIB * MIB) / MIB,
                ),
                row(
                    f"{tag}: RssAnon growth over the model {label}",
                    (m["RssAnon"] - model["RssAnon"]) / MIB,
                    "MiB",
                    (index_bytes + BUDGET_MIB * MIB) / MIB,
                ),
            ]
        rows += [
            row(
                f"{tag}: seconds from start to ready (bounded: list statistics loaded from the version)",
                s.ready_s,
                "s",
                None,
            ),
            row(f"{tag}: peak RSS (VmHWM)", queried["VmHWM"] / MIB, "MiB", budget / MIB),
            row(f"{tag}: seconds per query (1 client, upload to answer)", per_query, "s", None),
        ]
    queried = queried_default

    first, _, first_pages = args.normalisers[0].partition(":")
    first_flags = ("--normaliser", first) + (("--mapped-pages", first_pages) if first_pages else ())
    with Serve(big, workers=2, extra=(*first_flags, *extra)) as s:
        s.query(data, args.queries)
        per_worker = [proc_memory(pid) for pid in s.pids()]
        supervisor = proc_memory(s.proc.pid)
    rows.append(
        row(
            "--workers 2: supervisor process RSS (holds no model or index)",
            supervisor["VmRSS"] / MIB,
            "MiB",
            None,
        )
    )
    for i, m in enumerate(per_worker):
        rows += [
            row(f"--workers 2: worker {i} RSS after queries", m["VmRSS"] / MIB, "MiB", budget / MIB),
            row(f"--workers 2: worker {i} Pss after queries", m["Pss"] / MIB, "MiB", None),
        ]
    rows.append(
        row(
            f"--workers 2 ({' '.join(first_flags)}): sum of Pss (machine cost) vs two single servers' RSS",
            sum(m["Pss"] for m in per_worker) / MIB,
            "MiB",
            2 * queried["VmRSS"] / MIB,
        )
    )
    import json
    import statistics

    timing = subprocess.run(
        [sys.executable, __file__, "--release-cost", str(vdir)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    cost = json.loads(timing.stdout.strip().splitlines()[-1])
    for method in ("exact", "bounded"):
        released, kept = (statistics.median(cost[f"{method} {k}"]) for k in ("release", "keep"))
        rows.append(
            row(
                f"{method} log Z per query, N=1e6 memory map, in-process: pages released after reading "
                f"(baseline: kept mapped; median of {len(cost[f'{method} keep'])} interleaved rounds)",
                released,
                "s",
                kept,
            )
        )
    note = (
        f"1-min load average {os.getloadavg()[0]:.1f} at the end; "
        f"serve options: {' '.join(extra) or 'defaults'}"
    )
    write_results("serve_memory", rows, machine_note=note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
