"""The streamed build at 10^6 .. 3x10^7 vectors: build time and peak RSS per size, recall@10 of the
served version.

For each size N, clustered vectors (d = 64, the generator of bench/index_kinds.py: unit centres, seed 123,
plus isotropic noise) are generated chunk by chunk with a seed and written to a .npy file, so this script
never holds them. The build is the real command, `softsearch index build --embeddings FILE --kind ivf-pq`
(index/stream.py: trained on a bounded sample, lists on disk, tuned and gated), run in a child process whose
peak RSS is its ru_maxrss (os.wait4). The served version is then loaded as the server loads it
(IndexStore.load) and 1000 held-out query vectors (same distribution, not stored) are searched as the server
searches (faiss_index.search_reranked at the tuned nprobe and re-rank factor); recall@10 against exact search
(faiss.knn over row blocks of the stored vectors, merged).

Baseline, side by side where the vectors fit in RAM (--baseline-max, default 10^7): what a user would
otherwise write, plain FAISS in a child process: np.load the file, normalise,
index_factory("IVF{nlist},PQ{m}x8np") with the same nlist and m, train (FAISS subsamples 256 nlist rows) + add
in one call, searched at the same nprobe without re-ranking. Per size it records build seconds, peak RSS and
recall of both.

Resumable: each finished size is kept in bench/results/build_scale_sizes.json and skipped on a rerun
(--sizes picks sizes; --redo recomputes). The data of a size is deleted after it (--keep-data keeps it).

    # writes bench/results/build_scale.json
    nice -n 19 .venv/bin/python bench/build_scale.py --sizes 1e6,1e7,3e7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _common import RESULTS_DIR, row, write_results

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1 << 18
QUERIES = 1000


def generate(path: Path, n: int, d: int, seed: int, spread: float = 1.0, clusters: int = 256) -> None:
    """n clustered vectors as bench/index_kinds.clustered draws them, written in chunks of CHUNK rows
    (chunk i drawn from default_rng([seed, i])): RAM holds one chunk."""
    from index_kinds import unit

    centres = unit(clusters, d, seed=123)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (n, d)})
        for i, start in enumerate(range(0, n, CHUNK)):
            rng = np.random.default_rng([seed, i])
            b = min(CHUNK, n - start)
            x = centres[rng.integers(0, clusters, b)] + spread * rng.standard_normal(
                (b, d), dtype=np.float32
            ) / np.sqrt(d)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            fh.write(np.ascontiguousarray(x, dtype=np.float32).tobytes())
    os.replace(tmp, path)


def run_child(cmd: list[str], log: Path) -> dict:
    """Run `cmd`, wait for it with os.wait4 -> {"seconds", "peak_rss_mib" (its ru_maxrss), "rc"}."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "seconds": time.perf_counter() - t0,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "rc": proc.returncode,
    }


def baseline_child(path: str, nlist: int, m: int, nprobe: int, queries_path: str, out_path: str) -> None:
    """The plain-FAISS baseline (run in its own process): load, normalise, train + add in RAM, search."""
    import faiss

    t0 = time.perf_counter()
    x = np.load(path)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    index = faiss.index_factory(x.shape[1], f"IVF{nlist},PQ{m}x8np", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    build_s = time.perf_counter() - t0
    index.nprobe = nprobe
    _, rows = index.search(np.load(queries_path), 10)
    np.save(out_path, rows)
    print(json.dumps({"build_s": build_s}))
    Path(out_path + ".json").write_text(json.dumps({"build_s": build_s}))


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(f[f >= 0]) & set(e)) / len(e) for f, e in zip(found, exact)]))


