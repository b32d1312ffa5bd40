"""Values the `softsearch index` parser shows (index kinds, the gate's margin), kept apart from FAISS and
numpy so that `softsearch index ... --help` and a mistyped flag load neither."""

from __future__ import annotations

from index.kinds import names as _kind_names

KINDS = _kind_names()  # the built-in kinds (index/kinds/), for --kind choices
DEFAULT_MARGIN = 0.01  # quality gate: a candidate may score this much lower (noise) and still pass
