"""The softmax normaliser log Z(x) = logsumexp_j s(x, y_j) / tau: exact, or bounded from a partition.

``exact`` streams every stored embedding (``log_normaliser``): N x D multiply-adds per query, and
the whole N x D float32 file resident while it runs. ``bounded`` reads only a few thousand rows:

* **Partition.** The rows are grouped into lists l (the IVF index's own inverted lists, else a
  k-means over the embeddings). Per list, computed when the index version is written and stored
  in it (``ListStats``, index/list_stats.py): size n_l, mean mu_l, radius R_l = max_j |y_j - mu_l|
  and lam_l = largest eigenvalue of the list covariance (1/n_l) sum_j (y_j - mu_l)(y_j - mu_l)^T.
* **Per-list bound.** For a query x write t_j = <x, y_j - mu_l> / tau. Over the list, t has mean
  exactly 0, t_j <= b_l = |x| R_l / tau and mean t_j^2 <= v_l = |x|^2 lam_l / tau^2 (<= b_l^2). So
  S_l = sum_{j in l} exp(s_j / tau) = n_l exp(<x, mu_l> / tau) * mean_j exp(t_j) with

      1  <=  mean_j exp(t_j)  <=  B(b, v) = (b^2 exp(-v / b) + v exp(b)) / (b^2 + v)

  The lower bound is Jensen's inequality. The upper one is Bennett's (1962) sharp bound for a
  variable <= b with mean 0 and variance <= v: the quadratic q(t) through (-v/b, e^{-v/b}) and
  (b, e^b), tangent at -v/b, lies above e^t on (-inf, b], so mean exp(t) <= mean q(t), which
  depends only on the mean and the second moment and is largest at the two-point law on
  {-v/b, b}. B increases with v, and B(b, b^2) = cosh(b) is the plain range bound.
* **Head.** Lists in decreasing order of their upper bound n_l exp(<x, mu_l>/tau) B_l are scanned
  exactly until `head_rows` rows are read, and so are the `top_rows` rows the ANN index ranks first
  (the heaviest terms): H = sum over these rows of exp(s_j / tau). A list with h of its rows already
  summed keeps valid bounds on the rest: Jensen on the rest's mean (n_l <x, mu_l> - sum of their
  s) / (n_l - h) below, U_l - H_l above.
* **Deterministic bound.** log Z lies in [log(H + sum_tail L_l), log(H + sum_tail U_l)] with
  L_l = n_l exp(<x, mu_l>/tau) and U_l = L_l B_l, widened by the float32 rounding of the dot
  products (|fl(x.y) - x.y| <= gamma_D |x| |y|, gamma_D = D u / (1 - D u), u = 2^-24), so it holds
  for the real-arithmetic value of the stored float32 rows and for the float32 `exact` result.
* **Sampled estimate.** M rows are drawn from the tail lists with replacement: list l with
  probability L_l / sum_tail L, a row uniformly within it. Then T = sum_tail S_l is estimated
  without bias by  T^ = (sum_tail L) * mean_i exp((s_i - <x, mu_{l_i}>) / tau), and the stated
  interval is the normal one, T^ +- z_{(1+level)/2} * se, se the sample standard deviation over
  sqrt(M). Lists expecting >= 2 draws are strata of their own (fixed allocation), which removes the
  between-list variance. The estimate and the interval are clipped to the deterministic bound
  (which can only help: the exact value is known to be inside). Draws are seeded by the query's
  bytes and tau, so one query always gets the same answer.
* **Two stages.** Where the first sample's se(log Z^) = se(T^) / (H + T^) exceeds `target_se`
  (0.0125 nats, i.e. a median error ~0.008), it was a pilot: a fresh sample of M (se / target)^2
  * 1.2 rows (at most `max_samples`) replaces it. Given its size the fresh sample is independent of
  the pilot, so its estimate is unbiased and its interval keeps its level.
* **Fallback.** The normal interval needs a sample that sees the mass: when the within-list spread
  of s / tau is large (low tau, diffuse lists) a few rare rows carry Z and the sample's standard
  error is large. A query whose se(log Z^) = se(T^) / (H + T^) exceeds `max_se` (0.02 nats) is
  computed exactly instead (one streaming pass for all such queries of a batch); its answer says
  `exact`. So `bounded` returns either a sampled estimate of standard error <= max_se or the exact
  value, and always a bound that contains the exact value.

The estimate is log(H + T^); probabilities are p_j = exp(s_j / tau - log Z^), and the bound on
log Z gives p_j within [exp(s_j/tau - upper), exp(s_j/tau - lower)].
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Callable, Literal

import numpy as np

from index.list_stats import ListStats
from index.paging import advise_random, releasable, release_bytes, release_pages

logger = logging.getLogger(__name__)

__all__ = [
    "METHODS",
    "NormaliserConfig",
    "ListStats",
    "LogZ",
    "LogZEstimate",
    "Normaliser",
    "bennett_log_bound",
    "log_normaliser",
    "bounded_log_normaliser",
    "choose_method",
    "probe_costs",
    "advise_random",
    "release_pages",
    "releasable",
]

METHODS = ("exact", "bounded", "auto")
#: Embedding rows per block of the exact streaming logsumexp (memory is Q x BLOCK float64).
DEFAULT_BLOCK = 16384
#: `auto` keeps `exact` while one query costs at most this many multiply-adds (N * D): N = 10^6 at
#: D = 128, about 25 ms per query on one core of the development machine, 512 MB of embeddings.
AUTO_EXACT_MAX_MACS = 128 * 1_000_000
#: Between exact_max_macs and this many times it (and above head_rows + samples rows, where bounded reads
#: less than the whole index), `auto` times both methods at load (`probe_costs`) and keeps the cheaper.
AUTO_PROBE_FACTOR = 8
#: Stored rows the probe searches with, as one batch.
AUTO_PROBE_QUERIES = 8
_U32 = 2.0**-24  # unit roundoff of float32
#: The second stage draws this many times the rows the pilot's standard error says reach target_se: the
#: pilot's own se is an estimate, and one that came out low would leave the second stage short of max_se.
_STAGE2_MARGIN = 1.5


def log_normaliser(
    queries: np.ndarray,
    embeddings: np.ndarray,
    temperatures: np.ndarray,
    block: int = DEFAULT_BLOCK,
    release: bool = True,
) -> np.ndarray:
    """Exact log sum_l exp(q . e_l / tau_q) for each query, streamed over blocks of `embeddings`.

    queries (Q, D), embeddings (N, D), temperatures (Q,) -> (Q,) float64. Running max keeps
    every exp() in range, so tiny temperatures do not overflow. With `release`, each block of a
    read-only memory map is unmapped from the process once read (`release_pages`), so the scan
    leaves at most one block resident in it instead of the whole file.
    """
    q = np.asarray(queries, dtype=np.float32)
    inv_tau = 1.0 / np.asarray(temperatures, dtype=np.float64)  # (Q,)
    mapped = embeddings if release and releasable(embeddings) else None
    if isinstance(embeddings, np.memmap):  # the same mapped pages, without np.memmap's per-operation overhead
        embeddings = embeddings.view(np.ndarray)
    if (
        0 < embeddings.shape[0] <= block
    ):  # one block: log Z = m + log sum_l exp(logit_l - m), m = max_l logit_l
        logits = (q @ embeddings.T).astype(np.float64) * inv_tau[:, None]  # (Q, N)
        if mapped is not None:
            release_pages(mapped)
        m = logits.max(axis=1)
        return m + np.log(np.exp(logits - m[:, None]).sum(axis=1))
    m = np.full(q.shape[0], -np.inf)  # running max of logits, (Q,)
    acc = np.zeros(q.shape[0])  # running sum of exp(logit - m), (Q,)
    for start in range(0, embeddings.shape[0], block):
        logits = (q @ embeddings[start : start + block].T).astype(np.float64) * inv_tau[:, None]  # (Q, B)
        if mapped is not None:
            release_pages(mapped, start, start + block)
        new_m = np.maximum(m, logits.max(axis=1))
        acc = acc * np.exp(m - new_m) + np.exp(logits - new_m[:, None]).sum(axis=1)
        m = new_m
    return m + np.log(acc)


@dataclass(frozen=True)
class NormaliserConfig:
    """How log Z is computed. `method`: exact | bounded | auto (exact while N * D <= exact_max_macs, else
    bounded; with `probe`, where N * D is within AUTO_PROBE_FACTOR x exact_max_macs -- below exact_max_macs
    only over an approximate index whose build-time recall@10 reaches `recall_target` -- and the version
    stores its list statistics, whichever path a short timing at load finds cheaper per query:
    `probe_costs`, `Normaliser.for_version`).

    head_rows: rows scanned exactly per query (whole lists, best upper bound first);
    samples: tail rows drawn per query for the estimate; level: coverage of the sampled interval;
    target_se: when the first sample's standard error of log Z exceeds it (nats), a fresh sample of
    up to max_samples rows sized to reach it replaces it (a two-stage design);
    max_se: a query whose estimate still has a larger standard error (nats) is computed exactly;
    top_rows: rows the ANN index ranks first, summed exactly too (heavy terms out of the sample);
    control_variate: estimate each list's mean of exp(t) through exp(t) - t (t has mean 0 over the list):
    2.5x fewer rows for the same standard error in the tests' clusters, but the interval then covers a
    little under its level (0.87-0.89 at 0.90 there: what is left of the variance is the rare heavy
    rows', which a sample underestimates); False: the plain mean of exp(t), interval at its level;
    recall_target: recall@10 an approximate index must have measured at build for `auto` to serve
    bounded answers over it (their top-k comes from the index);
    listed_max_bytes: `bounded` keeps an in-RAM copy of the rows in list order (`ListedRows`) when they
    take at most this many bytes and its pages are kept (release_pages not True); 0: never;
    listed_shared: that copy is a file beside the version, mapped (`ListedRows.build` with a path), so
    several serving processes share one copy through the page cache (`serve --workers N`);
    release_pages: unmap the memory map's pages from the process once read (`release_pages`), so the
    file's pages do not pile up in the process's RSS (they stay in the shared, reclaimable page
    cache); False keeps them mapped (no refaults); None (default) releases after the exact scan's
    sequential blocks (measured 1.0-1.2x its time at N = 1e6 and 1e7) and keeps the bounded
    estimate's scattered reads mapped (releasing them refaults whole 2 MiB folios: 2x at N = 1e6,
    ~6x at 1e7, bench/normaliser.py).
    overlap: a single query's `bounded_start` runs on a helper thread while the index searches
    (`Normaliser.search_and_normalise`); False (default): one after the other, the same answer (on the
    2-core development VM the overlap gained no wall time and cost ~0.45 ms of CPU per query,
    docs/results.md §33).
    """

    method: Literal["exact", "bounded", "auto"] = "auto"
    head_rows: int = 1024
    samples: int = 512
    level: float = 0.95
    max_se: float = 0.0033
    top_rows: int = 100
    target_se: float = 0.0025
    max_samples: int = 16384
    exact_max_macs: int = AUTO_EXACT_MAX_MACS
    probe: bool = True
    kmeans_seed: int = 1234
    release_pages: bool | None = None
    recall_target: float = 0.99
    control_variate: bool = True
    listed_max_bytes: int = 4 << 30
    listed_shared: bool = False
    overlap: bool = False

    def releases(self, method: str) -> bool:
        """Whether `method`'s reads release the memory map's pages (resolves release_pages=None)."""
        return self.release_pages if self.release_pages is not None else method == "exact"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"normaliser must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.head_rows < 0 or self.samples < 2:
            raise ValueError(
                f"normaliser head_rows must be >= 0 and samples >= 2, got {self.head_rows}, {self.samples}"
            )
        if not self.max_se > 0 or self.top_rows < 0 or not self.target_se > 0:
            raise ValueError(
                f"normaliser max_se and target_se must be > 0 and top_rows >= 0, got {self.max_se}, "
                f"{self.target_se}, {self.top_rows}"
            )
        if not 0 < self.level < 1:
            raise ValueError(f"normaliser level must be in (0, 1), got {self.level}")

    @classmethod
    def of(cls, value: "NormaliserConfig | str | None") -> "NormaliserConfig":
        """A config from a config, a method name, or None (the default, auto)."""
        if isinstance(value, NormaliserConfig):
            return value
        return cls() if value is None else cls(method=value)


def choose_method(count: int, dim: int, config: NormaliserConfig) -> str:
    """`exact` or `bounded` for an index of `count` rows of `dim` under `config` (resolves auto by size
    alone; `Normaliser.for_version` times both instead where the size leaves it open: `probe_costs`)."""
    if config.method != "auto":
        return config.method
    return "exact" if count * dim <= config.exact_max_macs else "bounded"


def probe_costs(
    embeddings: np.ndarray,
    stats: ListStats,
    config: NormaliserConfig,
    queries: int = AUTO_PROBE_QUERIES,
    index=None,
    listed: "ListedRows | None" = None,
) -> dict:
    """`auto`'s measurement: per-query time of the exact one-pass scan (log Z and the exact top-10) and of
    the bounded path (the `index`'s search for the rows it sums exactly and the hits, when given, then the
    bounded estimate), each on one batch of `queries` stored rows (as the server batches concurrent
    queries) and on one query alone (one client), after a warm-up call; tau 0.1. The cheaper by the sum
    of the two is chosen (exact on a tie: it needs no estimate).
    {exact_ms, bounded_ms, exact_ms_1, bounded_ms_1, queries, chosen}."""
    import time

    from search.serving.exact_scan import ExactScanner

    n = embeddings.shape[0]
    rows = np.linspace(0, n - 1, queries).astype(np.int64)
    q = np.ascontiguousarray(embeddings[rows], dtype=np.float32)
    scanner = ExactScanner(embeddings, release=config.releases("exact"))
    wanted = min(n, max(10, config.top_rows))

    def exact(x):
        scanner(x, np.full(len(x), 0.1), 10)

    def bounded(x):
        top = index.search(x, wanted)[1] if index is not None else None
        bounded_log_normaliser(
            x,
            embeddings,
            stats,
            np.full(len(x), 0.1),
            config,
            top,
            release=config.releases("bounded"),
            listed=listed,
        )

    def per_query(fn, x) -> float:
        t0 = time.perf_counter()
        fn(x)
        return (time.perf_counter() - t0) * 1e3 / len(x)

    out = {"queries": queries}
    for name, fn in (("exact", exact), ("bounded", bounded)):
        fn(q[:1])  # warm-up: first touches of the map, the index's first search
        out[f"{name}_ms"] = per_query(fn, q)
        out[f"{name}_ms_1"] = per_query(fn, q[:1])
    cheaper = out["bounded_ms"] + out["bounded_ms_1"] < out["exact_ms"] + out["exact_ms_1"]
    out["chosen"] = "bounded" if cheaper else "exact"
    return out


# ----------------------------------------------------------------------------- memory-map residency
# (index/paging.py, the one home of reading mapped files without keeping them resident)


# ----------------------------------------------------------------------------- the bound


def bennett_log_bound(b: np.ndarray, v: np.ndarray) -> np.ndarray:
    """log B(b, v), B = (b^2 exp(-v/b) + v exp(b)) / (b^2 + v): the largest mean exp(t) over laws of
    t <= b with mean 0 and mean t^2 <= v (Bennett 1962). B = 1 when b = 0 or v = 0."""
    b = np.asarray(b, dtype=np.float64)
    v = np.minimum(np.asarray(v, dtype=np.float64), b * b)
    out = np.zeros(np.broadcast(b, v).shape)
    ok = (b > 0) & (v > 0)
    bb, vv = np.broadcast_to(b, out.shape)[ok], np.broadcast_to(v, out.shape)[ok]
    out[ok] = np.logaddexp(2 * np.log(bb) - vv / bb, np.log(vv) + bb) - np.log(bb * bb + vv)
    return np.maximum(out, 0.0)  # never below Jensen's 1 (rounding)


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class LogZEstimate:
    """One query's log Z: the value used for probabilities, a bound that contains the exact value,
    and (bounded only) the sampled interval at `level`. `rows` = embedding rows read."""

    value: float
    lower: float
    upper: float
    method: str
    interval: tuple[float, float] | None = None
    level: float | None = None
    rows: int = 0

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "value": self.value,
            "lower": self.lower,
            "upper": self.upper,
            "interval": list(self.interval) if self.interval is not None else None,
            "level": self.level,
            "rows": self.rows,
        }


@dataclass(frozen=True, eq=False)
class LogZ:
    """log Z of a batch of queries: (Q,) float64 arrays (interval NaN when not sampled)."""

    value: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    method: str
    interval_lower: np.ndarray = field(default=None)  # type: ignore[assignment]
    interval_upper: np.ndarray = field(default=None)  # type: ignore[assignment]
    level: float | None = None
    rows: np.ndarray = field(default=None)  # type: ignore[assignment]
    exact_mask: np.ndarray = field(default=None)  # type: ignore[assignment]  # (Q,) bool: computed exactly

    @classmethod
    def exact(cls, value: np.ndarray, count: int) -> "LogZ":
        value = np.asarray(value, dtype=np.float64)
        nan = np.full(value.shape, np.nan)
        return cls(
            value,
            value,
            value,
            "exact",
            nan,
            nan,
            None,
            np.full(value.shape, count, dtype=np.int64),
            np.ones(value.shape, dtype=bool),
        )

    def __len__(self) -> int:
        return len(self.value)

    def __getitem__(self, i: int) -> LogZEstimate:
        lo, hi = self.interval_lower[i], self.interval_upper[i]
        interval = None if math.isnan(lo) else (float(lo), float(hi))
        method = "exact" if self.exact_mask[i] else self.method
        return LogZEstimate(
            float(self.value[i]),
            float(self.lower[i]),
            float(self.upper[i]),
            method,
            interval,
            self.level if interval is not None else None,
            int(self.rows[i]),
        )


def _query_seed(x: np.ndarray, tau: float) -> int:
    digest = hashlib.blake2b(
        np.ascontiguousarray(x, dtype=np.float32).tobytes() + np.float64(tau).tobytes(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


#: Bytes of a memory map a gather reads before it releases them (`_gather`): one read can map a
#: whole large folio (up to 2 MiB), so a few thousand scattered rows would map the whole file at once.
#: A multiple of 2 MiB: stretches start at 2 MiB-aligned addresses, so a release never splits a
#: huge-page mapping (which would make every later fault map 4 KiB pages, several times slower).
GATHER_SPAN_BYTES = 16 << 20
_HUGE = 2 << 20


def _gather(
    embeddings: np.ndarray, rows: np.ndarray, release: bool = False, span_bytes: int | None = None
) -> np.ndarray:
    """embeddings[rows] for ascending `rows` (a forward sweep over the memory map), (R, D) float32.
    With `release` (and a releasable map), rows are read one `span_bytes` stretch of addresses at a
    time and each stretch is released once read, so the process never maps more than ~one stretch."""
    if not release or len(rows) == 0 or not releasable(embeddings):
        return np.take(embeddings, rows, axis=0)
    span = max(_HUGE, (span_bytes or GATHER_SPAN_BYTES) // _HUGE * _HUGE)
    base = embeddings.ctypes.data
    origin = base // _HUGE * _HUGE
    out = np.empty((len(rows), embeddings.shape[1]), dtype=embeddings.dtype)
    view = embeddings.view(np.ndarray)
    stretch = (base - origin + rows.astype(np.int64) * embeddings.strides[0]) // span
    cuts = np.flatnonzero(np.diff(stretch)) + 1
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)]):
        np.take(view, rows[a:b], axis=0, out=out[a:b])
        lo = origin + int(stretch[a]) * span
        release_bytes(embeddings, lo, lo + span)
    return out


@dataclass(frozen=True, eq=False)
class ListedRows:
    """An in-RAM copy of the stored rows in list order (`ListStats.order`): a head list is one contiguous
    block and a stratum's draws fall inside one list's block, so the bounded estimate reads nearby memory
    instead of rows scattered over the memory map (0.55 against 0.90 ms per query for the same ~3 000 rows
    at 10^5 x 512, docs/results.md §28). `position[row]` is the row's place in the copy."""

    rows: np.ndarray  # (N, D) float32, C-contiguous, rows[position[r]] == embeddings[r]
    position: np.ndarray  # (N,) int64
    path: "Path | None" = None  # the shared file the rows are mapped from (None: private RAM)

    @classmethod
    def build(cls, embeddings: np.ndarray, stats: ListStats, path=None) -> "ListedRows":
        """The copy in private RAM, or with `path` a file of it (.npy) mapped read-only: written once (to a
        temporary name, then renamed), then mapped by every process serving the version, so the page
        cache holds one copy for all of them (`serve --workers N`). Where the file cannot be written or
        does not hold these rows, the copy stays in RAM."""
        order = np.asarray(stats.order, dtype=np.int64)
        position = np.empty(len(order), dtype=np.int64)
        position[order] = np.arange(len(order), dtype=np.int64)
        if path is not None:
            rows = _listed_file(embeddings, order, Path(path))
            if rows is not None:
                return cls(rows, position, Path(path))
        rows = np.empty((len(order), embeddings.shape[1]), dtype=np.float32)
        _copy_in_order(embeddings, order, rows)
        return cls(rows, position)

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.position.nbytes)


