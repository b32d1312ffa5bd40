"""Benchmark sharded serving: QPS and p50/p99 of POST /v1/search/vector for one version served whole by
`softsearch serve` (the baseline), the same items as a 2- and a 4-shard version on the single-node server
(in-process fan-out), and as a 1-, 2- and 4-shard version on Ray Serve (`serve --engine ray`: a deployment per
shard, the ingress merging), all in one run on this machine, under the shared closed-loop load tool
(bench/_common.py). Then the build: the same synthetic images embedded and indexed by `index build` in one
process and by `index build --engine ray --shards 2` (Ray tasks, Ray Data actors), rows checked equal. The
ingress's overhead per query is measured apart, where the scan costs next to nothing: a 2000-item version, one
client, sequential queries, Ray 1-shard p50 minus `serve` p50 (the proxy -> ingress -> shard hops and the
merge).

Every configuration answers the same queries; the script first checks that each returns the baseline's ids
and probabilities (to 1e-6) before it times anything.

    .venv/bin/python bench/shards.py                      # 200k x 64 random unit vectors, 8 clients, 8 s each
    .venv/bin/python bench/shards.py --size 50000 --duration 4 --clients 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import closed_loop, percentile, row, write_results

from api.launch import serve_process


def sequential(url: str, bodies: list[dict]) -> list[float]:
    """Latencies (s) of `bodies` posted one after another by one client."""
    out = []
    with httpx.Client(base_url=url, timeout=60) as http:
        for b in bodies:
            t0 = time.perf_counter()
            http.post("/v1/search/vector", json=b).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def make_store(workdir: Path, size: int, dim: int) -> Path:
    """A flat version built from `size` random unit vectors (no encoder: vector queries only)."""
    from index.build import BuildOptions, build_from_vectors

    vectors = np.random.default_rng(0).normal(size=(size, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "vectors.npy"
    np.save(path, vectors)
    root = workdir / "whole"
    build_from_vectors(path, root, BuildOptions(progress=False))
    return root


def sharded_copy(whole: Path, dest: Path, shards: int) -> Path:
    from index.shards import reshard

    shutil.copytree(whole, dest)
    reshard(dest, shards)
    return dest


def load(url: str, bodies: list[dict], clients: int, duration: float) -> dict:
    """The shared closed loop (bench/_common.py): `clients` keep-alive connections posting pre-encoded bodies
    for `duration` s -> QPS, p50, p99 (ms), errors."""
    encoded = [json.dumps(b).encode() for b in bodies]
    r = closed_loop(
        url, "/v1/search/vector", encoded, {"Content-Type": "application/json"}, clients, duration
    )
    return {
        "qps": r["qps"],
        "p50_ms": 1e3 * r["p50"],
        "p99_ms": 1e3 * r["p99"],
        "errors": r["errors"],
        "n": r["n"],
    }


def ray_build(tmp: Path, size: int, shards: int, batch: int) -> list[dict]:
    """Rows: the default encoder (random weights) embedding `size` synthetic images and building a flat
    version, by `build_index` in this process and by `build_on_ray` with `shards` shards (one actor of 1 CPU
    each) on the running Ray; the two versions' rows are checked equal (1e-6) first."""
    import torch

    from index.build import BuildOptions, build_index
    from index.ray_build import build_on_ray
    from index.store import IndexStore
    from training.checkpoint import save_checkpoint
    from training.datasets import create_dataset
    from training.encoder import EncoderConfig, create_encoder

    torch.manual_seed(0)
    ckpt = tmp / "encoder.safetensors"
    save_checkpoint(ckpt, create_encoder(EncoderConfig()), step=0, train_config={}, lineage={})
    ds = create_dataset("synthetic", split="train", size=size)
    opts = BuildOptions(progress=False, batch_size=batch)
    t0 = time.perf_counter()
    build_index(ckpt, ds, tmp / "build-plain", opts)
    plain_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_on_ray(ckpt, ds, tmp / "build-ray", shards, opts)
    ray_s = time.perf_counter() - t0
    a, b = IndexStore(tmp / "build-plain").load(), IndexStore(tmp / "build-ray").load()
    assert a.ids == b.ids and np.abs(np.asarray(a.embeddings) - np.asarray(b.embeddings)).max() <= 1e-6
    t = b.manifest.timings
    rows = [
        row(
            f"index build, {size} synthetic images, one process (embed + flat build + gate)",
            plain_s,
            "s",
            None,
        ),
        row(f"index build --engine ray --shards {shards} (same items)", ray_s, "s", plain_s),
    ]
    rows += [
        row(f"  ray {k.replace('_s', '')}", v, "s", None)
        for k, v in t.items()
        if k.startswith("shard-") or k in ("ray_s",)
    ]
    return rows


def answers(url: str, bodies: list[dict]) -> list[dict]:
    with httpx.Client(base_url=url, timeout=60) as http:
        out = []
        for b in bodies:
            r = http.post("/v1/search/vector", json=b)
            r.raise_for_status()
            out.append(r.json())
        return out


