"""Benchmark the index kinds on random unit vectors (dim 128) next to raw FAISS calls.

For each size and kind: build time, memory (serialized index bytes), QPS at batch 1 and at
batch 256, and recall@10 against exact search, measured once through softsearch's
`index.faiss_index` (build + tune + search wrapper) and once through plain FAISS calls
(index_factory, train on the same sample, add) with the same parameters. QPS compares
`index.faiss_index.search` with the raw `index.search` on the same index object, call by
call alternately, so the ratio (softsearch / raw) is the wrapper's overhead alone: a fixed
few microseconds per call, <= 5 % once a query costs >= ~100 us. Recall and memory of the
raw-built index are the baselines of those rows (they match when the builds agree).

    .venv/bin/python bench/index_kinds.py              # N = 1e5 (2 shared cores: a few minutes)
    .venv/bin/python bench/index_kinds.py --full       # adds N = 1e6
"""

from __future__ import annotations

import argparse
import sys
import time

import faiss
import numpy as np
from _common import row, write_results

from index import faiss_index as fi


def unit(n: int, d: int, seed: int) -> np.ndarray:
    """Uniform on the sphere: the hardest case for any ANN index (no structure to exploit)."""
    x = np.random.default_rng(seed).standard_normal((n, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def clustered(n: int, d: int, seed: int, clusters: int = 256, spread: float = 1.0) -> np.ndarray:
    """Unit vectors around `clusters` random centres (cosine ~0.7 to their centre), closer to
    trained embeddings; centres are fixed (seed 123) so database and queries share them."""
    centres = unit(clusters, d, seed=123)
    rng = np.random.default_rng(seed)
    x = centres[rng.integers(0, clusters, n)] + spread * rng.standard_normal(
        (n, d), dtype=np.float32
    ) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def raw_build(kind: str, params: dict, data: np.ndarray, seed: int = 0) -> faiss.Index:
    """Plain FAISS: the same factory string, training sample and knobs softsearch uses."""
    index = faiss.index_factory(data.shape[1], fi.factory_string(kind, params), faiss.METRIC_INNER_PRODUCT)
    if kind == "hnsw":
        index.hnsw.efConstruction = params["efConstruction"]
    if not index.is_trained:
        wanted = 256 * params["nlist"]
        if kind == "ivf-pq":
            wanted = max(wanted, 64 * 2 ** params["nbits"])
        limit = min(len(data), wanted)
        sample = data
        if limit < len(data):
            sample = data[np.sort(np.random.default_rng(seed).choice(len(data), size=limit, replace=False))]
        index.train(sample)
    index.add(data)
    return index


def bench_kind(
    kind: str,
    data: np.ndarray,
    queries: np.ndarray,
    exact: np.ndarray,
    tune_set: tuple,
    repeats: int,
    n_single: int,
    data_name: str,
    build_repeats: int = 2,
) -> list[dict]:
    """Rows for one kind; the knob is tuned on `tune_set` (held-out queries, exact rows)."""
    n = len(data)
    build_s = raw_build_s = float("inf")
    for _ in range(build_repeats):  # alternate softsearch / raw builds, keep the best of each
        t0 = time.perf_counter()
        ours, params = fi.build(kind, data)
        build_s = min(build_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        raw = raw_build(kind, params, data)
        raw_build_s = min(raw_build_s, time.perf_counter() - t0)
    tuned = fi.tune(ours, *tune_set, target_recall=0.95, kind=kind) if kind != "flat" else None
    if tuned is not None:
        params[tuned.param] = tuned.value
    fi.set_search_params(raw, kind, params)

    single = queries[:n_single]
    batches = [queries[i : i + 256] for i in range(0, len(queries) - 255, 256)]

    def paired(items) -> tuple[float, float]:
        """Total time of softsearch's search and of raw index.search over `items`, alternating
        per call (and which goes first) so background load hits both alike; best of `repeats`."""
        best_ours = best_raw = float("inf")
        for _ in range(repeats):
            t_ours = t_raw = 0.0
            for j, b in enumerate(items):
                b = b if b.ndim == 2 else b[None, :]
                for first_ours in (True, False) if j % 2 == 0 else (False, True):
                    t0 = time.perf_counter()
                    if first_ours:
                        fi.search(ours, b, 10)
                        t_ours += time.perf_counter() - t0
                    else:
                        ours.search(b, 10)  # raw FAISS call on the same index: isolates the wrapper
                        t_raw += time.perf_counter() - t0
            best_ours, best_raw = min(best_ours, t_ours), min(best_raw, t_raw)
        return best_ours, best_raw

    t_ours_b1, t_raw_b1 = paired(list(single))
    t_ours_b256, t_raw_b256 = paired(batches)
    n_b256 = sum(len(b) for b in batches)
    _, rows = fi.search(ours, queries, 10)
    _, raw_rows = raw.search(queries, 10)
    recall = fi.recall_at_k(rows, exact, 10)
    raw_recall = fi.recall_at_k(raw_rows, exact, 10)
    mem = len(faiss.serialize_index(ours))
    raw_mem = len(faiss.serialize_index(raw))
    tag = f"{data_name} N={n} {kind}"
    knob = "" if tuned is None else f" ({tuned.param}={tuned.value})"
    print(f"{tag}{knob}: build {build_s:.2f}s, recall {recall:.3f}", flush=True)
    return [
        row(f"{tag} build_s", build_s, "s", raw_build_s),
        row(f"{tag} memory_MB", mem / 2**20, "MiB", raw_mem / 2**20),
        row(f"{tag} qps_batch1{knob}", n_single / t_ours_b1, "q/s", n_single / t_raw_b1),
        row(f"{tag} qps_batch256{knob}", n_b256 / t_ours_b256, "q/s", n_b256 / t_raw_b256),
        row(f"{tag} recall@10{knob}", recall, "recall", raw_recall),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000], help="database sizes (default 1e5)")
    p.add_argument("--full", action="store_true", help="also run N = 1e6 (needs minutes and ~1 GiB)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument(
        "--data",
        nargs="+",
        default=["uniform", "clustered"],
        choices=["uniform", "clustered"],
        help="uniform on the sphere (worst case) and/or clustered (embedding-like)",
    )
    p.add_argument("--kinds", nargs="+", default=list(fi.KINDS), choices=fi.KINDS)
    p.add_argument("--queries", type=int, default=1024, help="queries for batch-256 QPS and recall")
    p.add_argument("--single", type=int, default=300, help="queries for batch-1 QPS")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--build-repeats", type=int, default=2, help="builds per kind and side (best is kept)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="FAISS OpenMP threads (default 1: on a shared 2-core box spinning threads distort timings)",
    )
    p.add_argument("--name", default="index_kinds", help="results file bench/results/NAME.json")
    args = p.parse_args(argv)
    faiss.omp_set_num_threads(args.threads)
    sizes = sorted(set(args.sizes + ([1_000_000] if args.full else [])))
    rows = []
    for name in args.data:
        make = unit if name == "uniform" else clustered
        for n in sizes:
            data = make(n, args.dim, seed=0)
            queries = make(args.queries, args.dim, seed=1)
            tune_q = make(200, args.dim, seed=2)
            _, exact = faiss.knn(queries, data, 10, metric=faiss.METRIC_INNER_PRODUCT)
            tune_set = (tune_q, faiss.knn(tune_q, data, 10, metric=faiss.METRIC_INNER_PRODUCT)[1])
            for kind in args.kinds:
                rows.extend(
                    bench_kind(
                        kind,
                        data,
                        queries,
                        exact,
                        tune_set,
                        args.repeats,
                        args.single,
                        name,
                        args.build_repeats,
                    )
                )
    write_results(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
