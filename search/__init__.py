"""softsearch.search: the query layer — learned vs ideal softmax search (exact streaming
cross-entropy gap), the O(1/k) law, temperature calibration, retrieval metrics, representation
diagnostics, the evaluation report, the online Searcher and its softmax normaliser (exact or bounded)."""
from search.calibration import CalibrationResult, calibrate_temperature
from search.gap import GapResult, softmax_gap, softmax_gap_dense
from search.k_law import KLawResult, k_law
from search.metrics import bootstrap_ci, knn_accuracy, map_at_k, precision_at_k, recall_at_k
from search.normaliser import ListStats, LogZ, Normaliser, NormaliserConfig, bounded_log_normalizer, log_normalizer
from search.quality import evaluate_version
from search.searcher import Hit, Searcher

__all__ = [
    "CalibrationResult", "GapResult", "Hit", "KLawResult", "ListStats", "LogZ", "Normaliser", "NormaliserConfig",
    "Searcher", "bootstrap_ci", "bounded_log_normalizer", "calibrate_temperature", "evaluate_version", "k_law",
    "knn_accuracy", "log_normalizer",
    "map_at_k", "precision_at_k", "recall_at_k", "softmax_gap", "softmax_gap_dense",
]
