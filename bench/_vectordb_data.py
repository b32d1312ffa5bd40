"""The clustered vectors of bench/vs_vectordb.py and bench/profile_query.py: unit rows around random
centres (a stand-in for image embeddings, whose neighbours come in groups) and held-out queries drawn
the same way, plus a flat index store over them (`index.build.build_from_vectors`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def clustered(
    n: int, dim: int, clusters: int, queries: int, spread: float = 0.6, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(database (n, dim), queries (queries, dim)) float32 unit rows: a random unit centre per cluster plus
    Gaussian noise of norm ~`spread`, each row in a uniformly drawn cluster."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def draw(m: int) -> np.ndarray:
        out = np.empty((m, dim), dtype=np.float32)
        for start in range(0, m, 65536):  # bounded temporaries at 10^6 rows
            stop = min(m, start + 65536)
            c = rng.integers(0, clusters, stop - start)
            x = centres[c] + rng.standard_normal((stop - start, dim)).astype(np.float32) * (
                spread / np.sqrt(dim)
            )
            out[start:stop] = x / np.linalg.norm(x, axis=1, keepdims=True)
        return out

    return draw(n), draw(queries)


def flat_store(
    work: Path,
    n: int,
    dim: int,
    clusters: int,
    queries: int,
    kind: str = "flat",
    params: dict | None = None,
    target_recall: float = 0.95,
) -> tuple[Path, np.ndarray, np.ndarray]:
    """(store root, database, queries): a store of index `kind` over `clustered(...)` built once under `work`
    and reused (an approximate kind's knob tuned at build to `target_recall` on stored rows)."""
    from index.build import BuildOptions, build_from_vectors
    from index.store import IndexStore

    base, q = clustered(n, dim, clusters, queries)
    root = work / f"store_{kind}_{n}x{dim}"
    store = IndexStore(root)
    if not (root / "current").exists():
        vec = work / f"vectors_{n}x{dim}.npy"
        np.save(vec, base)
        build_from_vectors(
            vec,
            root,
            BuildOptions(kind=kind, params=params, force=True, progress=False, target_recall=target_recall),
        )
        vec.unlink()
    assert store.current_version() is not None
    return root, base, q
