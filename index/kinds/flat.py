"""``flat``: IndexFlatIP, exact brute force over the stored rows."""

from __future__ import annotations

from index.kinds.base import IndexKind


class Flat(IndexKind):
    name = "flat"
    exact = True

    def factory(self, params: dict) -> str:
        return "Flat"

    def bytes(self, dim: int, count: int, params: dict) -> int:
        return count * dim * 4

    def matches(self, index) -> bool:
        import faiss

        return isinstance(index, faiss.IndexFlat)


KIND = Flat()
