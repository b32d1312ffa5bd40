"""softsearch.search: the query layer, in two halves that never import each other.

- ``search.serving``: what a server process needs — the online `Searcher` and its softmax normaliser
  (exact or bounded), the serving encoder.
- ``search.evaluation``: offline measurement — the learned-vs-ideal cross-entropy gap, the O(1/k) law,
  temperature calibration, retrieval metrics, representation diagnostics, the report.

Names below resolve lazily (PEP 562), so ``import search`` loads neither half until a name is used.
"""
from __future__ import annotations

import importlib

_HOMES = {
    "Hit": "search.serving.searcher", "Searcher": "search.serving.searcher",
    "ListStats": "search.serving.normaliser", "LogZ": "search.serving.normaliser",
    "Normaliser": "search.serving.normaliser", "NormaliserConfig": "search.serving.normaliser",
    "bounded_log_normalizer": "search.serving.normaliser", "log_normalizer": "search.serving.normaliser",
    "CalibrationResult": "search.evaluation.calibration", "calibrate_temperature": "search.evaluation.calibration",
    "GapResult": "search.evaluation.gap", "softmax_gap": "search.evaluation.gap",
    "softmax_gap_dense": "search.evaluation.gap",
    "KLawResult": "search.evaluation.k_law", "k_law": "search.evaluation.k_law",
    "bootstrap_ci": "search.evaluation.metrics", "knn_accuracy": "search.evaluation.metrics",
    "map_at_k": "search.evaluation.metrics", "precision_at_k": "search.evaluation.metrics",
    "recall_at_k": "search.evaluation.metrics",
    "evaluate_version": "search.evaluation.quality",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'search' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
