"""softsearch.index: FAISS indexes of encoder embeddings in immutable, checksummed versions with
an atomically switched `current` pointer; build, rebuild, add, activate, rollback."""
from index.build import QualityGateError, add_items, build_index, rebuild_index
from index.faiss_index import choose_kind, create_index, exact_neighbours, recall_at_k, tune
from index.manifest import IndexCorruptError
from index.store import IndexStore, IndexVersion

__all__ = [
    "IndexCorruptError", "IndexStore", "IndexVersion", "QualityGateError",
    "add_items", "build_index", "choose_kind", "create_index", "exact_neighbours",
    "rebuild_index", "recall_at_k", "tune",
]
