"""Values the `softsearch index` parser shows (index kinds, the gate's margin), kept apart from FAISS and
numpy so that `softsearch index ... --help` and a mistyped flag load neither."""
from __future__ import annotations

KINDS = ("flat", "ivf-flat", "ivf-pq", "hnsw")
DEFAULT_MARGIN = 0.01      # quality gate: a candidate may score this much lower (noise) and still pass
