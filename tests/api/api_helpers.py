"""Helpers shared by the API tests (imported by name; conftest puts this folder on sys.path)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import torch
import uvicorn

from api.launch import free_port
from training.checkpoint import save_checkpoint
from training.encoder import EncoderConfig, create_encoder

TINY = dict(image_size=32, width=32, layers=1, heads=2, patch_size=8, mlp_ratio=2.0)
ADMIN_TOKEN = "test-admin-token-123"
INDEX_SIZE = 120


def make_checkpoint(path: Path, seed: int, embed_dim: int = 16, temperature: float = 0.2) -> Path:
    """A tiny randomly initialised (seeded) encoder saved as a real checkpoint."""
    torch.manual_seed(seed)
    enc = create_encoder(EncoderConfig(embed_dim=embed_dim, **TINY))
    return save_checkpoint(
        path,
        enc,
        step=0,
        train_config={"seed": seed},
        lineage={"objective": "infonce", "temperature": temperature},
    )


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class ServerThread:
    """uvicorn serving an app on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                access_log=False,
                lifespan="on",
                limit_concurrency=1000,
                proxy_headers=False,
            )
        )  # as `softsearch serve`
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def run_load(url: str, clients: int, duration: float, send) -> dict:
    """`clients` threads each loop `send(http_client, rng) -> httpx.Response` for `duration` s.

    Returns {"requests", "errors" (list of (status, text)), "latencies" (s, sorted), "qps"}.
    """
    import httpx
    import numpy as np

    lat: list[float] = []
    errors: list[tuple[int, str]] = []
    lock = threading.Lock()
    start = time.perf_counter()
    stop_at = start + duration

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    r = send(http, rng)
                    status, text = r.status_code, r.text if r.status_code != 200 else ""
                except httpx.HTTPError as err:
                    status, text = -1, repr(err)
                dt = time.perf_counter() - t0
                with lock:
                    lat.append(dt)
                    if status != 200:
                        errors.append((status, text[:200]))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    lat.sort()
    return {"requests": len(lat), "errors": errors, "latencies": lat, "qps": len(lat) / elapsed}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    import math

    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))]


class SearchClients:
    """`clients` threads posting random query images to `url`/v1/search until the block ends.

    `results` collects (query index, HTTP status or -1, JSON body or error text) of every request.
    """

    def __init__(self, url: str, payloads: list[bytes], clients: int, k: int):
        self.url, self.payloads, self.k = url, payloads, k
        self.results: list[tuple[int, int, object]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, seed: int) -> None:
        import httpx
        import numpy as np

        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self._stop.is_set():
                q = int(rng.integers(len(self.payloads)))
                try:
                    r = http.post(
                        "/v1/search",
                        files={"file": ("q.png", self.payloads[q], "image/png")},
                        data={"k": str(self.k)},
                    )
                    item = (q, r.status_code, r.json() if r.status_code == 200 else r.text)
                except httpx.HTTPError as err:
                    item = (q, -1, repr(err))
                with self._lock:
                    self.results.append(item)

    def wait_for(self, more: int, timeout: float = 20.0) -> None:
        """Block until `more` further requests have completed (or `timeout` seconds passed)."""
        target = len(self.results) + more
        deadline = time.monotonic() + timeout
        while len(self.results) < target and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> "SearchClients":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