def _copy_in_order(embeddings: np.ndarray, order: np.ndarray, out: np.ndarray) -> None:
    view = embeddings.view(np.ndarray) if isinstance(embeddings, np.memmap) else embeddings
    for start in range(0, len(order), 1 << 16):  # in pieces: no second index-sized temporary
        np.take(view, order[start : start + (1 << 16)], axis=0, out=out[start : start + (1 << 16)])


def _listed_file(embeddings: np.ndarray, order: np.ndarray, path: Path) -> np.ndarray | None:
    """The list-ordered rows mapped read-only from `path`, writing the file first when it is missing;
    None when it cannot be written or read, or its shape or sample rows disagree with `embeddings`."""
    shape = (len(order), int(embeddings.shape[1]))
    try:
        if not path.is_file():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=shape)
                _copy_in_order(embeddings, order, out)
                out.flush()
                del out
                try:  # atomic, and the first writer wins: every process then maps the same file
                    os.link(tmp, path)
                except FileExistsError:
                    pass
            finally:
                tmp.unlink(missing_ok=True)
        rows = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        logger.warning("list-ordered rows: cannot use %s (%s); keeping them in RAM", path, err)
        return None
    check = np.unique(np.linspace(0, len(order) - 1, num=min(len(order), 16)).astype(np.int64))
    if (
        rows.shape != shape
        or rows.dtype != np.float32
        or not np.array_equal(rows[check], np.asarray(embeddings[order[check]]))
    ):
        logger.warning("list-ordered rows: %s does not hold this version's rows; keeping them in RAM", path)
        return None
    return rows.view(np.ndarray)


