"""softsearch.index: FAISS indexes of encoder embeddings in immutable, checksummed versions with
an atomically switched `current` pointer and the encoder weights inside the store; build,
rebuild, add, sync, delete, export, import, activate, rollback."""
from index.build import QualityGateError, add_items, build_index, rebuild_index
from index.faiss_index import choose_kind, create_index, exact_neighbours, recall_at_k, tune
from index.list_stats import ListStats
from index.manifest import IndexCorruptError
from index.models import ModelStore, load_version_encoder
from index.store import IndexStore, IndexVersion
from index.sync import delete_items, sync_index
from index.transfer import export_version, import_version

__all__ = [
    "IndexCorruptError", "IndexStore", "IndexVersion", "ListStats", "ModelStore", "QualityGateError",
    "add_items", "build_index", "choose_kind", "create_index", "delete_items", "exact_neighbours",
    "export_version", "import_version", "load_version_encoder", "rebuild_index", "recall_at_k",
    "sync_index", "tune",
]
