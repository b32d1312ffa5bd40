"""`softsearch serve --workers 2` in a subprocess: metrics scraped from any worker add up over both
workers, and a new version reaches every worker (admin reload hits one; the other follows `current`)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_helpers import ADMIN_TOKEN, make_checkpoint, png_bytes
from prometheus_client.multiprocess import MultiProcessCollector

from api.launch import serve_process
from index.build import BuildOptions, build_index
from training.datasets import create_dataset

WORKERS = 2


def _per_worker_queries(metrics_dir) -> dict[str, float]:
    """{pid: image queries that worker answered}, read from its own sample file."""
    out = {}
    for path in glob.glob(os.path.join(metrics_dir, "counter_*.db")):
        pid = os.path.basename(path)[len("counter_") : -len(".db")]
        out[pid] = sum(
            s.value
            for m in MultiProcessCollector.merge([path])
            if m.name == "softsearch_queries"
            for s in m.samples
            if s.name == "softsearch_queries_total" and s.labels == {"kind": "image"}
        )
    return out


def _scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", headers={"Connection": "close"}, timeout=30).text
    out = {}
    for line in text.splitlines():
        if not line.startswith("#") and line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.slow
def test_workers_merge_metrics_and_follow_swaps(tmp_path):
    ck_a = make_checkpoint(tmp_path / "a.safetensors", seed=21)
    ck_b = make_checkpoint(tmp_path / "b.safetensors", seed=22)
    root = tmp_path / "index"
    v1 = build_index(
        ck_a, create_dataset("synthetic", split="train", size=64, seed=0), root, BuildOptions(progress=False)
    )
    queries = create_dataset("synthetic", split="test", size=8, seed=0)
    payloads = [png_bytes(queries.image(i)) for i in range(len(queries))]
    metrics_dir = tmp_path / "metrics"
    log_path = tmp_path / "server.log"

    def search(i: int) -> httpx.Response:  # a fresh connection each time, so any worker may answer
        return httpx.post(
            url + "/v1/search",
            files={"file": ("q.png", payloads[i % len(payloads)], "image/png")},
            data={"k": "5"},
            headers={"Connection": "close"},
            timeout=60,
        )

    with serve_process(
        root,
        "--workers",
        WORKERS,
        "--watch-interval-s",
        "0.2",
        "--admin-token",
        ADMIN_TOKEN,
        env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
        log_path=log_path,
        timeout_s=180,
        ready=lambda srv: _scrape_ready(srv.url) >= WORKERS,
        poll_s=0.5,
        stop_timeout_s=30,
    ) as server:
        url = server.url
        sent = 0
        with ThreadPoolExecutor(8) as pool:
            for _ in range(20):  # until both workers have answered some queries
                codes = [r.status_code for r in pool.map(search, range(sent, sent + 16))]
                assert codes == [200] * 16
                sent += 16
                per_worker = _per_worker_queries(metrics_dir)
                if len(per_worker) == WORKERS and all(v > 0 for v in per_worker.values()):
                    break
        per_worker = _per_worker_queries(metrics_dir)
        assert len(per_worker) == WORKERS and all(v > 0 for v in per_worker.values()), per_worker
        assert sum(per_worker.values()) == sent
        for _ in range(6):  # whichever worker answers the scrape reports the sum over both
            m = _scrape(url)
            assert m['softsearch_queries_total{kind="image"}'] == sent
            assert m['softsearch_http_requests_total{method="POST",route="/v1/search",status="200"}'] == sent
            assert m["softsearch_batch_size_sum"] == sent
            assert m["softsearch_workers"] == WORKERS
            assert m[f'softsearch_index_info{{version="{v1}"}}'] == 1

        # a new version: the admin reload reaches one worker, the other follows the store's pointer
        v2 = build_index(
            ck_b,
            create_dataset("synthetic", split="train", size=48, seed=0),
            root,
            BuildOptions(progress=False),
        )
        r = httpx.post(
            url + "/v1/admin/reload", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60
        )
        assert r.status_code == 200 and r.json()["version"] == v2, r.text
        deadline = time.monotonic() + 30
        with ThreadPoolExecutor(8) as pool:
            while True:
                bodies = [r.json() for r in pool.map(search, range(32))]
                if all(b["version"] == v2 and b["count"] == 48 for b in bodies):
                    break
                assert all(b["version"] in (v1, v2) for b in bodies)
                assert time.monotonic() < deadline, "a worker kept serving the old version"
                time.sleep(0.2)
        m = _scrape(url)
        assert (
            m[f'softsearch_index_info{{version="{v2}"}}'] == 1
            and m[f'softsearch_index_info{{version="{v1}"}}'] == 0
        )
        assert m["softsearch_index_items"] == 48
    assert server.proc.returncode == 0, log_path.read_text()


def _scrape_ready(url: str) -> float:
    """Live workers that have an index loaded (0 while the server is starting)."""
    try:
        m = _scrape(url)
    except httpx.HTTPError:
        return 0
    return m.get("softsearch_workers", 0) if m.get("softsearch_ready") == 1 else 0


def test_serve_supervisor_imports_no_model_code():
    """`softsearch serve --workers N` runs uvicorn's supervisor in the CLI process; only the workers
    build the app, so importing the CLI and the server module must not pull in torch or FAISS
    (measured: ~40 MB resident instead of ~1.3 GB, bench/serve_memory.py)."""
    code = (
        "import sys, api.cli, api.server, api.config; "
        "print(sorted(m for m in ('torch', 'faiss', 'api.app', 'search.serving.searcher') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_worker_sets_its_library_threads_before_faiss_loads(tmp_path):
    """A `--workers N` process builds its app in `worker_app`; OpenMP (FAISS) reads its thread count once,
    when FAISS loads, so the count must be in the environment before the app's imports load it. It was
    not: each worker's FAISS and OpenBLAS ran one thread per core, whose idle spinning cost 5.4 ms of CPU
    per query at 16 clients against 1.9 (docs/results.md §30)."""
    code = (
        "import os; os.environ.pop('OMP_NUM_THREADS', None); os.environ.pop('OPENBLAS_NUM_THREADS', None); "
        "from api.server import worker_app; worker_app(); import faiss; "
        "print(os.environ['OMP_NUM_THREADS'], faiss.omp_get_max_threads())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOFTSEARCH_") and "NUM_THREADS" not in k}
    env.update(SOFTSEARCH_WORKERS="2", SOFTSEARCH_BATCH_WORKERS="2", SOFTSEARCH_TORCH_THREADS="1")
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    assert out.stdout.split()[-2:] == ["1", "1"], out.stdout + out.stderr
