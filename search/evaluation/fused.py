"""Fused one-pass tile sums for the streaming gap (search/evaluation/gap.py), compiled with torch.compile.

The eager tile walk makes a dozen passes over every (bq, bn) tile (max, shift, exp, sum, for both
the learned and the ideal side): on a CPU it is bound by memory traffic and reaches about a fifth
of a plain matmul. Two changes make it one pass:

* **fixed shifts** instead of an online max: by Cauchy-Schwarz ``s_ij / tau <= |x_i| max_j |y_j|``
  and ``log r_ij <= |u_i| max_j |u_j|`` (latent oracle), so ``exp(value - shift_i) <= 1`` never
  overflows and the per-row sums simply add up across tiles (float64 between tiles). A row whose
  total is so small that underflowed terms could matter (``total < N * FLT_MIN / 1e-7``) is
  recomputed by the caller with the online-max path;
* **one compiled kernel** per tile shape (inductor: a vectorised C++ loop on CPU, Triton on GPU)
  reads the logit tile once and computes both exponentials and all four row sums; for the latent
  generator it also forms ``log r = u_q . u_n`` (2m-dim, m = 3 or so) in registers instead of
  writing a second tile.

Only full tiles go through the compiled kernel (one shape, one compilation); ragged edge tiles use
the identical eager formula. Compilation needs a C++ compiler (CPU) or Triton (GPU); if it is
missing or fails, everything falls back to the eager formula with a warning.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

logger = logging.getLogger(__name__)

__all__ = ["UNDERFLOW_PER_ITEM", "TileSums", "fused_supported"]

# A row total below N * UNDERFLOW_PER_ITEM may have lost more than 1e-7 of its mass to terms
# that underflowed below FLT_MIN (each lost term < 1.2e-38), so the caller recomputes it.
UNDERFLOW_PER_ITEM = torch.finfo(torch.float32).tiny / 1e-7


def latent_sums(
    lp: torch.Tensor,
    uq: torch.Tensor,
    un: torch.Tensor,
    shift_p: torch.Tensor,
    shift_q: torch.Tensor,
    *,
    broadcast: bool,
) -> tuple[torch.Tensor, ...]:
    """Row sums over a tile, with lr = uq . un (log r up to a constant) and w = exp(lr - shift_q):
    (sum exp(lp - shift_p), sum w, sum w * lp, sum w * lr), each (bq,) float32."""
    if broadcast:  # compiled: the 2m-term dot product is fused into the tile loop
        lr = (uq[:, None, :] * un[None, :, :]).sum(-1)  # (bq, bn)
    else:  # eager: a small matmul, no (bq, bn, 2m) temporary
        lr = uq @ un.T  # (bq, bn)
    w = torch.exp(lr - shift_q[:, None])
    return torch.exp(lp - shift_p[:, None]).sum(1), w.sum(1), (w * lp).sum(1), (w * lr).sum(1)


def partition_sum(lp: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """sum_j exp(lp_ij - shift_i), (bq,) float32."""
    return torch.exp(lp - shift[:, None]).sum(1)


def _latent_sums_fused(lp, uq, un, shift_p, shift_q):
    return latent_sums(lp, uq, un, shift_p, shift_q, broadcast=True)  # what torch.compile gets


def _latent_sums_eager(lp, uq, un, shift_p, shift_q):
    return latent_sums(lp, uq, un, shift_p, shift_q, broadcast=False)


# (compiled form, eager form) of each tile formula, indexed like TileSums._kernels()
_FORMULAS = ((_latent_sums_fused, _latent_sums_eager), (partition_sum, partition_sum))


def fused_supported(device: torch.device) -> bool:
    """Whether torch.compile can build kernels here (a C++ compiler on CPU, Triton on CUDA)."""
    if os.environ.get("SOFTSEARCH_NO_COMPILE"):
        return False
    if device.type == "cpu":
        return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return False


class TileSums:
    """The tile formulas, compiled once per process for the full-tile shape (`compiled=True`)
    or run eagerly. A compilation failure is logged once and turns this instance eager."""

    _compiled_latent = None
    _compiled_partition = None
    _failed = False  # a compilation failed in this process: later instances start eager

    def __init__(self, compiled: bool):
        self.compiled = compiled and not TileSums._failed

    @classmethod
    def _kernels(cls):
        if cls._compiled_latent is None:
            cls._compiled_latent, cls._compiled_partition = (
                torch.compile(fused, dynamic=False) for fused, _ in _FORMULAS
            )
        return cls._compiled_latent, cls._compiled_partition

    def _run(self, which: int, args: tuple, full: bool):
        if self.compiled and full:
            try:
                return self._kernels()[which](*args)
            except Exception as err:  # missing compiler, unsupported backend: stay correct, go eager
                logger.warning(
                    "torch.compile of the gap tile kernel failed (%s: %s); using the eager path",
                    type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "",
                )
                self.compiled = False
                TileSums._failed = True
        return _FORMULAS[which][1](*args)

    def latent(self, lp, uq, un, shift_p, shift_q, full: bool):
        return self._run(0, (lp, uq, un, shift_p, shift_q), full)

    def partition(self, lp, shift, full: bool):
        return self._run(1, (lp, shift), full)
