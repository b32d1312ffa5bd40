"""search.evaluation: offline measurement of a version — the exact streaming cross-entropy gap between the
learned and the ideal softmax search, the O(1/k) law, temperature calibration, retrieval metrics,
representation diagnostics (normality, tails) and the HTML report. Loaded lazily (PEP 562)."""

from __future__ import annotations

from index.lazy import lazy_exports

_HOMES = {
    "CalibrationResult": "search.evaluation.calibration",
    "calibrate_temperature": "search.evaluation.calibration",
    "GapResult": "search.evaluation.gap",
    "softmax_gap": "search.evaluation.gap",
    "softmax_gap_dense": "search.evaluation.gap",
    "KLawResult": "search.evaluation.k_law",
    "k_law": "search.evaluation.k_law",
    "bootstrap_ci": "search.evaluation.metrics",
    "knn_accuracy": "search.evaluation.metrics",
    "map_at_k": "search.evaluation.metrics",
    "precision_at_k": "search.evaluation.metrics",
    "hit_rate_at_k": "search.evaluation.metrics",
    "evaluate_version": "search.evaluation.quality",
}
__all__ = sorted(_HOMES)

__getattr__ = lazy_exports(__name__, _HOMES)
