"""softsearch.index: FAISS indexes of encoder embeddings in immutable, checksummed versions with
an atomically switched `current` pointer and the encoder weights inside the store; build,
rebuild, add, sync, delete, export, import, activate, rollback."""

from __future__ import annotations

from index.lazy import lazy_exports

_HOMES = {
    "ActivationRefused": "index.gate",
    "QualityGateError": "index.gate",
    "activation_checks": "index.gate",
    "gate_for": "index.gate",
    "add_items": "index.build",
    "build_index": "index.build",
    "rebuild_index": "index.build",
    "BuildOptions": "index.build",
    "build_from_vectors": "index.build",
    "add_vectors": "index.build",
    "CommitOptions": "index.options",
    "EmbedOptions": "index.options",
    "Staged": "index.commit",
    "choose_kind": "index.faiss_index",
    "create_index": "index.faiss_index",
    "exact_neighbours": "index.faiss_index",
    "recall_at_k": "index.faiss_index",
    "tune": "index.faiss_index",
    "ListStats": "index.list_stats",
    "IndexCorruptError": "index.manifest",
    "ModelStore": "index.models",
    "load_version_encoder": "index.models",
    "IndexStore": "index.store",
    "IndexVersion": "index.store",
    "delete_items": "index.sync",
    "sync_index": "index.sync",
    "export_version": "index.transfer",
    "import_version": "index.transfer",
}
__all__ = sorted(_HOMES)

__getattr__ = lazy_exports(__name__, _HOMES)  # `import index` loads neither torch nor FAISS
