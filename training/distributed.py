"""Multi-process data-parallel training helpers (torchrun / DDP).

`softsearch train` runs unchanged under `torchrun --nproc-per-node N`: torchrun sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `init_distributed` reads them and starts
a process group (NCCL on GPU, Gloo on CPU). Without those variables everything here is a no-op
for a single process.

How the contrastive loss is split (see training/losses.py for the layout):

* rank r holds pairs [r n, (r + 1) n) of the global batch of N = W n pairs and embeds
  z_local = cat(view_a_local, view_b_local), (2n, D);
* `gather_embeddings` all-gathers z_local *with gradient* (torch.distributed.nn.functional
  .all_gather, whose backward sums the incoming gradients over ranks) and reorders the result
  to z_all = cat(view_a_global, view_b_global), (2N, D), the single-process order;
* rank r computes the loss of its 2n anchors against all 2N candidates and averages over them.

Gradient scaling (why the per-rank loss needs no extra factor). Let l_i be anchor i's term, so
the single-process loss is L = (1 / 2N) sum_i l_i and rank r's loss is L_r = (1 / 2n) sum_{i in r} l_i,
hence sum_r L_r = (N / n) L = W L. Every L_s depends on every rank's embeddings through the
gathered z_all; the all_gather backward sums dL_s / dz_r over s, so after backward rank r holds
g_r = d(sum_s L_s)/dz_r * dz_r/dtheta. DDP then averages: (1 / W) sum_r g_r = (1 / W) d(W L)/dtheta
= dL/dtheta, exactly the single-process gradient on the concatenated batch. Parameters outside
the DDP module (a learnable temperature) are averaged by `average_gradients` for the same reason.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "DistInfo",
    "init_distributed",
    "shutdown_distributed",
    "distributed_session",
    "leave_process_group",
    "gather_embeddings",
    "gather_detached",
    "all_reduce_mean",
    "average_gradients",
    "barrier",
    "resolve_device",
    "torchrun_env",
]


@dataclass
class DistInfo:
    """Where this process sits: rank / world_size / local_rank and the torch device it uses."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    owns_group: bool = False  # True when init_distributed created the process group

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_device(device=None) -> torch.device:
    """`device` as a torch.device, or CUDA when available and the CPU otherwise (the one default every
    evaluation, search and index path uses)."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """ "auto" -> cuda:LOCAL_RANK if available, else cpu; "cuda" -> cuda:LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device={device!r} is not a torch device ({err})") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    return dev


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK); (0, 1, 0)
    for a single process. The one reader of these variables (training and index embedding)."""
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Join the torchrun process group if WORLD_SIZE > 1 (else single process); pick the device."""
    rank, world_size, local_rank = torchrun_env()
    dev = resolve_device(device, local_rank)
    if world_size <= 1:
        return DistInfo(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": dev} if dev.type == "cuda" else {}),
        )
        owns = True
    info = DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        backend=dist.get_backend(),
        owns_group=owns,
    )
    logger.info("distributed: rank %d/%d on %s (%s)", info.rank, info.world_size, dev, info.backend)
    return info


def shutdown_distributed(info: DistInfo) -> None:
    """Destroy the process group if `init_distributed` created it, without a handshake (the error path: a
    peer may sit inside a collective)."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def distributed_session(device: str = "auto"):
    """`init_distributed(device)` for the body; on success every rank leaves together (`leave_process_group`),
    on an exception the group is destroyed at once (`shutdown_distributed`) and the exception goes on."""
    info = init_distributed(device)
    try:
        yield info
    except BaseException:
        shutdown_distributed(info)
        raise
    if info.owns_group and dist.is_initialized():
        leave_process_group()


def leave_process_group(settle_s: float = 0.05) -> None:
    """Barrier, let the backend's worker threads settle, then destroy the default process group.

    gloo's worker thread frees a finished collective just after waking its caller, and the free takes the
    GIL. If the interpreter is already finalizing by then, the thread is unwound inside a noexcept
    destructor and the process aborts ("terminate called without an active exception", SIGABRT; a core
    of the flaky CI test showed ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> take_gil). Holding the
    barrier's work and sleeping (which releases the GIL) lets the worker finish its free first.
    """
    work = dist.barrier(async_op=True)
    work.wait()
    time.sleep(settle_s)
    del work
    dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def gather_embeddings(z_local: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """(2n, D) local cat(view_a, view_b) -> (2N, D) global cat(view_a_global, view_b_global), with grad."""
    if not info.enabled:
        return z_local
    from torch.distributed.nn.functional import all_gather

    n = z_local.shape[0] // 2
    with warnings.catch_warnings():  # deprecated in favour of a private API; still correct
        warnings.simplefilter("ignore", FutureWarning)
        parts = all_gather(z_local)  # W x (2n, D), differentiable; backward sums grads over ranks
    view_a = torch.cat([p[:n] for p in parts])  # (N, D) rank order = global pair order
    view_b = torch.cat([p[n:] for p in parts])  # (N, D)
    return torch.cat([view_a, view_b])  # (2N, D)


def gather_detached(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """cat over ranks (rank order) of a per-anchor tensor, without gradient: the loss `gather` hook.

    Ranks' anchor blocks are ordered rank 0's (a, b), rank 1's (a, b), ...; statistics that only
    depend on the multiset of values (means, quantiles, maxima) equal the single-process ones.
    """
    x = x.detach()
    if not info.enabled:
        return x
    parts = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def all_reduce_mean(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Mean over ranks of a tensor (a copy, detached)."""
    x = x.detach().clone()
    if info.enabled:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= info.world_size
    return x


def average_gradients(params, info: DistInfo) -> None:
    """Average .grad over ranks for parameters that DDP does not manage (e.g. learnable tau)."""
    if not info.enabled:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= info.world_size