def bounded_log_normaliser(
    queries: np.ndarray,
    embeddings: np.ndarray,
    stats: ListStats,
    temperatures: np.ndarray,
    config: NormaliserConfig | None = None,
    top_rows: np.ndarray | None = None,
    release: bool | None = None,
    listed: ListedRows | None = None,
) -> LogZ:
    """log Z estimate, deterministic bound and sampled interval for each query (see module doc), for the
    whole batch at once: the per-list bounds are (Q, L) arrays, and every row the batch reads (head lists,
    index-ranked rows, draws) is one gather-and-dot per query over (query, row) pairs (`_pair_dots`).

    queries (Q, D) float32 (unit or near-unit), embeddings (N, D), temperatures (Q,);
    top_rows (Q, K): rows the ANN index ranks first (-1 = none), also summed exactly -> LogZ.
    With `release` (default: `config.releases("bounded")`, i.e. keep unless release_pages=True), the
    scattered rows read from a read-only memory map are unmapped from the process as they are read
    (`_gather`, 16 MiB stretches) and after the batch (`release_pages` over the whole map). With `listed`
    (the same rows copied in list order) every row is read from the copy instead: the same float32 dot
    products, so the same answer.

    Two steps, `bounded_start` (everything the index's rows do not change: the head lists' dots and the
    first sample's draws and dots) and `bounded_finish` (the index's rows merged in), so that the start can
    run while the index searches (`Normaliser.search_and_normalise`); the answer is the same either way."""
    start = bounded_start(queries, embeddings, stats, temperatures, config, release, listed)
    return bounded_finish(start, top_rows)


