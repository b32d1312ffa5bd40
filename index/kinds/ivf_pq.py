"""``ivf-pq``: inverted lists of product-quantised codes (``m`` bytes per vector at 8 bits); search knob
``nprobe``. Compact but lossy (recall can plateau), so it is served re-ranked: k * r candidates re-scored
exactly from the stored rows."""

from __future__ import annotations

import math

from index.kinds.base import ID_BYTES, RERANK_MAX
from index.kinds.ivf import IVFKind


def default_pq_m(dim: int, bytes_per_vector: int | None = None) -> int:
    """Largest divisor of dim that is <= the byte budget per vector (default dim // 4)."""
    target = bytes_per_vector if bytes_per_vector is not None else max(1, dim // 4)
    divisors = [m for m in range(1, dim + 1) if dim % m == 0 and m <= target]
    if not divisors:
        raise ValueError(f"no PQ sub-quantizer count fits {bytes_per_vector} bytes per vector (dim {dim})")
    return max(divisors)


class IVFPQ(IVFKind):
    name = "ivf-pq"
    rerank = True

    def code_params(self, dim: int, count: int, given: dict) -> dict:
        out = {"m": int(given.get("m", default_pq_m(dim)))}
        # 2^nbits centroids per sub-quantizer need enough training points.
        nbits_default = 8 if count >= 256 * 39 else max(1, min(8, int(math.log2(max(count // 39, 2)))))
        out["nbits"] = int(given.get("nbits", nbits_default))
        if dim % out["m"] != 0:
            raise ValueError(f"ivf-pq m={out['m']} must divide the dimension {dim}")
        if not 1 <= out["nbits"] <= 16:
            raise ValueError(f"ivf-pq nbits={out['nbits']} must be in 1..16")
        if "rerank" in given:  # k'/k re-scored exactly by the server (the build tunes it)
            out["rerank"] = int(given["rerank"])
            if out["rerank"] < 1:
                raise ValueError(f"ivf-pq rerank={out['rerank']} must be >= 1")
        return out

    def factory(self, params: dict) -> str:
        # "np": no polysemous training. It only serves Hamming pre-filtering, which search here
        # never uses, and costs ~4x the PQ training time at 8 bits.
        return f"IVF{params['nlist']},PQ{params['m']}x{params['nbits']}np"

    def codebook_rows(self, params: dict) -> int:
        return 64 * 2 ** params["nbits"]

    def training_parts(self, index) -> list[tuple[str, object, int]]:
        import faiss

        ivf = faiss.downcast_index(faiss.extract_index_ivf(index))
        return super().training_parts(index) + [("PQ codebooks", ivf.pq.cp, ivf.pq.ksub)]

    def bytes(self, dim: int, count: int, params: dict) -> int:
        code = math.ceil(params["m"] * params["nbits"] / 8)
        codebooks = params["m"] * (2 ** params["nbits"]) * (dim // params["m"]) * 4
        return count * (code + ID_BYTES) + params["nlist"] * dim * 4 + codebooks

    def matches(self, index) -> bool:
        import faiss

        return isinstance(index, faiss.IndexIVFPQ)

    def suggest(self, params: dict, count: int, dim: int, auto: str) -> str:
        if auto != self.name:
            return (
                f"--kind auto chooses {auto} for {count} x {dim} (full vectors, which reach the target); "
                f"or keep ivf-pq with more bytes per vector (--param m= a larger divisor of {dim})"
            )
        return (
            f"use more bytes per vector (--param m= a larger divisor of {dim}) or a larger --memory-budget "
            f"(re-ranking up to {RERANK_MAX}x k candidates from the stored vectors did not reach it)"
        )


KIND = IVFPQ()
