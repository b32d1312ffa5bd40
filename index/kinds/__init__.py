"""The registry of index kinds: one module per kind (flat.py, ivf.py, ivf_pq.py, hnsw.py), each an `IndexKind`
(index/kinds/base.py) registered by name. Everything that depends on the kind asks it here, so adding a kind
is one module plus one `register` call (a line in BUILTIN, or at run time). No FAISS import: the command-line
parser lists the names."""

from __future__ import annotations

from index.kinds.base import ID_BYTES, RERANK_PQ, IndexKind

__all__ = [
    "IndexKind",
    "ID_BYTES",
    "RERANK_PQ",
    "DEFAULT",
    "register",
    "unregister",
    "get",
    "find",
    "names",
    "of_index",
]

_REGISTRY: dict[str, IndexKind] = {}
#: the kind of a build that names none
DEFAULT = "flat"


def register(kind: IndexKind) -> IndexKind:
    """Add `kind` under `kind.name` (a name already registered is refused); returns it."""
    if not isinstance(kind, IndexKind) or not kind.name or kind.name == "auto":
        raise ValueError(
            f"an index kind is an IndexKind instance with a name other than 'auto', got {kind!r}"
        )
    if kind.name in _REGISTRY:
        raise ValueError(f"index kind {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind registered at run time (e.g. by a test)."""
    _REGISTRY.pop(name, None)


def find(name: str | None) -> IndexKind | None:
    """The kind called `name`, or None."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get(name: str) -> IndexKind:
    """The kind called `name`; ValueError naming the registered ones otherwise."""
    kind = find(name)
    if kind is None:
        raise ValueError(f"unknown index kind {name!r}; expected one of {', '.join(_REGISTRY)} (or 'auto')")
    return kind


def names() -> tuple[str, ...]:
    """Registered kind names, in registration order."""
    return tuple(_REGISTRY)


def of_index(index) -> IndexKind:
    """The kind of a (downcast) CPU index object; ValueError when no registered kind matches."""
    for kind in reversed(list(_REGISTRY.values())):  # a later, more specific kind wins
        if kind.matches(index):
            return kind
    raise ValueError(f"unsupported index type {type(index).__name__}")


def _register_builtin() -> None:
    from index.kinds import flat, hnsw, ivf, ivf_pq

    for module in (flat, ivf, ivf_pq, hnsw):
        register(module.KIND)


_register_builtin()
