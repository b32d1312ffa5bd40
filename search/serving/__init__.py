"""search.serving: what a server process imports — the online `Searcher` (FAISS top-k plus the softmax
probabilities p(j|x) = exp(s_j/tau) / Z(x)), its normaliser Z (exact or bounded) and the serving encoder.
Never imports search.evaluation (a test checks it), so a server loads no evaluation code."""
from search.serving.normaliser import ListStats, LogZ, Normaliser, NormaliserConfig, bounded_log_normaliser, log_normaliser
from search.serving.searcher import Hit, Searcher

__all__ = ["Hit", "ListStats", "LogZ", "Normaliser", "NormaliserConfig", "Searcher", "bounded_log_normaliser",
           "log_normaliser"]