@dataclass(frozen=True, eq=False)
class BoundedStart:
    """What `bounded_start` computed for a batch before the index's top rows are known: the per-list
    bounds, the head lists' rows and their dots, and the first-stage draws of the tail with their dots."""

    inp: "_SampleInputs"
    config: "NormaliserConfig"
    slack: np.ndarray  # (Q,)
    log_hi: np.ndarray  # (Q, L) log U_l
    in_head: np.ndarray  # (Q, L) bool
    head_q: np.ndarray  # (P,) query of each head row
    head_r: np.ndarray  # (P,) the head rows
    head_s: np.ndarray  # (P,) float32 their similarities
    todo: np.ndarray  # queries with a tail to sample
    seeds: np.ndarray  # (len(todo),) uint64
    draws: "_Draws | None"  # the first stage's draws of `todo`


def bounded_start(
    queries: np.ndarray,
    embeddings: np.ndarray,
    stats: ListStats,
    temperatures: np.ndarray,
    config: NormaliserConfig | None = None,
    release: bool | None = None,
    listed: ListedRows | None = None,
) -> BoundedStart:
    """The part of `bounded_log_normaliser` that does not depend on the index's top rows: per-list bounds,
    the head lists (chosen by their bounds alone) and the first-stage sample of the tail lists (its draws
    depend on the query's seed and the tail's lists, not on which rows the index ranks first), with their
    dot products, which are most of the rows read."""
    config = config or NormaliserConfig(method="bounded")
    release = config.releases("bounded") if release is None else bool(release)
    q = np.ascontiguousarray(queries, dtype=np.float32)
    taus = np.asarray(temperatures, dtype=np.float64).reshape(-1)
    n_q, d = q.shape
    counts = stats.counts
    n_lists = len(counts)
    log_n = np.full(n_lists, -np.inf)
    np.log(counts, out=log_n, where=counts > 0)
    gamma = d * _U32 / (1 - d * _U32)
    xn = np.linalg.norm(q.astype(np.float64), axis=1)  # (Q,)
    # |<x, mu_l> computed - exact| <= (gamma + u) |x| |mu_l|; the exact path's fl(s_j) and ours differ
    # from s_j by <= gamma |x| (|y_j| ~ 1): one slack in the exponent covers all of them.
    slack = (3 * gamma + 2 * _U32) * xn * 1.0001 / taus  # (Q,)
    centre = (q @ stats.means.T).astype(np.float64) if n_q else np.zeros((0, n_lists))  # (Q, L) <x, mu_l>
    log_lo = log_n + centre / taus[:, None]  # (Q, L) log L_l
    log_hi = log_lo + bennett_log_bound(
        (xn / taus)[:, None] * stats.radius, (xn * xn / taus**2)[:, None] * stats.lam
    )  # log U_l
    in_head = _head_lists(log_hi, counts, config.head_rows)  # (Q, L) bool
    tail = ~in_head & (counts > 0)[None, :]
    inp = _SampleInputs(
        embeddings,
        stats,
        q,
        taus,
        centre,
        log_lo,
        tail,
        release,
        1.0 if config.control_variate else 0.0,
        listed,
    )
    # the head lists' rows, summed exactly
    hq, hl = np.nonzero(in_head)
    head_q, head_r = _expand_lists(stats, hq, hl)
    head_s = _dots(embeddings, listed, q, head_q, head_r, release)
    # the tail: queries with any tail list left get the first stage of the sample
    todo = np.flatnonzero(tail.any(axis=1)) if n_q else np.zeros(0, np.int64)
    seeds = np.array([_query_seed(q[i], float(taus[i])) for i in todo], dtype=np.uint64)
    draws = _draw_tail(inp, todo, seeds, np.full(len(todo), config.samples), 0) if len(todo) else None
    return BoundedStart(inp, config, slack, log_hi, in_head, head_q, head_r, head_s, todo, seeds, draws)


