"""softsearch.search: the query layer, in two halves that never import each other.

- ``search.serving``: what a server process needs — the online `Searcher` and its softmax normaliser
  (exact or bounded), the serving encoder.
- ``search.evaluation``: offline measurement — the learned-vs-ideal cross-entropy gap, the O(1/k) law,
  temperature calibration, retrieval metrics, representation diagnostics, the report.

Names below resolve lazily (PEP 562), so ``import search`` loads neither half until a name is used.
"""

from __future__ import annotations

import importlib

from index.lazy import lazy_exports

_SERVING_HOMES = {
    "Hit": "search.serving.searcher",
    "Searcher": "search.serving.searcher",
    "ListStats": "search.serving.normaliser",
    "LogZ": "search.serving.normaliser",
    "Normaliser": "search.serving.normaliser",
    "NormaliserConfig": "search.serving.normaliser",
    "bounded_log_normaliser": "search.serving.normaliser",
    "log_normaliser": "search.serving.normaliser",
}
__all__ = sorted(_SERVING_HOMES)  # the evaluation names are search.evaluation's __all__
_serving = lazy_exports(__name__, _SERVING_HOMES)


def __getattr__(name: str):
    """Serving names resolve here; any other public name is looked up in search.evaluation (itself lazy),
    which is imported only then, so a server importing `search` never loads it."""
    if name in _SERVING_HOMES:
        return _serving(name)
    if name.startswith("_"):
        raise AttributeError(f"module 'search' has no attribute {name!r}")
    return getattr(importlib.import_module("search.evaluation"), name)
