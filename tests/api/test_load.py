"""Bounded load test: `softsearch serve` in a subprocess, 32 concurrent clients on loopback."""

from __future__ import annotations

import httpx
import pytest
from api_helpers import percentile, png_bytes, run_load

from api.launch import serve_process

CLIENTS = 32
DURATION_S = 10.0


@pytest.mark.slow
def test_32_clients_zero_errors(api_index, api_dataset, tmp_path):
    with serve_process(api_index["root"], log_path=tmp_path / "server.log", timeout_s=60) as server:
        url = server.url
        payloads = [png_bytes(api_dataset.image(i)) for i in range(16)]

        def send(http, rng):
            return http.post(
                "/v1/search",
                files={"file": ("q.png", payloads[int(rng.integers(16))], "image/png")},
                data={"k": "10"},
            )

        res = run_load(url, CLIENTS, DURATION_S, send)
        lat = res["latencies"]
        print(
            f"\nload: {CLIENTS} clients x {DURATION_S:.0f} s: {res['requests']} requests, "
            f"{res['qps']:.1f} req/s, p50 {percentile(lat, 50) * 1e3:.1f} ms, "
            f"p99 {percentile(lat, 99) * 1e3:.1f} ms, "
            f"errors {len(res['errors'])}"
        )
        assert not res["errors"], res["errors"][:5]
        assert res["requests"] >= CLIENTS
        metrics = httpx.get(url + "/metrics").text
        batch_sum = next(
            float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("softsearch_batch_size_sum")
        )
        batch_count = next(
            float(l.split()[-1]) for l in metrics.splitlines() if l.startswith("softsearch_batch_size_count")
        )
        assert batch_sum == res["requests"] and batch_sum / batch_count > 1  # load was batched