def bounded_finish(start: BoundedStart, top_rows: np.ndarray | None = None) -> LogZ:
    """`bounded_log_normaliser`'s answer from its start and the index's top rows (Q, K) (-1 = none): the
    top rows outside the head lists are summed exactly and taken out of the tail (its bounds, and each
    draw that hit one counts 0), then the estimate, a second stage where the first was too noisy, the
    bound, the interval and the exact fallback."""
    inp, config = start.inp, start.config
    q, taus, stats, embeddings, release = inp.q, inp.taus, inp.stats, inp.embeddings, inp.release
    n_q = q.shape[0]
    if n_q == 0:
        empty = np.zeros(0)
        return LogZ(
            empty,
            empty,
            empty,
            "bounded",
            empty,
            empty,
            config.level,
            np.zeros(0, np.int64),
            np.zeros(0, bool),
        )
    z = NormalDist().inv_cdf((1 + config.level) / 2)
    slack, in_head, log_lo, log_hi, centre = start.slack, start.in_head, inp.log_lo, start.log_hi, inp.centre

    # --- exactly summed rows: the head lists' rows (start) and the index-ranked rows outside them
    kq = kr = np.zeros(0, dtype=np.int64)
    if top_rows is not None and np.size(top_rows):
        top = np.sort(np.asarray(top_rows, dtype=np.int64).reshape(n_q, -1), axis=1)
        keep = top >= 0
        keep[:, 1:] &= top[:, 1:] != top[:, :-1]  # each row once per query
        kq, kr = np.nonzero(keep)
        kr = top[kq, kr]
        outside = ~in_head[kq, stats.where[kr].astype(np.int64)]
        kq, kr = kq[outside], kr[outside]
    s_known = _dots(embeddings, inp.listed, q, kq, kr, release)
    all_q = np.concatenate([start.head_q, kq])
    s_all = np.concatenate([start.head_s, s_known]).astype(np.float64)
    log_h = _group_logsumexp(s_all / taus[all_q], all_q, n_q)  # (Q,)
    rows_read = np.bincount(all_q, minlength=n_q).astype(np.int64)

    # --- bounds on the tail lists (the rest), adjusted for the known rows they hold
    tail = inp.tail
    lo_t = np.where(tail, log_lo, -np.inf)
    hi_t = np.where(tail, log_hi, -np.inf)
    if len(kq):
        _without_known(lo_t, hi_t, kq, kr, s_all[len(start.head_q) :], stats, centre, taus, slack)
    tail_lo = _rows_logsumexp(lo_t)
    tail_hi = _rows_logsumexp(hi_t)
    lower = np.logaddexp(log_h, tail_lo) - slack
    upper = np.logaddexp(log_h, tail_hi) + slack
    value = np.logaddexp(log_h, tail_lo)  # exact where nothing is left
    ilo = np.full(n_q, np.nan)
    ihi = np.full(n_q, np.nan)
    fallback = np.zeros(n_q, dtype=bool)
    # a tail all of whose rows are known has tail_hi -inf: nothing to sample (the start drew for it anyway)
    live = np.isfinite(tail_hi[start.todo])
    todo, seeds = start.todo[live], start.seeds[live]
    if len(todo):
        known_keys = np.sort(kq * np.int64(embeddings.shape[0]) + kr)
        draws = start.draws if live.all() else start.draws.subset(np.flatnonzero(live))
        log_t, log_se, m = _tail_estimate(inp, draws, known_keys)
        rows_read[todo] += m
        with np.errstate(over="ignore", invalid="ignore"):
            se_log = np.where(np.isfinite(log_t), np.exp(log_se - np.logaddexp(log_h[todo], log_t)), np.inf)
        again = (
            np.flatnonzero(se_log > config.target_se)
            if config.samples < config.max_samples
            else np.zeros(0, int)
        )
        if len(again):
            # two-stage: the first sample was a pilot that sizes a fresh one (se ~ 1/sqrt(M)); the estimate
            # and interval come from the fresh draws alone (another stream of the query's seed), so they stay
            # valid
            with np.errstate(over="ignore", invalid="ignore"):
                ratio = se_log[again] / config.target_se
                grow = np.where(np.isfinite(se_log[again]), ratio**2 * _STAGE2_MARGIN, np.inf)
            more = np.minimum(config.max_samples, np.ceil(config.samples * np.minimum(grow, 1e9))).astype(
                np.int64
            )
            t2, se2, m2 = _tail_estimate(inp, _draw_tail(inp, todo[again], seeds[again], more, 1), known_keys)
            log_t[again], log_se[again] = t2, se2
            rows_read[todo[again]] += m2
        lh = log_h[todo]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            # standard error of log Z^ (delta method: se(T^) / (H + T^)); too large -> exact
            noisy = ~np.isfinite(log_t) | (log_se - np.logaddexp(lh, log_t) > math.log(config.max_se))
            rel = z * np.exp(log_se - log_t)
            t_lo = np.where(rel < 1, log_t + np.log1p(-np.where(rel < 1, rel, 0.0)), -np.inf)
            t_hi = np.logaddexp(log_t, math.log(z) + log_se)
        fallback[todo[noisy]] = True
        # estimate and interval clipped to the deterministic bound on the tail
        t_lo_b, t_hi_b = tail_lo[todo], tail_hi[todo]
        log_t, t_lo, t_hi = (np.minimum(np.maximum(v, t_lo_b), t_hi_b) for v in (log_t, t_lo, t_hi))
        value[todo] = np.logaddexp(lh, log_t)
        # (no rounding slack on the interval: it is statistical, and the slack is a worst case ~100x the
        # typical float32 error, which would only inflate its coverage)
        ilo[todo] = np.maximum(np.logaddexp(lh, t_lo), lower[todo])
        ihi[todo] = np.minimum(np.logaddexp(lh, t_hi), upper[todo])
    if release:
        release_pages(embeddings)
    if fallback.any():  # one streaming pass for every query whose sample was too noisy
        value_x = log_normaliser(q[fallback], embeddings, taus[fallback], release=release)
        value[fallback] = value_x
        lower[fallback] = value_x - slack[fallback]  # float32 rounding of the exact pass
        upper[fallback] = value_x + slack[fallback]
        ilo[fallback] = ihi[fallback] = np.nan
        rows_read[fallback] += embeddings.shape[0]
    return LogZ(value, lower, upper, "bounded", ilo, ihi, config.level, rows_read, fallback)


