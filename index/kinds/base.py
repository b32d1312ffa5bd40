"""The contract an index kind fulfils: what index/faiss_index.py, build.py, stream.py, store.py and the gate
ask of a kind, so that none of them compares kind names. FAISS is imported inside methods, never at import
time, so the command-line parser can list the kinds without loading it."""

from __future__ import annotations

#: Bytes of the int64 id an inverted list stores next to every code (FAISS idx_t).
ID_BYTES = 8
#: Candidates per hit re-scored exactly for a re-ranked kind (`IndexKind.rerank`) whose manifest has no tuned
#: ``rerank`` (versions built before it was tuned); the codes' order is not the exact order.
RERANK_PQ = 4
#: Largest re-rank factor k'/k the build tunes (k' = 640 candidates at k = 10).
RERANK_MAX = 64


class IndexKind:
    """One FAISS index kind on unit rows with inner-product scores. Subclass, set the attributes, override
    `params`, `factory` and `bytes` (and `matches`), and `index.kinds.register` an instance."""

    #: the name in manifests, on the command line (--kind) and in the API
    name: str = ""
    #: the runtime search knob (FAISS ParameterSpace name, e.g. nprobe, efSearch); None: nothing to tune
    search_param: str | None = None
    #: results are the exact top k (no recall to measure)
    exact: bool = False
    #: a stored index accepts `add` without retraining (`index add`, `index sync`)
    addable: bool = True
    #: needs a training sample (coarse quantizer, codebooks); adding far beyond it degrades the partition
    trained: bool = False
    #: `index.stream` can build it with inverted lists on disk (IVF kinds)
    streamable: bool = False
    #: FAISS has a GPU version (index_cpu_to_all_gpus)
    gpu: bool = True
    #: codes are lossy: the server re-scores k * r candidates exactly from the stored rows (`rerank_factor`),
    #: and the build tunes r together with the search knob
    rerank: bool = False

    def params(self, dim: int, count: int, given: dict) -> dict:
        """Build and search parameters filled in from N and D; the given ones win. Every accepted key of
        `given` appears in the result (the caller refuses the rest); bad values raise ValueError."""
        return {}

    def factory(self, params: dict) -> str:
        """The faiss.index_factory description of (this kind, params)."""
        raise NotImplementedError

    def create(self, dim: int, params: dict):
        """An empty (untrained) CPU index with inner-product metric."""
        import faiss

        return faiss.index_factory(dim, self.factory(params), faiss.METRIC_INNER_PRODUCT)

    def set_search(self, index, value: int) -> None:
        """Apply the search knob to a CPU index."""

    def tune_range(self, index, k: int) -> tuple[int, int]:
        """(first, largest) value of the search knob `tune` doubles through."""
        return 1, 1

    def train_rows(self, params: dict) -> int:
        """Rows the training sample wants by default (0: no training)."""
        return 0

    def codebook_rows(self, params: dict) -> int:
        """Rows the codebooks need beyond the coarse quantizer's (a streamed build raises its sample to
        it)."""
        return 0

    def training_parts(self, index) -> list[tuple[str, object, int]]:
        """(what, FAISS ClusteringParameters, centroids) of every k-means the training runs."""
        return []

    def bytes(self, dim: int, count: int, params: dict) -> int:
        """Approximate resident bytes of `count` rows of `dim` (choose_kind, the benchmark)."""
        raise NotImplementedError

    def matches(self, index) -> bool:
        """True when the (downcast) CPU index object is of this kind (a stored index's kind is checked)."""
        return False

    def suggest(self, params: dict, count: int, dim: int, auto: str) -> str:
        """A hint for a refusal: what reaches the recall target when this kind did not (`auto`: what
        --kind auto chooses for count x dim)."""
        return "--kind flat is exact"

    def __repr__(self) -> str:
        return f"IndexKind({self.name!r})"
