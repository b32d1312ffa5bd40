"""Bounded load test: `softsearch serve` in a subprocess, 32 concurrent clients on loopback."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from api_helpers import free_port, percentile, png_bytes, run_load

CLIENTS = 32
DURATION_S = 10.0


@pytest.mark.slow
def test_32_clients_zero_errors(api_index, api_dataset, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "api.server", "--index", str(api_index["root"]),
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                             "--torch-threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.2)
        payloads = [png_bytes(api_dataset.image(i)) for i in range(16)]

        def send(http, rng):
            return http.post("/v1/search", files={"file": ("q.png", payloads[int(rng.integers(16))], "image/png")},
                             data={"k": "10"})

        res = run_load(url, CLIENTS, DURATION_S, send)
        lat = res["latencies"]
        print(f"\nload: {CLIENTS} clients x {DURATION_S:.0f} s: {res['requests']} requests, {res['qps']:.1f} req/s, "
              f"p50 {percentile(lat, 50) * 1e3:.1f} ms, p99 {percentile(lat, 99) * 1e3:.1f} ms, "
              f"errors {len(res['errors'])}")
        assert not res["errors"], res["errors"][:5]
        assert res["requests"] >= CLIENTS
        metrics = httpx.get(url + "/metrics").text
        batch_sum = next(float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("softsearch_batch_size_sum"))
        batch_count = next(float(l.split()[-1]) for l in metrics.splitlines()
                           if l.startswith("softsearch_batch_size_count"))
        assert batch_sum == res["requests"] and batch_sum / batch_count > 1  # load was batched
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