def _head_lists(log_hi: np.ndarray, counts: np.ndarray, head_rows: int) -> np.ndarray:
    """(Q, L) bool: per query, the non-empty lists by decreasing upper bound until head_rows rows."""
    n_q, n_lists = log_hi.shape
    head = np.zeros((n_q, n_lists), dtype=bool)
    if head_rows <= 0:
        return head
    ranked = np.where(counts > 0, log_hi, -np.inf)
    # only the best ~head_rows / min list size lists can make the head: partial sort those
    nonempty = counts[counts > 0]
    cand = min(n_lists, head_rows // max(1, int(nonempty.min(initial=1))) + 1)
    if cand < n_lists:
        part = np.argpartition(-ranked, cand - 1, axis=1)[:, :cand]
        part = np.take_along_axis(
            part, np.argsort(-np.take_along_axis(ranked, part, 1), axis=1, kind="stable"), 1
        )
    else:
        part = np.argsort(-ranked, axis=1, kind="stable")
    size = counts[part]
    start = np.cumsum(size, axis=1) - size  # rows before each list
    take = (start < head_rows) & (size > 0)  # lists until >= head_rows rows
    rows = np.broadcast_to(np.arange(n_q)[:, None], part.shape)
    head[rows[take], part[take]] = True
    return head


def _expand_lists(stats: ListStats, lq: np.ndarray, ll: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query, row) pairs of every row of list ll[i] for query lq[i]."""
    lens = stats.counts[ll].astype(np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = np.cumsum(lens) - lens
    pos = np.arange(total, dtype=np.int64) - np.repeat(first - stats.offsets[ll], lens)
    return np.repeat(lq.astype(np.int64), lens), stats.order[pos].astype(np.int64)


def _dots(
    embeddings: np.ndarray,
    listed: ListedRows | None,
    q: np.ndarray,
    pq: np.ndarray,
    rows: np.ndarray,
    release: bool,
) -> np.ndarray:
    """`_pair_dots` over the list-ordered copy when there is one, else over `embeddings`."""
    if listed is not None:
        return _pair_dots(listed.rows, q, pq, listed.position[rows])
    return _pair_dots(embeddings, q, pq, rows, release)


def _pair_dots(
    embeddings: np.ndarray, q: np.ndarray, pq: np.ndarray, rows: np.ndarray, release: bool = False
) -> np.ndarray:
    """float32 <q[pq[i]], embeddings[rows[i]]> for every pair: one fused gather-and-dot per query over its
    rows (faiss `fvec_inner_products_by_idx`, each row read once from the map, no gathered copy; one call
    per query, so a query drawing 16 000 rows does not pad the others' to its length). With `release`
    the rows are first gathered in file order through `_gather`, which unmaps each 16 MiB stretch once
    read."""
    import faiss

    out = np.empty(len(rows), dtype=np.float32)
    if len(rows) == 0:
        return out
    base = embeddings.view(np.ndarray) if isinstance(embeddings, np.memmap) else embeddings
    if release and releasable(embeddings):
        uniq, inv = np.unique(rows, return_inverse=True)
        base, rows = _gather(embeddings, uniq, True), inv.astype(np.int64)
    base = np.ascontiguousarray(base, dtype=np.float32)
    q = np.ascontiguousarray(q, dtype=np.float32)
    d = q.shape[1]
    if q.shape[0] == 1 or not np.any(pq[1:] < pq[:-1]):  # one query, or pairs already grouped by query
        order, grouped = None, np.ascontiguousarray(rows, dtype=np.int64)
    else:
        order = np.argsort(pq, kind="stable")
        grouped = np.ascontiguousarray(rows[order], dtype=np.int64)
    dots = np.empty(len(rows), dtype=np.float32)
    per = np.bincount(pq, minlength=q.shape[0])
    start = 0
    for i in np.flatnonzero(per).tolist():  # one call per query over its own rows: no padding to the longest
        stop = start + int(per[i])
        faiss.fvec_inner_products_by_idx(
            faiss.swig_ptr(dots[start:stop]),
            faiss.swig_ptr(q[i]),
            faiss.swig_ptr(base),
            faiss.swig_ptr(grouped[start:stop]),
            d,
            1,
            stop - start,
        )
        start = stop
    if order is None:
        return dots
    out[order] = dots
    return out


def _group_logsumexp(v: np.ndarray, group: np.ndarray, n: int) -> np.ndarray:
    """logsumexp of v within each group 0..n-1 (-inf for an empty group)."""
    m = np.full(n, -np.inf)
    np.maximum.at(m, group, v)
    safe = np.where(np.isfinite(m), m, 0.0)
    acc = np.bincount(group, weights=np.exp(v - safe[group]), minlength=n)
    with np.errstate(divide="ignore"):
        return np.where(np.isfinite(m), safe + np.log(acc), m)


def _rows_logsumexp(a: np.ndarray) -> np.ndarray:
    """logsumexp along axis 1 of (Q, L), -inf rows staying -inf."""
    m = a.max(axis=1)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.where(np.isfinite(m), safe + np.log(np.exp(a - safe[:, None]).sum(axis=1)), m)


def _without_known(
    lo_t: np.ndarray,
    hi_t: np.ndarray,
    kq: np.ndarray,
    kr: np.ndarray,
    s_known: np.ndarray,
    stats: ListStats,
    centre: np.ndarray,
    taus: np.ndarray,
    slack: np.ndarray,
) -> None:
    """In place: per-(query, tail list) log bounds on the rows NOT already summed, for lists holding known
    rows.

    With h known rows of list l (sum of their similarities sigma, their exp-sum H_l), the rest has
    mean similarity (n_l <x, mu_l> - sigma) / (n_l - h), so by Jensen its sum is >= (n_l - h) *
    exp(that / tau) (rounding of the difference amplified by at most (n_l + h) / (n_l - h)); and it
    is S_l - H_l <= U_l - H_l."""
    n_lists = lo_t.shape[1]
    lists = stats.where[kr].astype(np.int64)
    key = kq * n_lists + lists
    uniq, inv = np.unique(key, return_inverse=True)
    uq, ul = uniq // n_lists, uniq % n_lists
    h = np.bincount(inv).astype(np.float64)
    sigma = np.bincount(inv, weights=s_known)
    log_h_l = _group_logsumexp(s_known / taus[kq], inv, len(uniq))
    n = stats.counts[ul].astype(np.float64)
    rest = n - h
    tau = taus[uq]
    hi_old = hi_t[uq, ul]
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_rest = (n * centre[uq, ul] - sigma) / rest
        extra = slack[uq] * ((n + h) / rest - 1)
        lo = np.where(rest > 0, np.log(rest) + mean_rest / tau - extra, -np.inf)
        gap = hi_old + np.log1p(-np.exp(np.minimum(log_h_l - hi_old, 0.0)))  # log(U_l - H_l)
    lo_t[uq, ul] = lo
    hi_t[uq, ul] = np.where(rest > 0, np.maximum(np.nan_to_num(gap, nan=-np.inf), lo), -np.inf)


@dataclass(frozen=True, eq=False)
class _SampleInputs:
    embeddings: np.ndarray
    stats: ListStats
    q: np.ndarray
    taus: np.ndarray
    centre: np.ndarray  # (Q, L)
    log_lo: np.ndarray  # (Q, L) log L_l
    tail: np.ndarray  # (Q, L) bool
    release: bool
    control: float = 1.0  # 1: y = exp(t) - t (control variate), 0: y = exp(t)
    listed: ListedRows | None = None


#: Fewest draws a list gets to be a stratum of its own (its variance estimate has MIN - 1 degrees of
#: freedom; with 2, the control-variate interval under-covered: 91 % at level 0.95 in the tests' clusters).
_MIN_STRATUM = 8
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _uniforms(seeds: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) doubles from (seed, counter) pairs: splitmix64's finaliser of seed + counter * golden,
    so a query's draws depend on its own seed and draw number only (not on the batch it is in)."""
    with np.errstate(over="ignore"):
        z = seeds + (counter.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True, eq=False)
class _Draws:
    """One stage's draws for queries `which` (W of them), before the known rows are taken out: per draw its
    query's place in `which` (dw), stratum (sid = w * (L + 1) + list, or + L for the pool), global query
    (qi), row, and t = (s - <x, mu_l>) / tau; per query the strata weights (W, L + 1) and log shift."""

    which: np.ndarray
    dw: np.ndarray
    sid: np.ndarray
    qi: np.ndarray
    rows: np.ndarray
    t: np.ndarray
    sw_all: np.ndarray
    shift: np.ndarray

    def subset(self, keep: np.ndarray) -> "_Draws":
        """The draws of queries which[keep] only (renumbered), each query's draws unchanged."""
        n_cols = self.sw_all.shape[1]
        renum = np.full(len(self.which), -1, dtype=np.int64)
        renum[keep] = np.arange(len(keep))
        mask = renum[self.dw] >= 0
        dw = renum[self.dw[mask]]
        return _Draws(
            self.which[keep],
            dw,
            dw * n_cols + self.sid[mask] % n_cols,
            self.qi[mask],
            self.rows[mask],
            self.t[mask],
            self.sw_all[keep],
            self.shift[keep],
        )


def _sample_tail(
    inp: _SampleInputs,
    which: np.ndarray,
    seeds: np.ndarray,
    samples: np.ndarray,
    stream: int,
    known_keys: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stratified importance sample of log T over the tail lists of queries `which`, with a control variate.

    With pi_l = L_l / sum_tail L, a list expecting (M - 2) pi_l >= _MIN_STRATUM draws is its own stratum
    with m_l = floor((M - 2) pi_l) draws; the other lists form one pooled stratum drawn with replacement (list
    ~ pi, row uniform) with the remaining (>= 2) draws. Per draw, t = (s - <x, mu_l>) / tau has mean exactly 0
    over its list (mu_l is the list's mean), so y = exp(t) - t has the mean of exp(t), S_l / L_l (pooled:
    sum_pool S / sum_pool L), with a much smaller variance where t is moderate (exp(t) - t = 1 + t^2 / 2 +
    ...): t is a control variate with known mean. T^ = sum_strata (L of the stratum) * mean y, Var^ =
    sum_strata L^2 * var(y) / m (strata are independent). A drawn row among the known ones (`known_keys`,
    sorted query * N + row, summed exactly) counts 0 - t, so T^ estimates the rest of the tail. Returns
    (log T^, log se, rows read), each (len(which),). `_draw_tail` then `_tail_estimate`: the draws do not
    depend on the known rows."""
    known = np.zeros(0, np.int64) if known_keys is None else known_keys
    return _tail_estimate(inp, _draw_tail(inp, which, seeds, samples, stream), known)


def _draw_tail(
    inp: _SampleInputs, which: np.ndarray, seeds: np.ndarray, samples: np.ndarray, stream: int
) -> _Draws:
    """The draws of `_sample_tail` and their dot products (the rows it reads)."""
    stats = inp.stats
    n_w = len(which)
    n_lists = inp.log_lo.shape[1]
    log_lo = np.where(inp.tail[which], inp.log_lo[which], -np.inf)  # (W, L)
    shift = log_lo.max(axis=1)  # finite: todo has a tail
    weight = np.exp(log_lo - shift[:, None])  # L_l / max L
    pi = weight / weight.sum(axis=1, keepdims=True)
    alloc = np.floor((samples[:, None] - 2) * pi).astype(np.int64)
    strat = alloc >= _MIN_STRATUM
    alloc = np.where(strat, alloc, 0)
    rest = samples - alloc.sum(axis=1)  # >= 2
    pooled = ~strat & (weight > 0)
    has_pool = pooled.any(axis=1)
    rest = np.where(has_pool, rest, 0)
    # stratified draws: alloc[w, l] rows of list l
    sw, sl = np.nonzero(strat)
    m_s = alloc[sw, sl]
    draw_w = [np.repeat(sw, m_s)]
    draw_l = [np.repeat(sl, m_s)]
    draw_sid = [np.repeat(sw * (n_lists + 1) + sl, m_s)]
    # pooled draws: a list from pi over the pool (inverse CDF on each query's row, offset by its index)
    n_pool = int(rest.sum())
    if n_pool:
        pw = np.repeat(np.arange(n_w), rest)
        nth = np.arange(n_pool) - np.repeat(np.cumsum(rest) - rest, rest)
        u = _uniforms(seeds[pw], nth * 2 + (4 * stream + 1) * np.uint64(1 << 40))
        p_pool = np.where(pooled, pi, 0.0)
        cdf = np.cumsum(p_pool, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            cdf = np.where(has_pool[:, None], cdf / cdf[:, -1:], 1.0)  # rows without a pool draw nothing
        cdf[cdf >= 1.0] = 1.0
        cdf[:, -1] = 1.0
        flat = (cdf + np.arange(n_w)[:, None]).reshape(-1)
        hit = np.searchsorted(flat, pw + u, side="right")
        hit = np.minimum(hit, (pw + 1) * n_lists - 1)
        draw_w.append(pw)
        draw_l.append(hit - pw * n_lists)
        draw_sid.append(pw * (n_lists + 1) + n_lists)
    dw, dl, sid = np.concatenate(draw_w), np.concatenate(draw_l), np.concatenate(draw_sid)
    # a row uniformly within each drawn list
    per = np.bincount(dw, minlength=n_w)
    by_query = np.argsort(dw, kind="stable")  # each query's draws in its own order (batch-free)
    nth = np.empty(len(dw), dtype=np.int64)
    nth[by_query] = np.arange(len(dw)) - np.repeat(np.cumsum(per) - per, per)
    u = _uniforms(seeds[dw], nth * 2 + (4 * stream + 2) * np.uint64(1 << 40))
    n_l = stats.counts[dl].astype(np.int64)
    within = np.minimum((u * n_l).astype(np.int64), n_l - 1)
    rows = stats.order[stats.offsets[dl] + within].astype(np.int64)
    qi = which[dw]
    s = _dots(inp.embeddings, inp.listed, inp.q, qi, rows, inp.release).astype(np.float64)
    t = (s - inp.centre[qi, dl]) / inp.taus[qi]  # mean 0 over each list
    sw_all = np.concatenate(
        [weight, np.where(pooled, weight, 0.0).sum(axis=1, keepdims=True)], axis=1
    )  # (W, L+1)
    return _Draws(which, dw, sid, qi, rows, t, sw_all, shift)


def _tail_estimate(
    inp: _SampleInputs, d: _Draws, known_keys: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_sample_tail`'s (log T^, log se, rows read) from its draws, a drawn known row counting 0 - t."""
    n_w, width1 = d.sw_all.shape
    dw, t = d.dw, d.t
    top = np.full(n_w, -np.inf)
    np.maximum.at(top, dw, t)
    top = np.where(np.isfinite(top), np.maximum(top, 0.0), 0.0)
    keys = d.qi * np.int64(inp.embeddings.shape[0]) + d.rows
    pos = np.searchsorted(known_keys, keys)
    is_known = (
        (pos < len(known_keys)) & (known_keys[np.minimum(pos, len(known_keys) - 1)] == keys)
        if len(known_keys)
        else np.zeros(len(keys), bool)
    )
    scale = np.exp(-top[dw])
    y = np.where(is_known, 0.0, np.exp(t - top[dw])) - t * scale * inp.control  # (exp(t) - t) / exp(top)
    sid = d.sid
    width = n_w * width1
    m = np.bincount(sid, minlength=width).astype(np.float64)
    mean = np.bincount(sid, weights=y, minlength=width) / np.maximum(m, 1)
    dev = y - mean[sid]
    var = np.bincount(sid, weights=dev * dev, minlength=width) / np.maximum(m - 1, 1)
    mean, var, m = (a.reshape(n_w, width1) for a in (mean, var, m))
    sw_all = d.sw_all * (m > 0)
    est = (sw_all * mean).sum(axis=1)
    se = np.sqrt((sw_all**2 * var / np.maximum(m, 1)).sum(axis=1))
    base = d.shift + top
    with np.errstate(divide="ignore"):
        log_t = np.where(est > 0, base + np.log(np.maximum(est, 1e-300)), -np.inf)
        log_se = np.where(est > 0, np.where(se > 0, base + np.log(np.maximum(se, 1e-300)), -np.inf), np.inf)
    return log_t, log_se, np.bincount(dw, minlength=n_w).astype(np.int64)


def _logsumexp(a: np.ndarray) -> float:
    if a.size == 0:
        return -math.inf
    m = float(np.max(a))
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.exp(a - m).sum()))


# ----------------------------------------------------------------------------- the per-version object


class Normaliser:
    """The normaliser of one index version: the resolved method and, for `bounded`, its ListStats."""

    def __init__(self, config: NormaliserConfig, method: str, stats: ListStats | None = None):
        assert method in ("exact", "bounded"), method
        assert method == "exact" or stats is not None, "bounded needs list statistics"
        self.config, self.method, self.stats = config, method, stats
        self.probe: dict | None = None  # `auto`'s timing probe, when it decided (`probe_costs`)
        self.index_recall: float | None = None  # the approximate index's build-time recall@10 (None: exact)
        self.listed: ListedRows | None = None  # bounded: the rows in list order, in RAM (`wants_listed`)
        self._pool = None  # `search_and_normalise`'s helper thread, made on first use

    @staticmethod
    def wants_listed(embeddings: np.ndarray, config: NormaliserConfig) -> bool:
        """Whether `bounded` reads a list-ordered in-RAM copy of these rows (`ListedRows`)."""
        nbytes = int(embeddings.shape[0]) * int(embeddings.shape[1]) * 4
        return not config.releases("bounded") and 0 < nbytes <= config.listed_max_bytes

    @classmethod
    def for_version(
        cls,
        embeddings: np.ndarray,
        index=None,
        config: NormaliserConfig | str | None = None,
        progress: bool = False,
        stored: "Callable[[], ListStats | None] | None" = None,
        index_recall: float | None = None,
        listed_path=None,
    ) -> "Normaliser":
        """Resolve `auto` for these embeddings; when the result is bounded, take the list statistics
        from `stored()` (the version's own file, `IndexVersion.list_stats`) or, where that gives
        None (a version written before they were stored), build them here with one pass over the rows.

        `index_recall`: the recall@10 the version's approximate index measured at build (None: an exact
        index). Where the size leaves `auto` open -- N * D within AUTO_PROBE_FACTOR x exact_max_macs, and
        (below exact_max_macs) an approximate index reaching `config.recall_target` -- and the version
        stores its list statistics, `probe_costs` times both paths (bounded with the index's search) and
        the cheaper is kept. Bounded answers take their top-k from the index, so below the recall target
        `auto` keeps exact, whose pass gives the exact top-k. `listed_path`: where the list-ordered copy
        is kept as a shared file (`config.listed_shared`; None: in RAM)."""
        config = NormaliserConfig.of(config)
        n, d = embeddings.shape
        method = choose_method(n, d, config)
        if method == "bounded" and n < 2:
            method = "exact"
        reaches = index_recall is None or index_recall >= config.recall_target
        ann = index_recall is not None and reaches
        stats = probe = listed = None
        if (
            config.method == "auto"
            and config.probe
            and n > config.head_rows + config.samples
            and n * d <= AUTO_PROBE_FACTOR * config.exact_max_macs
            and stored is not None
            and (n * d > config.exact_max_macs or ann)
            and reaches
        ):
            # between "surely small" and "surely large": time both on this machine, when the version
            # stores its list statistics (bounded needs them; building them here would cost a pass or more)
            stats = stored()
            if stats is not None:
                listed = (
                    ListedRows.build(embeddings, stats, listed_path)
                    if cls.wants_listed(embeddings, config)
                    else None
                )
                probe = probe_costs(embeddings, stats, config, index=index, listed=listed)
                method = probe["chosen"]
                logger.info(
                    "normaliser auto: exact %.2f / %.2f ms, bounded %.2f / %.2f ms per query (batch of %d "
                    "/ alone) -> %s",
                    probe["exact_ms"],
                    probe["exact_ms_1"],
                    probe["bounded_ms"],
                    probe["bounded_ms_1"],
                    probe["queries"],
                    method,
                )
        if method == "bounded":
            stats = stats if stats is not None else (stored() if stored is not None else None)
            if stats is None:
                if stored is not None:
                    logger.info(
                        "this index version stores no normaliser statistics (written before they were); "
                        "computing them from its %d rows",
                        n,
                    )
                stats = ListStats.build(embeddings, index, seed=config.kmeans_seed, progress=progress)
            advise_random(embeddings)
        out = cls(config, method, stats if method == "bounded" else None)
        if method == "bounded" and cls.wants_listed(embeddings, config):
            out.listed = listed if listed is not None else ListedRows.build(embeddings, stats, listed_path)
        out.probe = probe
        out.index_recall = index_recall
        return out

    def __call__(
        self,
        queries: np.ndarray,
        embeddings: np.ndarray,
        temperatures: np.ndarray,
        block: int = DEFAULT_BLOCK,
        top_rows: np.ndarray | None = None,
    ) -> LogZ:
        """log Z of each query; `top_rows` (Q, K): the index's best rows for them (bounded sums them
        exactly)."""
        if self.method == "exact":
            value = log_normaliser(
                queries, embeddings, temperatures, block, release=self.config.releases("exact")
            )
            return LogZ.exact(value, int(embeddings.shape[0]))
        return bounded_log_normaliser(
            queries,
            embeddings,
            self.stats,
            temperatures,
            self.config,
            top_rows,
            release=self.config.releases("bounded"),
            listed=self._listed_for(embeddings),
        )

    def search_and_normalise(
        self,
        queries: np.ndarray,
        embeddings: np.ndarray,
        temperatures: np.ndarray,
        search: Callable[[], np.ndarray],
        block: int = DEFAULT_BLOCK,
    ) -> tuple[LogZ, np.ndarray]:
        """(log Z, the index's top rows `search()`) for one batch. For `bounded` and a single query,
        `bounded_start` (the head lists' and the first sample's dot products: most of the rows read) runs on
        a helper thread while `search()` runs on this one -- both release the GIL in FAISS -- and the top
        rows are merged in after (`bounded_finish`): the same answer as one after the other, about the
        index search's time sooner. Larger batches (concurrent load, both cores busy) run one after the
        other."""
        if self.method != "bounded" or len(queries) != 1 or not self.config.overlap:
            top = search()
            return self(queries, embeddings, temperatures, block, top_rows=top), top
        started = self._helper().submit(
            bounded_start,
            queries,
            embeddings,
            self.stats,
            temperatures,
            self.config,
            self.config.releases("bounded"),
            self._listed_for(embeddings),
        )
        try:
            top = search()
        finally:
            start = started.result()
        return bounded_finish(start, top), top

    def _helper(self):
        """The one helper thread of `search_and_normalise` (made on first use, daemon: it holds no state)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="normaliser")
        return self._pool

    def _listed_for(self, embeddings: np.ndarray) -> "ListedRows | None":
        return (
            self.listed if self.listed is not None and len(self.listed.position) == len(embeddings) else None
        )

    def describe(self) -> dict:
        out = {
            "method": self.method,
            "requested": self.config.method,
            "release_pages": self.config.releases(self.method),
            "top_k_from": "index" if self.method == "bounded" else "exact pass",
            "index_recall": self.index_recall,
            "recall_target": self.config.recall_target,
        }
        if self.probe is not None:
            out["probe"] = dict(self.probe)
        if self.stats is not None:
            out.update(
                partition=self.stats.source,
                head_rows=self.config.head_rows,
                samples=self.config.samples,
                level=self.config.level,
                target_se=self.config.target_se,
                max_se=self.config.max_se,
                stats_bytes=self.stats.nbytes,
                listed_bytes=self.listed.nbytes if self.listed is not None else 0,
                listed_shared=self.listed is not None and self.listed.path is not None,
            )
        return out