def check_equal(got: list[dict], ref: list[dict], what: str) -> None:
    for g, r in zip(got, ref):
        assert [h["id"] for h in g["results"]] == [h["id"] for h in r["results"]], f"{what}: ids differ"
        diff = max(abs(a["probability"] - b["probability"]) for a, b in zip(g["results"], r["results"]))
        assert diff <= 1e-6, f"{what}: probabilities differ by {diff:g}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of load per configuration")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--no-ray", action="store_true", help="skip the Ray Serve configurations")
    p.add_argument(
        "--overhead-size", type=int, default=2000, help="items of the overhead measurement's version"
    )
    p.add_argument("--overhead-queries", type=int, default=300)
    p.add_argument(
        "--build-size",
        type=int,
        default=2048,
        help="synthetic images of the build comparison (plain vs --engine ray, 2 shards); 0: skip",
    )
    p.add_argument("--build-batch", type=int, default=256)
    p.add_argument(
        "--build-only",
        action="store_true",
        help="only the build comparison (on a local Ray), written to bench/results/shards_build.json",
    )
    args = p.parse_args()
    if args.build_only:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="bench-shards-build-") as tmp:
            rows = ray_build(Path(tmp), args.build_size, 2, args.build_batch)
        ray.shutdown()
        write_results("shards_build", rows, machine_note=f"load average {os.getloadavg()[0]:.1f} at the end")
        return
    rng = np.random.default_rng(1)
    bodies = [{"vector": v.tolist(), "k": args.k} for v in rng.normal(size=(64, args.dim))]
    results: dict[str, dict] = {}
    build_rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        whole = make_store(tmp, args.size, args.dim)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        roots = {"local-2": sharded_copy(whole, tmp / "s2", 2)}
        reshard_s = time.perf_counter() - t0
        roots["local-4"] = sharded_copy(whole, tmp / "s4", 4)
        roots["ray-1"] = sharded_copy(whole, tmp / "r1", 1)
        small = make_store(tmp / "small", args.overhead_size, args.dim)
        small_1 = sharded_copy(small, tmp / "small-1", 1)
        small_bodies = [
            {"vector": v.tolist(), "k": args.k} for v in rng.normal(size=(args.overhead_queries, args.dim))
        ]
        with serve_process(small, "--normaliser", "exact") as server:
            small_ref = answers(server.url, small_bodies[:32])
            answers(server.url, small_bodies[:32])  # warm-up
            overhead = {"whole": sequential(server.url, small_bodies)}
        ref = None
        for name, root in [("whole", whole), ("local-2", roots["local-2"]), ("local-4", roots["local-4"])]:
            with serve_process(root, "--normaliser", "exact") as server:
                got = answers(server.url, bodies)
                ref = ref or got
                check_equal(got, ref, name)
                load(server.url, bodies, args.clients, 1.0)  # warm-up
                results[name] = load(server.url, bodies, args.clients, args.duration)
                print(name, results[name], flush=True)
        if not args.no_ray:
            import ray
            from ray import serve

            from api.ray_serve import APP_NAME, build_app

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            url = f"http://127.0.0.1:{port}"
            serve.run(
                build_app(
                    {
                        "index_root": str(small_1),
                        "watch_interval_s": 0,
                        "torch_threads": 1,
                        "normaliser": "exact",
                    },
                    1,
                ),
                name=APP_NAME,
                route_prefix="/",
            )
            check_equal(answers(url, small_bodies[:32]), small_ref, "overhead ray-1")
            answers(url, small_bodies[:32])
            overhead["ray-1"] = sequential(url, small_bodies)
            serve.delete(APP_NAME)
            for name, root, shards in [
                ("ray-1", roots["ray-1"], 1),
                ("ray-2", roots["local-2"], 2),
                ("ray-4", roots["local-4"], 4),
            ]:
                serve.run(
                    build_app(
                        {
                            "index_root": str(root),
                            "watch_interval_s": 0,
                            "torch_threads": 1,
                            "normaliser": "exact",
                        },
                        shards,
                    ),
                    name=APP_NAME,
                    route_prefix="/",
                )
                check_equal(answers(url, bodies), ref, name)
                load(url, bodies, args.clients, 1.0)
                results[name] = load(url, bodies, args.clients, args.duration)
                print(name, results[name], flush=True)
                serve.delete(APP_NAME)
            serve.shutdown()
            build_rows = ray_build(tmp, args.build_size, 2, args.build_batch) if args.build_size else []
            ray.shutdown()
    base = results["whole"]
    rows = [
        row("build whole version (flat, from vectors)", build_s, "s", None),
        row("reshard into 2 shards", reshard_s, "s", build_s),
    ]
    for name, r in results.items():
        rows += [
            row(f"{name}: QPS", r["qps"], "queries/s", base["qps"]),
            row(f"{name}: p50", r["p50_ms"], "ms", base["p50_ms"]),
            row(f"{name}: p99", r["p99_ms"], "ms", base["p99_ms"]),
            row(f"{name}: failed requests", r["errors"], "requests", None),
        ]
    for name, lat in overhead.items():
        rows.append(
            row(
                f"{args.overhead_size}-item version, 1 client, {name}: p50",
                1e3 * percentile(lat, 50),
                "ms",
                1e3 * percentile(overhead["whole"], 50),
            )
        )
    if "ray-1" in overhead:
        rows.append(
            row(
                "Ray ingress overhead per query (p50 ray-1 - p50 whole, 1 client)",
                1e3 * (percentile(overhead["ray-1"], 50) - percentile(overhead["whole"], 50)),
                "ms",
                None,
            )
        )
    rows += build_rows
    load_avg = os.getloadavg()[0]
    write_results(
        "shards",
        rows,
        machine_note=f"load average {load_avg:.1f} at the end (other jobs share the cores); "
        f"{args.size} x {args.dim} flat, exact normaliser, k={args.k}, "
        f"{args.clients} client threads on this machine, {args.duration:g} s "
        "per configuration",
    )


if __name__ == "__main__":
    main()
