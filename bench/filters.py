"""Filtered search inside FAISS (ID selector on the search parameters) vs brute force over the subset.

10^5 clustered unit vectors (dim 64) carry a categorical field whose values select 1 %, 10 % and
50 % of the rows. For each kind (flat, ivf-flat, hnsw, ivf-pq) and selectivity: recall@10 of
the served filtered search (``search.serving.subset``: one exact scan of subsets up to 32768 rows, else
FAISS with an ID selector; PQ candidates re-ranked exactly) against exact top-10 over the subset
(baseline: the recall of post-filtering an unfiltered top-100), the largest |p - p_ref| against a
dense float64 reference over the subset, and batch-1 latency of the filtered search with its
probabilities against the unfiltered query with its probabilities (exact log Z over all N) and against
post-filtering a top-100 (FAISS only, no probabilities).

    .venv/bin/python bench/filters.py
"""

from __future__ import annotations

import argparse
import sys
import time

import faiss
import numpy as np
from _common import row, write_results

from index import faiss_index as fi
from search.serving.normaliser import log_normaliser
from search.serving.searcher import RERANK_PQ
from search.serving.subset import filtered_search

SELECTIVITY = {"s1": 0.01, "s10": 0.10, "s50": 0.50}


def clustered(n: int, d: int, seed: int, clusters: int = 100) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(size=(clusters, d))
    return fi.normalise(
        (centres[rng.integers(clusters, size=n)] + 0.5 * rng.normal(size=(n, d))).astype(np.float32)
    )


def field(n: int, seed: int) -> np.ndarray:
    """Categorical values s1 / s10 / s50 / rest with probabilities 1 / 10 / 50 / 39 %."""
    names = np.array(list(SELECTIVITY) + ["rest"])
    return names[np.random.default_rng(seed).choice(4, size=n, p=[0.01, 0.10, 0.50, 0.39])]


def per_query_ms(fn, queries: np.ndarray) -> float:
    t = time.perf_counter()
    for i in range(queries.shape[0]):
        fn(queries[i : i + 1])
    return 1e3 * (time.perf_counter() - t) / queries.shape[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--kinds", nargs="+", default=["flat", "ivf-flat", "hnsw", "ivf-pq"])
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default="filters")
    args = p.parse_args(argv)
    faiss.omp_set_num_threads(args.threads)
    x = clustered(args.n, args.dim, 0)
    q = clustered(args.queries, args.dim, 1)
    values = field(args.n, 2)
    rows = []
    for kind in args.kinds:
        index, _ = fi.build(kind, x, seed=0)
        for value, sel in SELECTIVITY.items():
            mask = values == value
            sub = np.flatnonzero(mask)
            s_sub = q @ x[sub].T  # (Q, |F|) float32
            exact = sub[np.argsort(-s_sub, axis=1, kind="stable")[:, :10]]
            rerank = RERANK_PQ if "pq" in kind else 1  # as the server does
            prob, prow = filtered_search(index, x, q, 10 * rerank, mask, args.tau)
            sims = np.einsum("qd,qkd->qk", q, x[np.maximum(prow, 0)])
            keep = np.argsort(-np.where(prow >= 0, sims, -np.inf), axis=1, kind="stable")[:, :10]
            found, prob = np.take_along_axis(prow, keep, 1), np.take_along_axis(prob, keep, 1)
            _, top = fi.search(index, q, 100)
            post = np.array([([r for r in t if r >= 0 and mask[r]] + [-1] * 10)[:10] for t in top])
            case = f"{kind} {int(sel * 100)}%"
            rows.append(
                row(
                    f"{case} recall@10 (baseline: post-filter top-100)",
                    fi.recall_at_k(found, exact),
                    "recall",
                    fi.recall_at_k(post, exact),
                )
            )
            s64 = s_sub.astype(np.float64) / args.tau
            m = s64.max(1, keepdims=True)
            log_z = m[:, 0] + np.log(np.exp(s64 - m).sum(1))  # dense reference
            ref = np.exp(
                np.einsum("qd,qkd->qk", q.astype(np.float64), x[found].astype(np.float64)) / args.tau
                - log_z[:, None]
            )
            rows.append(row(f"{case} max |p - p_dense|", float(np.abs(prob - ref).max()), "prob", None))
            if sel == 0.01:
                taus = np.full(1, args.tau)
                t_fil = per_query_ms(lambda v: filtered_search(index, x, v, 10, mask, args.tau), q)
                t_unf = per_query_ms(lambda v: (fi.search(index, v, 10), log_normaliser(v, x, taus)), q)
                t_post = per_query_ms(lambda v: fi.search(index, v, 100), q)
                rows.append(
                    row(f"{case} filtered ms/query with p (baseline: unfiltered with p)", t_fil, "ms", t_unf)
                )
                rows.append(
                    row(
                        f"{case} filtered ms/query with p (baseline: post-filter top-100, no p)",
                        t_fil,
                        "ms",
                        t_post,
                    )
                )
    write_results(args.name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
