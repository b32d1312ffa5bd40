"""FAISS index kinds for unit embeddings: create, train+add, choose, tune, search.

Every kind uses inner product on L2-normalised rows, so scores are cosine similarities
`s = z_q . z_y` (docs/theory.md §1). The kinds (flat, ivf-flat, ivf-pq, hnsw) are modules of the
registry index/kinds/; this module asks them (`kinds.get(name)`) and never compares a kind's name.

GPU: one code path. When FAISS is a GPU build (``faiss-gpu``, the ``gpu`` extra) and
``faiss.get_num_gpus() > 0``, training and adding run on
``faiss.index_cpu_to_all_gpus`` (sharded over every visible GPU) and the result is brought
back with ``index_gpu_to_cpu`` so what is written to disk is always a CPU index. Kinds without a
FAISS GPU version (``IndexKind.gpu`` false: HNSW) always stay on the CPU.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import faiss
import numpy as np

from index import kinds
from index.defaults import KINDS  # noqa: F401  (re-exported: the built-in kind names)
from index.kinds.base import RERANK_MAX, RERANK_PQ  # noqa: F401  (RERANK_PQ re-exported)
from index.kinds.choose import IVF_MIN_COUNT, SMALL_COUNT, choose_kind, default_memory_budget, suggest_kind  # noqa: F401  (re-exported)
from index.kinds.ivf import default_nlist  # noqa: F401  (re-exported)
from index.kinds.ivf_pq import default_pq_m  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

#: `tune` keeps k * rerank <= N / RERANK_SHARE (more candidates cost about an exact scan of all N rows).
RERANK_SHARE = 8
#: Stored rows used as tuning queries (`tuning_rows`); the gate draws its held-out queries from the rest.
TUNE_QUERIES = 1000


def default_params(kind: str, dim: int, count: int, **params) -> dict:
    """Fill in the build and search parameters of a kind from N and D; given ones win."""
    out = kinds.get(kind).params(dim, count, params)
    unknown = sorted(set(params) - set(out))
    if unknown:
        raise ValueError(f"unknown parameters for index kind {kind!r}: {unknown}")
    return out


def factory_string(kind: str, params: dict) -> str:
    """The faiss.index_factory description equivalent to (kind, params)."""
    return kinds.get(kind).factory(params)


def create_index(kind: str, dim: int, count: int, **params) -> tuple[faiss.Index, dict]:
    """An empty (untrained) CPU index of `kind` for about `count` vectors of `dim`, and its params."""
    if dim < 1:
        raise ValueError(f"dimension must be >= 1, got {dim}")
    params = default_params(kind, dim, count, **params)
    index = kinds.get(kind).create(dim, params)
    set_search_params(index, kind, params)
    return index, params


def set_search_params(index: faiss.Index, kind: str, params: dict) -> None:
    """Apply the runtime knob (nprobe / efSearch) stored in params to a CPU or GPU index."""
    spec = kinds.get(kind)
    name = spec.search_param
    if name is None or name not in params:
        return
    if _is_cpu(index):
        spec.set_search(index, int(params[name]))
    else:  # GPU / sharded: ParameterSpace reaches every shard
        faiss.GpuParameterSpace().set_index_parameter(index, name, int(params[name]))


def _is_cpu(index: faiss.Index) -> bool:
    return not type(faiss.downcast_index(index)).__name__.startswith(("Gpu", "IndexShards", "IndexReplicas"))


def gpu_count() -> int:
    """GPUs FAISS can use: 0 with the CPU build (``faiss-cpu`` has no GPU classes)."""
    return faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0


def use_gpu(kind: str) -> bool:
    """True when FAISS sees GPUs and has a GPU version of this kind (not HNSW)."""
    return gpu_count() > 0 and kinds.get(kind).gpu


def to_gpu(index: faiss.Index) -> faiss.Index:
    """Shard a CPU index over all visible GPUs (the standard FAISS call)."""
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True
    co.useFloat16LookupTables = True  # lets IVF-PQ with many sub-quantizers fit in shared memory
    if hasattr(co, "common_ivf_quantizer"):
        co.common_ivf_quantizer = True  # shards share one coarse quantizer, as on the CPU
    return faiss.index_cpu_to_all_gpus(index, co=co)


def _train_add_gpu(index: faiss.Index, sample: np.ndarray, vectors: np.ndarray) -> faiss.Index:
    """Train on GPU 0 (sharded training would give each shard its own quantizer), add sharded
    over all GPUs, and return the merged CPU index."""
    if not index.is_trained:
        res = faiss.StandardGpuResources()
        gpu = faiss.index_cpu_to_gpu(res, 0, index)
        gpu.train(sample)
        index = faiss.index_gpu_to_cpu(gpu)
    gpu = to_gpu(index)
    gpu.add(vectors)
    return faiss.index_gpu_to_cpu(gpu)


def _as_float32(x: np.ndarray, dim: int | None, what: str) -> np.ndarray:
    if not (type(x) is np.ndarray and x.dtype == np.float32 and x.flags.c_contiguous):
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{what} must be a 2-D (N, D) array, got shape {x.shape}")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{what} have dimension {x.shape[1]}, the index has {dim}")
    # Finite test in one BLAS call (batch-1 latency): sum_i x_i^2 is NaN iff some x_i is NaN and
    # inf if some x_i is inf *or* squares overflow; only a non-finite result needs the full check.
    if x.size:
        flat = x.reshape(-1)
        if not math.isfinite(float(flat.dot(flat))) and not np.isfinite(x).all():
            raise ValueError(f"{what} contain NaN or inf")
    return x


def normalise(x: np.ndarray) -> np.ndarray:
    """L2-normalise rows (float32); zero rows are rejected because they have no direction."""
    x = _as_float32(x, None, "vectors")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError(f"{int(np.sum(norms == 0))} zero vectors cannot be normalised")
    return x / norms


def allow_small_training(index: faiss.Index, kind: str, n_train: int) -> None:
    """Train on fewer points than FAISS's k-means wants (39 a centroid) without its stderr "WARNING
    clustering N points to K centroids": said once in the log instead, since small collections are
    expected and the recall check after the build measures what the quantizer gives."""
    for what, cp, k in kinds.get(kind).training_parts(index):
        if n_train < k * cp.min_points_per_centroid:
            logger.info(
                "%s: %s trained on %d points for %d centroids (FAISS suggests %d); the recall check "
                "measures the result",
                kind,
                what,
                n_train,
                k,
                k * cp.min_points_per_centroid,
            )
            cp.min_points_per_centroid = 1


def build(
    kind: str, vectors: np.ndarray, train_sample: int | None = None, seed: int = 0, **params
) -> tuple[faiss.Index, dict]:
    """Create, train and fill an index of `kind` with unit `vectors`; returns a CPU index and params.

    Training uses at most `train_sample` rows (default: min(N, 256 * nlist)), drawn with `seed`.
    """
    vectors = _as_float32(vectors, None, "vectors")
    n, dim = vectors.shape
    if n == 0:
        raise ValueError("cannot build an index from 0 vectors")
    index, params = create_index(kind, dim, n, **params)
    sample = vectors
    if not index.is_trained:
        wanted = kinds.get(kind).train_rows(params)  # coarse quantizer and codebooks
        limit = min(n, train_sample or wanted)
        if limit < n:
            sample = vectors[np.sort(np.random.default_rng(seed).choice(n, size=limit, replace=False))]
    if not index.is_trained:
        allow_small_training(index, kind, len(sample))
    built = None
    if use_gpu(kind):
        try:
            built = _train_add_gpu(index, sample, vectors)
        except (RuntimeError, AttributeError) as err:  # e.g. a PQ layout the GPU kernels do not support
            logger.warning("GPU build of %s failed (%s); building on the CPU", kind, err)
    if built is None:
        if not index.is_trained:
            index.train(sample)
        index.add(vectors)
        built = index
    index = built
    set_search_params(index, kind, params)
    assert index.ntotal == n, f"index holds {index.ntotal} vectors, expected {n}"
    return index, params


_F32 = np.dtype(np.float32)


def search(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k inner-product search: (scores (Q, k'), rows (Q, k')) with k' = min(k, ntotal).

    Columns where no query found a result are dropped; a remaining missing result (only
    possible with approximate kinds probing fewer than k items) has row -1 and score -inf,
    so callers skip rows < 0. NaN or inf queries raise ValueError.
    """
    if type(k) is not int and (not isinstance(k, np.integer) or isinstance(k, bool)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    x = queries
    if not (type(x) is np.ndarray and x.dtype is _F32 and x.flags.c_contiguous):
        x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim != 2 or x.shape[1] != index.d:
        _as_float32(x, index.d, "queries")  # raises with the precise message
    n = x.shape[0]
    k = int(min(k, index.ntotal))
    if k == 0 or n == 0:
        _as_float32(x, None, "queries")  # still refuse NaN / inf
        return np.zeros((n, 0), np.float32), np.zeros((n, 0), np.int64)
    scores = np.empty((n, k), np.float32)
    rows = np.empty((n, k), np.int64)
    # The shape is checked above, so call the C++ search directly rather than index.search, whose
    # Python wrapper repeats the same conversions (a few us per call at batch 1).
    index.search_c(n, faiss.swig_ptr(x), k, faiss.swig_ptr(scores), faiss.swig_ptr(rows), None)
    # Fast path: every list full and every best score finite. FAISS sorts each list best-first with
    # missing results (row -1) last, so the last column tells whether anything is missing; a query
    # with a NaN gets no results at all and one with an inf gets an inf best score
    # (tests/index/test_faiss_index.py checks this for every kind), so finiteness of the input is
    # only examined when the fast test fails.
    if n == 1:
        clean = rows[0, -1] >= 0 and math.isfinite(scores[0, 0])
    else:
        clean = rows[:, -1].min() >= 0 and np.isfinite(scores[:, 0]).all()
    if not clean:
        _as_float32(x, None, "queries")  # NaN / inf input -> ValueError
        missing = rows < 0
        scores[missing] = -np.inf
        keep = ~missing.all(axis=0)
        scores, rows = scores[:, keep], rows[:, keep]
    return scores, rows


def rerank_factor(kind: str, params: dict | None) -> int:
    """k'/k: candidates per hit the server re-scores exactly from the stored vectors (manifest params
    ``rerank``; RERANK_PQ for re-ranked (PQ) kinds without one, whose code order is not the exact order; else
    1)."""
    value = (params or {}).get("rerank")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    spec = kinds.find(kind)
    return RERANK_PQ if spec is not None and spec.rerank else 1


def search_reranked(
    index: faiss.Index,
    embeddings: np.ndarray,
    queries: np.ndarray,
    k: int,
    rerank: int = 1,
    release: Callable[[], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """What the server answers: the index's top k*rerank candidates re-scored exactly, s = z_q . z_y with
    z_y the stored row, and the best k of them -> (scores (Q, k'), rows (Q, k')), -1 / -inf = none.
    With rerank = 1 the candidates are only re-ordered by their exact scores. `release`: see
    `search_paged`."""
    x = _as_float32(queries, index.d, "queries")
    _, cand = search_paged(index, x, int(k) * int(rerank), release)  # (Q, k*r) best first, -1 = none
    return rerank_candidates(embeddings, x, cand, k)


#: Inverted lists `search_paged` lets a batch of queries probe (queries x nprobe) between two releases: a
#: fault on a mapped page may map up to a 2 MiB folio around it, so this bounds the resident list pages.
PAGED_LISTS = 64


def search_paged(
    index: faiss.Index, queries: np.ndarray, k: int, release: Callable[[], None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`search`, and with `release` (e.g. `paging.drop_index_pages` of an index with on-disk lists) in
    batches of PAGED_LISTS // nprobe queries calling release() after each, so the list pages a build's recall
    measurement reads do not pile up in its RSS. Same (scores, rows) as `search`."""
    try:
        batch = max(1, PAGED_LISTS // max(1, int(faiss.extract_index_ivf(index).nprobe)))
    except (RuntimeError, TypeError, AttributeError):
        batch = PAGED_LISTS
    if release is None or len(queries) <= batch:
        out = search(index, queries, k)
        if release is not None:
            release()
        return out
    parts = []
    for q0 in range(0, len(queries), batch):
        parts.append(search(index, queries[q0 : q0 + batch], k))
        release()
    width = max(p[1].shape[1] for p in parts)  # `search` drops columns no query of its batch filled
    scores = np.full((len(queries), width), -np.inf, np.float32)
    rows = np.full((len(queries), width), -1, np.int64)
    q0 = 0
    for s, r in parts:
        scores[q0 : q0 + len(r), : r.shape[1]] = s
        rows[q0 : q0 + len(r), : r.shape[1]] = r
        q0 += len(r)
    return scores, rows


def rerank_candidates(
    embeddings: np.ndarray, queries: np.ndarray, cand: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Re-score candidate rows `cand` (Q, C) exactly against `embeddings` and keep the best k of each query
    (see `search_reranked`); gathers at most ~2^22 floats at a time."""
    emb = embeddings.view(np.ndarray) if isinstance(embeddings, np.memmap) else embeddings
    x = np.ascontiguousarray(queries, dtype=np.float32)
    exact = np.full(cand.shape, -np.inf, np.float32)  # (Q, C)
    step = max(1, (1 << 22) // max(1, cand.shape[1] * emb.shape[1]))
    for q0 in range(0, cand.shape[0], step):
        c = cand[q0 : q0 + step]
        safe = np.where(c >= 0, c, 0)
        g = emb[safe.reshape(-1)].reshape(*c.shape, -1)  # (q, C, D) gathered rows
        s = np.matmul(g, x[q0 : q0 + step, :, None])[..., 0]  # (q, C) exact z_q . z_y
        exact[q0 : q0 + step] = np.where(c >= 0, s, -np.inf)
    kk = min(int(k), cand.shape[1])
    order = np.argsort(-exact, axis=1, kind="stable")[:, :kk]
    scores = np.take_along_axis(exact, order, axis=1)
    rows = np.where(np.isfinite(scores), np.take_along_axis(cand, order, axis=1), -1)
    return scores, rows


def tuning_rows(count: int, size: int = TUNE_QUERIES, seed: int = 0) -> np.ndarray:
    """The sorted stored rows a build tunes its search knobs on (seeded, so the gate can hold them out)."""
    return np.sort(np.random.default_rng(seed).choice(count, size=min(size, count), replace=False))


def exact_neighbours(
    database: np.ndarray, queries: np.ndarray, k: int, block_rows: int = 1 << 18
) -> np.ndarray:
    """Exact top-k rows by inner product, best first: FAISS's own brute-force kNN (blocked BLAS), the
    reference every recall in index/ is measured against. A database larger than `block_rows` (or
    memory-mapped) is read in row blocks whose pages are dropped after use, the top-k merged in
    FAISS's ResultHeap (as faiss.contrib.exhaustive_search.knn_ground_truth): RAM stays one block."""
    from index.paging import iter_row_blocks

    if not isinstance(database, np.memmap) and database.shape[0] <= block_rows:
        database = _as_float32(database, None, "database")
        queries = _as_float32(queries, database.shape[1], "queries")
        k = min(int(k), database.shape[0])
        _, rows = faiss.knn(queries, database, k, metric=faiss.METRIC_INNER_PRODUCT)
        return rows
    if database.ndim != 2:
        raise ValueError(f"database must be a 2-D (N, D) array, got shape {database.shape}")
    queries = _as_float32(queries, database.shape[1], "queries")
    k = min(int(k), database.shape[0])
    heap = faiss.ResultHeap(queries.shape[0], k, keep_max=True)
    for start, block in iter_row_blocks(database, block_rows):
        _as_float32(block, None, "database")  # NaN / inf refused as in the one-call path
        scores, rows = faiss.knn(queries, block, min(k, block.shape[0]), metric=faiss.METRIC_INNER_PRODUCT)
        heap.add_result(scores, rows + start)
    heap.finalize()
    return heap.I


def recall_at_k(found: np.ndarray, exact: np.ndarray, k: int = 10) -> float:
    """Mean over queries of |found[:k] & exact[:k]| / k (FAISS's "k-recall@k")."""
    k = min(k, exact.shape[1])
    hits = [len(set(f[:k][f[:k] >= 0].tolist()) & set(e[:k].tolist())) for f, e in zip(found, exact)]
    return float(np.mean(hits) / k) if hits else 1.0


@dataclass
class TuneResult:
    """Outcome of `tune`: the knob value chosen and what it measured."""

    param: str | None
    value: int | None
    recall: float
    latency_ms: float  # mean per query at batch = len(sample)
    reached: bool
    history: list[dict] = field(default_factory=list)
    rerank: int | None = None  # k'/k for PQ kinds tuned with re-ranking (None: not tuned)

    def to_dict(self) -> dict:
        return asdict(self)

    def recall_record(self, k: int, target_recall: float, sample: int) -> dict:
        """The manifest's ``recall`` record of this tuning, measured on `sample` stored rows as queries."""
        return {
            "k": k,
            "recall": self.recall,
            "exact": False,
            "target": target_recall,
            "param": self.param,
            "value": self.value,
            "reached": self.reached,
            "rerank": self.rerank,
            "latency_ms": self.latency_ms,
            "sample": int(sample),
            "queries": "stored rows, own row excluded",
            "history": self.history,
        }


def single_item_recall(target_recall: float) -> dict:
    """The ``recall`` record of a one-item version: nothing to tune, every search finds the item."""
    return {"k": 0, "recall": 1.0, "exact": False, "target": target_recall, "note": "single item"}


def drop_rows(rows: np.ndarray, drop: np.ndarray, k: int) -> np.ndarray:
    """Per query, remove the row `drop[q]` from its result list and keep the first k."""
    out = np.full((rows.shape[0], k), -1, np.int64)
    for q, (r, d) in enumerate(zip(rows, drop)):
        kept = r[r != d][:k]
        out[q, : len(kept)] = kept
    return out


def tune(
    index: faiss.Index,
    sample_queries: np.ndarray,
    exact: np.ndarray,
    target_recall: float = 0.95,
    k: int = 10,
    kind: str | None = None,
    min_gain: float = 0.002,
    self_rows: np.ndarray | None = None,
    embeddings: np.ndarray | None = None,
    release: Callable[[], None] | None = None,
) -> TuneResult:
    """Raise nprobe / efSearch (doubling) until recall@k against `exact` reaches the target.

    With `embeddings` (the stored unit rows) an IVF-PQ index is tuned as it is served: its top k*r
    candidates re-scored exactly from the stored vectors (`search_reranked`), nprobe and the re-rank
    factor r = k'/k chosen together (`_tune_reranked`).

    `release` (see `search_paged`) is called between query batches of every search.
    `exact` holds the exact top-k rows of each sample query (see `exact_neighbours`).
    The knob ends at the smallest tried value that reaches the target. When it never does,
    `reached=False` and the knob stops where recall has plateaued (a doubling gained less
    than `min_gain`; IVF-PQ plateaus below 1 because its codes are lossy: more probes then
    only cost time) or at its maximum (nlist for IVF, 2048 for HNSW).
    `self_rows[q]`: when the sample queries are stored rows, the row of each query, which is
    dropped from both result lists so the trivial self-match does not inflate recall (then
    `exact` must hold the exact top-(k+1) rows, self included).
    """
    if not 0 < target_recall <= 1:
        raise ValueError(f"target_recall must be in (0, 1], got {target_recall}")
    kind = kind or kind_of(index)
    spec = kinds.get(kind)
    param = spec.search_param
    queries = _as_float32(sample_queries, index.d, "sample queries")

    if self_rows is not None:
        exact = drop_rows(np.asarray(exact), np.asarray(self_rows), k)
    if spec.rerank and embeddings is not None:
        return _tune_reranked(
            index, queries, exact, target_recall, k, min_gain, self_rows, embeddings, release, kind
        )

    def measure() -> tuple[float, float]:
        t0 = time.perf_counter()
        _, rows = search_paged(index, queries, k + (self_rows is not None), release)
        dt = (time.perf_counter() - t0) * 1000 / max(len(queries), 1)
        if self_rows is not None:
            rows = drop_rows(rows, self_rows, k)
        return recall_at_k(rows, exact, k), dt

    if param is None:
        recall, ms = measure()
        return TuneResult(
            None, None, recall, ms, recall >= target_recall, [{"recall": recall, "latency_ms": ms}]
        )
    value, limit = spec.tune_range(index, k)
    history = []
    while True:
        set_search_params(index, kind, {param: value})
        recall, ms = measure()
        history.append({param: value, "recall": recall, "latency_ms": ms})
        logger.debug("tune %s=%d recall@%d=%.4f %.3f ms/query", param, value, k, recall, ms)
        if recall >= target_recall or value >= limit:
            break
        if len(history) >= 2 and recall - history[-2]["recall"] < min_gain:
            # plateau: keep the previous, cheaper value, which recalls as much
            value, recall, ms = history[-2][param], history[-2]["recall"], history[-2]["latency_ms"]
            set_search_params(index, kind, {param: value})
            break
        value = min(value * 2, limit)
    reached = recall >= target_recall
    if not reached:
        logger.warning(
            "%s: recall@%d %.3f below target %.3f even at %s=%d", kind, k, recall, target_recall, param, value
        )
    return TuneResult(param, value, recall, ms, reached, history)


def _tune_reranked(
    index: faiss.Index,
    queries: np.ndarray,
    exact: np.ndarray,
    target_recall: float,
    k: int,
    min_gain: float,
    self_rows: np.ndarray | None,
    embeddings: np.ndarray,
    release: Callable[[], None] | None = None,
    kind: str = "",
) -> TuneResult:
    """(nprobe, r) of an IVF-PQ index re-ranked from `embeddings`: the pair reaching the target at the least
    measured time per query, t = t_faiss(nprobe) + t_rerank(r).

    nprobe doubles from 1; at each, ONE search fetches k * RERANK_MAX candidates and every r in 1, 2, 4, ...,
    RERANK_MAX (with k * r <= N / RERANK_SHARE) is scored on its prefix (the top k*r PQ candidates are the
    first k*r of the longer list), stopping at the first r that reaches the target (a larger r only costs more
    at that nprobe). The doubling stops at nlist, when t_faiss alone exceeds the best pair's time (more probes
    cannot be cheaper), or when recall at RERANK_MAX gains less than `min_gain` (plateau; then the best recall
    wins)."""
    ivf = faiss.extract_index_ivf(index)
    extra = 1 if self_rows is not None else 0
    kq = k + extra
    # k*r <= N / RERANK_SHARE: re-scoring more candidates than that (scattered rows) costs about as much as
    # an exact scan of every stored row, which is then the better index
    ladder = [
        r
        for r in (2**i for i in range(int(math.log2(RERANK_MAX)) + 1))
        if r == 1 or kq * r <= index.ntotal // RERANK_SHARE
    ]
    history: list[dict] = []
    best = None  # the cheapest entry reaching the target
    top = None  # the highest-recall entry (used when none reaches it)
    nprobe, previous = 1, None
    while True:
        ivf.nprobe = nprobe
        t0 = time.perf_counter()
        _, cand = search_paged(index, queries, kq * RERANK_MAX, release)  # (Q, kq * RERANK_MAX)
        t_faiss = (time.perf_counter() - t0) * 1000 / max(len(queries), 1)
        recall = 0.0
        for r in ladder:
            t0 = time.perf_counter()
            _, rows = rerank_candidates(embeddings, queries, cand[:, : kq * r], kq)
            ms = t_faiss + (time.perf_counter() - t0) * 1000 / max(len(queries), 1)
            if self_rows is not None:
                rows = drop_rows(rows, self_rows, k)
            recall = recall_at_k(rows, exact, k)
            entry = {"nprobe": nprobe, "rerank": r, "recall": recall, "latency_ms": ms}
            history.append(entry)
            logger.debug("tune nprobe=%d rerank=%d recall@%d=%.4f %.3f ms/query", nprobe, r, k, recall, ms)
            if top is None or recall > top["recall"] + 1e-12:
                top = entry
            if recall >= target_recall:
                if best is None or ms < best["latency_ms"]:
                    best = entry
                break
        if nprobe >= ivf.nlist or (best is not None and t_faiss >= best["latency_ms"]):
            break
        if best is None and previous is not None and recall - previous < min_gain:
            break  # plateau: more probes do not help even with the most candidates
        if best is not None and best["rerank"] == 1:
            break  # the cheapest re-rank already reaches it; more probes only cost time
        previous = recall
        nprobe = min(nprobe * 2, ivf.nlist)
    chosen = best or top
    ivf.nprobe = chosen["nprobe"]
    reached = best is not None
    if not reached:
        logger.warning(
            "%s: recall@%d %.3f below target %.3f even at nprobe=%d with %dx re-ranking",
            kind,
            k,
            chosen["recall"],
            target_recall,
            chosen["nprobe"],
            chosen["rerank"],
        )
    return TuneResult(
        "nprobe",
        chosen["nprobe"],
        chosen["recall"],
        chosen["latency_ms"],
        reached,
        history,
        rerank=chosen["rerank"],
    )


#: The file of on-disk inverted lists a streamed build writes beside its index file (index/stream.py).
LISTS_FILE = "index.ivfdata"


def read_index(path, mmap: bool = False) -> faiss.Index:
    """A version's index file read with FAISS's own IO. On-disk inverted lists (a `LISTS_FILE` beside it) stay
    on disk: their table is read without mapping (IO_FLAG_SKIP_IVF_DATA), then the file beside the index is
    mapped read-only (the directory may have moved since the build: staging -> versions/, export / import;
    FAISS's IO_FLAG_ONDISK_SAME_DIR does the same but prints to stdout). With `mmap`, flat codes (a flat
    index's, HNSW's stored vectors) are mapped read-only from the file (IO_FLAG_MMAP_IFC) rather than
    copied, so several serving processes share one copy through the page cache."""
    from pathlib import Path

    path = Path(path)
    if not (path.parent / LISTS_FILE).is_file():
        if mmap:
            return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
        return faiss.read_index(str(path))
    index = faiss.read_index(str(path), faiss.IO_FLAG_SKIP_IVF_DATA | faiss.IO_FLAG_READ_ONLY)
    if not on_disk_lists(index):
        return faiss.read_index(str(path))
    od = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
    od.filename = str(path.parent / Path(od.filename).name)
    od.read_only = True
    od.do_mmap()
    return index


def on_disk_lists(index: faiss.Index) -> bool:
    """True when `index` is IVF with its inverted lists in a file (`faiss.OnDiskInvertedLists`)."""
    try:
        invlists = faiss.extract_index_ivf(index).invlists
    except (RuntimeError, TypeError, AttributeError):
        return False
    return isinstance(faiss.downcast_InvertedLists(invlists), faiss.OnDiskInvertedLists)


def lists_in_ram(index: faiss.Index) -> faiss.Index:
    """`index` itself, or for on-disk lists the same index with its lists copied into RAM
    (ArrayInvertedLists), which `add` can extend (the on-disk file is mapped read-only)."""
    if not on_disk_lists(index):
        return index
    ivf = faiss.extract_index_ivf(index)
    od = ivf.invlists
    ram = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
    for l in range(ivf.nlist):
        size = od.list_size(l)
        if size:
            ram.add_entries(l, size, od.get_ids(l), od.get_codes(l))
    ivf.replace_invlists(ram, True)
    ram.this.disown()
    return index


def kind_of(index: faiss.Index) -> str:
    """Recover the kind name from a CPU index object."""
    return kinds.of_index(faiss.downcast_index(index)).name


def index_bytes(kind: str, dim: int, count: int, params: dict | None = None) -> int:
    """Approximate resident bytes of an index of `kind` (for choose_kind and the benchmark)."""
    params = default_params(kind, dim, count, **(params or {}))
    return kinds.get(kind).bytes(dim, count, params)


def subset_selector(mask: np.ndarray) -> tuple[faiss.IDSelector, np.ndarray]:
    """A FAISS ID selector admitting the rows where ``mask`` is true, and the bitmap it reads.

    IDSelectorBitmap tests bit i as (bitmap[i >> 3] >> (i & 7)) & 1, i.e. little-endian bit order
    within each byte; the caller must keep the returned bitmap alive while the selector is used."""
    bits = np.packbits(np.asarray(mask, dtype=bool), bitorder="little")
    return faiss.IDSelectorBitmap(int(np.asarray(mask).size), faiss.swig_ptr(bits)), bits


def search_subset(
    index: faiss.Index, queries: np.ndarray, k: int, mask: np.ndarray, nprobe: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k inner-product search restricted INSIDE FAISS to the rows where ``mask`` is true.

    The selector rides on the search parameters (SearchParametersIVF / SearchParametersHNSW /
    SearchParameters), so a selective filter still returns k hits from the subset instead of the
    few survivors of post-filtering an unfiltered top-k. ``nprobe`` overrides the IVF probe count
    (selective filters on IVF-PQ may need more lists). Without it the probe budget grows as the subset
    shrinks, nprobe / selectivity lists (HNSW: efSearch / selectivity candidates), so about as many
    subset rows are visited as an unfiltered search visits rows. Returns (scores, rows) as ``search``."""
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (index.ntotal,):
        raise ValueError(f"mask must have one entry per stored row ({index.ntotal}), got {mask.shape}")
    x = _as_float32(queries, index.d, "queries")
    k = int(min(k, int(mask.sum())))
    if k < 1:
        return np.zeros((x.shape[0], 0), np.float32), np.zeros((x.shape[0], 0), np.int64)
    sel, bits = subset_selector(mask)
    selectivity = float(mask.mean())
    inner = faiss.downcast_index(index)
    if isinstance(inner, faiss.IndexIVF):
        probe = nprobe or min(inner.nlist, math.ceil(inner.nprobe / selectivity))
        params = faiss.SearchParametersIVF(sel=sel, nprobe=int(probe))
    elif isinstance(inner, faiss.IndexHNSW):
        ef = min(index.ntotal, math.ceil(max(int(inner.hnsw.efSearch), k) / selectivity))
        params = faiss.SearchParametersHNSW(sel=sel, efSearch=int(ef))
    else:
        params = faiss.SearchParameters(sel=sel)
    scores, rows = index.search(x, k, params=params)
    del bits  # the selector read it during search
    missing = rows < 0
    scores[missing] = -np.inf
    keep = ~missing.all(axis=0)
    return scores[:, keep], rows[:, keep]
