"""`--kind auto`: which kind (and parameters) a collection of N rows of D dims gets under a memory budget."""

from __future__ import annotations

import os

from index.kinds import get
from index.kinds.base import ID_BYTES, RERANK_PQ
from index.kinds.ivf import default_nlist
from index.kinds.ivf_pq import default_pq_m

SMALL_COUNT = 100_000
IVF_MIN_COUNT = 1_000  # below this an IVF partition is pointless


def default_memory_budget() -> int:
    """A quarter of physical memory: the default budget for `choose_kind`."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 4 << 30


def _sized(name: str, dim: int, count: int, **given) -> tuple[dict, int]:
    kind = get(name)
    params = kind.params(dim, count, given)
    return params, kind.bytes(dim, count, params)


def choose_kind(count: int, dim: int, memory_budget_bytes: int | None = None) -> tuple[str, dict]:
    """Pick (kind, params) for `--kind auto`, in the spirit of autofaiss.

    Rules, first match wins (budget defaults to a quarter of RAM):
    1. N < 1,000, or N <= 100,000 and the flat index fits the budget -> ``flat``
       (exact; brute force over <= 1e5 rows costs a few ms per query).
    2. The full vectors (IVF-Flat size) fit the budget -> ``ivf-flat`` with nlist ~ 4 sqrt(N).
    3. Otherwise memory is tight -> ``ivf-pq`` with nlist ~ 4 sqrt(N) and the largest
       sub-quantizer count m (bytes per vector, a divisor of D) whose codes fit the budget, served
       with re-ranking: the top k*r candidates of the codes are re-scored exactly from the full
       vectors, which stay memory-mapped on disk (the budget bounds the in-RAM index, not them);
       the build tunes r = k'/k together with nprobe (`tune(..., embeddings=)`).
    HNSW is never chosen automatically (it costs more memory than IVF-Flat for a latency win
    at batch 1); ask for it with ``--kind hnsw``.
    """
    if count < 1 or dim < 1:
        raise ValueError(f"choose_kind needs count >= 1 and dim >= 1, got count={count}, dim={dim}")
    budget = default_memory_budget() if memory_budget_bytes is None else int(memory_budget_bytes)
    if budget <= 0:
        raise ValueError(f"memory budget must be positive, got {memory_budget_bytes}")
    flat, flat_bytes = _sized("flat", dim, count)
    if count < IVF_MIN_COUNT or (count <= SMALL_COUNT and flat_bytes <= budget):
        return "flat", flat
    ivf, ivf_bytes = _sized("ivf-flat", dim, count)
    if ivf_bytes <= budget:
        return "ivf-flat", ivf
    nlist = default_nlist(count)
    fixed = nlist * dim * 4 + 256 * dim * 4  # coarse centroids + PQ codebooks (8 bits)
    per_vector = (budget - fixed) // count - ID_BYTES
    if per_vector < 1:
        raise ValueError(
            f"memory budget {budget} bytes is too small for {count} vectors even with 1-byte PQ codes"
        )
    m = default_pq_m(dim, min(per_vector, dim))
    return "ivf-pq", _sized("ivf-pq", dim, count, nlist=nlist, m=m, rerank=RERANK_PQ)[0]


def suggest_kind(kind: str, params: dict, count: int, dim: int, target: float) -> str:
    """A hint naming what reaches a recall target when `kind` with `params` did not (for refusals).

    `--kind auto` (`choose_kind`) picks flat or ivf-flat whenever the full vectors fit the memory
    budget; both reach any target (flat is exact, IVF-Flat reaches 1.0 at nprobe = nlist)."""
    auto = choose_kind(max(count, 1), max(dim, 1))[0] if count and dim else "flat"
    return get(kind).suggest(params, count, dim, auto)
