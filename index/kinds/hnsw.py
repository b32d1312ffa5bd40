"""``hnsw``: IndexHNSWFlat with inner product; search knob ``efSearch``. FAISS has no GPU HNSW."""

from __future__ import annotations

from index.kinds.base import IndexKind


class HNSW(IndexKind):
    name = "hnsw"
    search_param = "efSearch"
    gpu = False

    def params(self, dim: int, count: int, given: dict) -> dict:
        out = {
            "M": int(given.get("M", 32)),
            "efConstruction": int(given.get("efConstruction", 80)),
            "efSearch": int(given.get("efSearch", 64)),
        }
        if out["M"] < 2 or out["efConstruction"] < 1 or out["efSearch"] < 1:
            raise ValueError(f"hnsw parameters must be positive (M >= 2): {out}")
        return out

    def factory(self, params: dict) -> str:
        return f"HNSW{params['M']},Flat"

    def create(self, dim: int, params: dict):
        index = super().create(dim, params)
        index.hnsw.efConstruction = params["efConstruction"]
        return index

    def set_search(self, index, value: int) -> None:
        import faiss

        faiss.downcast_index(index).hnsw.efSearch = int(value)

    def tune_range(self, index, k: int) -> tuple[int, int]:
        return max(k, 16), max(2048, k)

    def bytes(self, dim: int, count: int, params: dict) -> int:
        # vectors + ~2*M neighbour ids (int32) on level 0; the levels above are ~1/M of that
        return count * (dim * 4 + params["M"] * 2 * 4 + 16)

    def matches(self, index) -> bool:
        import faiss

        return isinstance(index, faiss.IndexHNSW)

    def suggest(self, params: dict, count: int, dim: int, auto: str) -> str:
        return (
            f"rebuild with a larger graph (--param M={2 * int(params.get('M', 32))}) "
            f"or --kind {auto} (--kind auto)"
        )


KIND = HNSW()