def measure(n: int, args) -> dict:
    from index import faiss_index
    from index.store import IndexStore

    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    data, root = work / f"x_{n}.npy", work / f"store_{n}"
    t0 = time.perf_counter()
    if not data.exists():
        generate(data, n, args.d, seed=n)
    gen_s = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "api.cli",
        "index",
        "build",
        "--root",
        str(root),
        "--embeddings",
        str(data),
        "--kind",
        "ivf-pq",
        "--param",
        f"m={args.m}",
        "--no-progress",
    ]
    print(f"[{n}] building: {' '.join(cmd)}", flush=True)
    build = run_child(cmd, logs / f"bigbuild-build-{n}.log")
    if build["rc"] != 0:
        raise SystemExit(f"build of {n} failed (rc {build['rc']}); see {logs / f'bigbuild-build-{n}.log'}")
    store = IndexStore(root)
    version = store.load(store.current_version(), verify=False, gpu=False)  # what `softsearch serve` loads
    m = version.manifest
    params = dict(m.params)
    qpath = work / f"q_{n}.npy"
    generate(qpath, QUERIES, args.d, seed=10**9 + n)  # held out: never stored
    queries = np.load(qpath)
    t0 = time.perf_counter()
    exact = faiss_index.exact_neighbours(version.embeddings, queries, 10)
    exact_s = time.perf_counter() - t0
    _, served = faiss_index.search_reranked(
        version.index, version.embeddings, queries, 10, faiss_index.rerank_factor(version.kind, params)
    )
    disk = sum(f["bytes"] for f in m.files.values())
    out = {
        "n": n,
        "d": args.d,
        "build_s": build["seconds"],
        "peak_rss_mib": build["peak_rss_mib"],
        "recall": recall(served, exact),
        "target": m.recall.target,
        "params": params,
        "gate_recall": m.quality_gate.recall.served if m.quality_gate else None,
        "timings": m.timings,
        "train_rows": (m.build or {}).get("train_rows"),
        "version_bytes": disk,
        "index_faiss_bytes": m.files["index.faiss"]["bytes"],
        "ivfdata_bytes": m.files["index.ivfdata"]["bytes"],
        "generate_s": gen_s,
        "exact_s": exact_s,
    }
    if n <= args.baseline_max:
        bout = work / f"baseline_{n}.npy"
        bcmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--_baseline",
            str(data),
            str(params["nlist"]),
            str(params["m"]),
            str(params["nprobe"]),
            str(qpath),
            str(bout),
        ]
        print(f"[{n}] baseline: plain FAISS in RAM", flush=True)
        base = run_child(bcmd, logs / f"bigbuild-baseline-{n}.log")
        if base["rc"] == 0:
            inner = json.loads(Path(str(bout) + ".json").read_text())
            out["baseline"] = {
                "wall_s": base["seconds"],
                "build_s": inner["build_s"],
                "peak_rss_mib": base["peak_rss_mib"],
                "recall": recall(np.load(bout), exact),
                "factory": f"IVF{params['nlist']},PQ{params['m']}x8np",
                "nprobe": params["nprobe"],
            }
        else:
            out["baseline"] = {"failed": f"rc {base['rc']}"}
    del version
    if not args.keep_data:
        shutil.rmtree(root, ignore_errors=True)
        for p in work.glob(f"*_{n}.npy*"):
            p.unlink()
    return out


def table(results: dict) -> list[dict]:
    rows = []
    for key in sorted(results, key=int):
        r = results[key]
        b = r.get("baseline") or {}
        n = f"N={int(key):.0e}"
        rows.append(
            row(
                f"{n}: build seconds, streamed `index build --embeddings` (vs plain FAISS train+add in RAM)",
                r["build_s"],
                "s",
                b.get("wall_s"),
            )
        )
        rows.append(
            row(
                f"{n}: build peak RSS (vs plain FAISS in RAM)",
                r["peak_rss_mib"],
                "MiB",
                b.get("peak_rss_mib"),
            )
        )
        rows.append(
            row(
                f"{n}: served recall@10, nprobe={r['params']['nprobe']} rerank={r['params'].get('rerank')} "
                f"nlist={r['params']['nlist']} m={r['params']['m']} (vs plain IVF-PQ, same nprobe)",
                r["recall"],
                "recall",
                b.get("recall"),
            )
        )
        rows.append(
            row(
                f"{n}: version on disk (embeddings + lists + stats + ids)",
                r["version_bytes"] / 2**20,
                "MiB",
                None,
            )
        )
    small, big = min(results, key=int), max(results, key=int)
    if small != big:
        rows.append(
            row(
                f"peak RSS at N={int(big):.0e} / at N={int(small):.0e} (acceptance: <= 1.5)",
                results[big]["peak_rss_mib"] / results[small]["peak_rss_mib"],
                "ratio",
                None,
            )
        )
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_baseline":
        baseline_child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5], argv[6])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1e6,1e7,3e7", help="comma-separated N (default 1e6,1e7,3e7)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--m", type=int, default=16, help="PQ bytes per vector (default d/4)")
    p.add_argument("--dir", default="runs/bigbuild", help="where data and stores go (runs/ is not tracked)")
    p.add_argument("--logs", default="runs/bigbuild/logs", help="child logs (bigbuild-build-N.log)")
    p.add_argument("--baseline-max", type=float, default=1e7, help="largest N the in-RAM baseline runs at")
    p.add_argument("--redo", action="store_true", help="recompute sizes already recorded")
    p.add_argument("--keep-data", action="store_true")
    p.add_argument("--name", default="build_scale")
    args = p.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    state = RESULTS_DIR / f"{args.name}_sizes.json"
    results = json.loads(state.read_text()) if state.exists() else {}
    for n in sizes:
        if str(n) in results and not args.redo:
            print(f"[{n}] recorded in {state}; skipped (--redo recomputes)")
            continue
        results[str(n)] = measure(n, args)
        # merged into what is on disk now: another run of this script may have recorded other sizes meanwhile
        results = {**(json.loads(state.read_text()) if state.exists() else {}), str(n): results[str(n)]}
        state.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results[str(n)], indent=1, default=str)[:2000], flush=True)
    write_results(
        args.name,
        table(results),
        command="nice -n 19 python bench/build_scale.py " + " ".join(argv),
        machine_note=f"load average {os.getloadavg()[0]:.1f} at the end (2 cores shared with other jobs)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
