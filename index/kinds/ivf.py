"""``ivf-flat``: inverted lists over a flat-IP coarse quantizer with the full vectors in the lists; search
knob ``nprobe``. `IVFKind` holds what every IVF kind shares (nlist, nprobe, training, streaming)."""

from __future__ import annotations

import math

from index.kinds.base import ID_BYTES, IndexKind


def default_nlist(count: int) -> int:
    """nlist ~ 4 sqrt(N), capped so every list gets >= 39 training points (FAISS's own minimum)."""
    nlist = int(round(4 * math.sqrt(max(count, 1))))
    return max(1, min(nlist, count // 39 if count >= 39 else 1))


class IVFKind(IndexKind):
    """Inverted lists: nlist k-means cells, nprobe of them searched per query."""

    search_param = "nprobe"
    trained = True
    streamable = True

    def params(self, dim: int, count: int, given: dict) -> dict:
        out = {"nlist": int(given.get("nlist", default_nlist(count)))}
        out["nprobe"] = int(given.get("nprobe", min(out["nlist"], 8)))
        out.update(self.code_params(dim, count, given))
        if out["nlist"] < 1 or out["nlist"] > max(count, 1):
            raise ValueError(f"nlist={out['nlist']} must be in 1..{max(count, 1)} for {count} vectors")
        if not 1 <= out["nprobe"]:
            raise ValueError(f"nprobe={out['nprobe']} must be >= 1")
        out["nprobe"] = min(out["nprobe"], out["nlist"])
        return out

    def code_params(self, dim: int, count: int, given: dict) -> dict:
        """Parameters of the codes stored in the lists (none for full vectors)."""
        return {}

    def set_search(self, index, value: int) -> None:
        import faiss

        faiss.extract_index_ivf(index).nprobe = int(value)

    def tune_range(self, index, k: int) -> tuple[int, int]:
        import faiss

        return 1, int(faiss.extract_index_ivf(index).nlist)

    def train_rows(self, params: dict) -> int:
        return max(256 * params["nlist"], self.codebook_rows(params))

    def training_parts(self, index) -> list[tuple[str, object, int]]:
        import faiss

        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        return [("coarse quantizer", ivf.cp, ivf.nlist)]

    def suggest(self, params: dict, count: int, dim: int, auto: str) -> str:
        return (
            "rebuild with --kind flat (exact) or fewer lists (--param nlist=...); --kind auto chooses " + auto
        )


class IVFFlat(IVFKind):
    name = "ivf-flat"

    def factory(self, params: dict) -> str:
        return f"IVF{params['nlist']},Flat"

    def bytes(self, dim: int, count: int, params: dict) -> int:
        return count * (dim * 4 + ID_BYTES) + params["nlist"] * dim * 4

    def matches(self, index) -> bool:
        import faiss

        return isinstance(index, faiss.IndexIVFFlat)


KIND = IVFFlat()
