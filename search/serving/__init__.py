"""search.serving: what a server process imports — the online `Searcher` (FAISS top-k plus the softmax
probabilities p(j|x) = exp(s_j/tau) / Z(x)), its normaliser Z (exact or bounded) and the serving encoder.
Never imports search.evaluation (a test checks it), so a server loads no evaluation code. Names resolve
lazily (PEP 562), so a command's parser (search.serving.text_args) loads no torch or FAISS."""

from __future__ import annotations

from index.lazy import lazy_exports

_HOMES = {
    "Hit": "search.serving.searcher",
    "Searcher": "search.serving.searcher",
    "ListStats": "search.serving.normaliser",
    "LogZ": "search.serving.normaliser",
    "Normaliser": "search.serving.normaliser",
    "NormaliserConfig": "search.serving.normaliser",
    "bounded_log_normaliser": "search.serving.normaliser",
    "log_normaliser": "search.serving.normaliser",
}
__all__ = sorted(_HOMES)

__getattr__ = lazy_exports(__name__, _HOMES)
