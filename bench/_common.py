"""Shared helpers for benchmark scripts: machine description and the results JSON."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """One line naming the machine: CPU count, platform, torch device if any."""
    desc = (
        f"{platform.machine()} {os.cpu_count()} cpu, {platform.system()} {platform.release()}, "
        f"python {platform.python_version()}"
    )
    try:
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.get_device_name(0)}"
        desc += f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return desc


def row(case: str, value: float, unit: str, baseline: float | None) -> dict:
    """One result row; ratio = value / baseline (None when there is no baseline)."""
    ratio = (value / baseline) if baseline not in (None, 0) else None
    return {"case": case, "value": value, "unit": unit, "baseline": baseline, "ratio": ratio}


def write_results(
    name: str, rows: list[dict], command: str | None = None, machine_note: str | None = None
) -> Path:
    """Print a table and write bench/results/NAME.json in the project's shape (`machine_note`, e.g. the
    load other jobs put on the machine, is appended to the machine line)."""
    command = command or " ".join([Path(sys.executable).name] + sys.argv)
    out = {
        "name": name,
        "rows": rows,
        "machine": machine() + (f"; {machine_note}" if machine_note else ""),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    width = max([len(r["case"]) for r in rows] + [4])
    print(f"{'case':<{width}}  {'value':>12}  {'unit':<10}  {'baseline':>12}  {'ratio':>7}")
    for r in rows:
        base = "-" if r["baseline"] is None else f"{r['baseline']:.4g}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['case']:<{width}}  {r['value']:>12.4g}  {r['unit']:<10}  {base:>12}  {ratio:>7}")
    print(f"wrote {path}")
    return path


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (nan for no values)."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))] if v else float("nan")


def closed_loop(
    url: str, path: str, bodies: list[bytes], headers: dict, clients: int, duration: float
) -> dict:
    """Closed loop: `clients` threads, each on its own keep-alive connection, POST a random pre-encoded body
    and read the whole answer before sending the next. http.client with bodies built once costs the client
    ~0.1 ms per request (httpx: ~1 ms), so on a 2-core machine it takes little of the CPU the servers compete
    for. Latencies and p50/p99 in seconds."""
    import http.client
    import random
    import threading
    import time

    host, port = url.removeprefix("http://").split(":")
    lat: list[float] = []
    errors = 0
    lock = threading.Lock()
    start = time.perf_counter()
    stop_at = start + duration

    def worker(seed: int) -> None:
        nonlocal errors
        rng = random.Random(seed)
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        mine, bad = [], 0
        try:
            while time.perf_counter() < stop_at:
                body = bodies[rng.randrange(len(bodies))]
                t0 = time.perf_counter()
                try:
                    conn.request("POST", path, body, headers)
                    resp = conn.getresponse()
                    resp.read()
                    bad += resp.status != 200
                except (OSError, http.client.HTTPException):
                    bad += 1
                    conn.close()
                    conn = http.client.HTTPConnection(host, int(port), timeout=120)
                mine.append(time.perf_counter() - t0)
        finally:
            conn.close()
        with lock:
            lat.extend(mine)
            errors += bad

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return {
        "qps": len(lat) / elapsed,
        "n": len(lat),
        "errors": errors,
        "elapsed": elapsed,
        "latencies": lat,
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
    }
