"""Contrastive losses over the SimCLR NT-Xent layout, shared by single-process and DDP training.

Layout (the one convention every loss and the distributed trainer agree on):

* A *global* batch has N pairs (view_a[i], view_b[i]), i = 0..N-1.
  ``z_all = cat(view_a_global, view_b_global)``, shape (2N, D): row i is view a of pair i,
  row N + i is view b of pair i. Under DDP with W ranks of n = N / W pairs each,
  ``view_a_global = cat(view_a of rank 0, ..., view_a of rank W-1)`` (likewise view b), i.e.
  rank r owns pairs [r n, (r + 1) n) — exactly what ``torch.distributed.nn.all_gather`` in rank
  order followed by ``cat`` produces.
* The local anchors ``z_local = cat(view_a_local, view_b_local)`` (2n, D) are global rows
  ``local_offset + k`` (k < n) and ``N + local_offset + k`` (view b), with
  ``local_offset = r n`` the rank's first *pair*. Single process: n = N, local_offset = 0,
  z_local = z_all.
* Anchor row a (global index g) has candidates all 2N rows except itself (2N - 1 of them);
  its positive is the other view of the same pair: g + N if g < N else g - N.

``contrastive_similarities`` builds (sim, pos_index, self_index) for the local anchors;
``ContrastiveLoss.loss_from_similarities`` turns them into a loss averaged over the local
anchors. Because every anchor's term depends only on its own row, the mean over all 2N
anchors equals the mean over ranks of the per-rank means (equal n per rank); see
``training/distributed.py`` for why no extra gradient scaling is needed under DDP.

Batch statistics (for WEINCE: quantiles of per-anchor quantities, EMAs) must be computed over
the *global* batch so every rank uses identical values: ``loss_from_similarities`` receives a
``gather`` callable, ``gather(x)`` -> ``cat`` over ranks in rank order of a per-anchor tensor x
(shape (2n, ...) -> (2N', ...)), detached (no gradient). In a single process it is the
identity. Compute quantiles / means on ``gather(x)``, then use them for the local anchors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from training._registry import create_registered, make_register

logger = logging.getLogger(__name__)

__all__ = [
    "LossOutput",
    "ContrastiveLoss",
    "InfoNCELoss",
    "LOSSES",
    "register_loss",
    "create_loss",
    "contrastive_similarities",
    "identity_gather",
]

Gather = Callable[[torch.Tensor], torch.Tensor]


def identity_gather(x: torch.Tensor) -> torch.Tensor:
    """Single-process `gather`: the local tensor already is the global one (detached)."""
    return x.detach()


@dataclass
class LossOutput:
    """A scalar loss plus per-step scalar metrics for metrics.jsonl."""

    loss: torch.Tensor  # scalar
    stats: dict[str, float] = field(default_factory=dict)


LOSSES: dict[str, type["ContrastiveLoss"]] = {}


# @register_loss("name") class decorator; re-registering the same class (module reload) is accepted
register_loss = make_register(LOSSES, "loss", allow_same=True)


def _import_plugins() -> None:
    # Losses defined outside this module register themselves on import.
    try:
        import training.weince  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name != "training.weince":
            raise


def create_loss(name: str, **options) -> "ContrastiveLoss":
    """Build the loss registered as `name` ("infonce", "weince", ...) with keyword options."""
    return create_registered(LOSSES, "loss", name, plugins=_import_plugins, **options)


def available_losses() -> list[str]:
    """Names of all registered losses (importing plugin modules first)."""
    _import_plugins()
    return sorted(LOSSES)


def contrastive_similarities(
    z_local: torch.Tensor, z_all: torch.Tensor, local_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cosine similarities of the local anchors against all global candidates.

    z_local: (2n, D) = cat(view_a_local, view_b_local); z_all: (2N, D) = cat(view_a_global,
    view_b_global); local_offset: index of the first local *pair* in the global batch.
    Returns sim (2n, 2N) = z_local @ z_all.T, pos_index (2n,) and self_index (2n,), the global
    column of each anchor's positive and of the anchor itself.
    """
    if z_local.ndim != 2 or z_all.ndim != 2 or z_local.shape[1] != z_all.shape[1]:
        raise ValueError(
            f"need (2n, D) and (2N, D) embeddings, got {tuple(z_local.shape)} and {tuple(z_all.shape)}"
        )
    two_n, two_big_n = z_local.shape[0], z_all.shape[0]
    if two_n % 2 or two_big_n % 2 or two_n == 0:
        raise ValueError(
            f"embedding counts must be even and positive (two views), got {two_n} and {two_big_n}"
        )
    n, big_n = two_n // 2, two_big_n // 2
    if not 0 <= local_offset <= big_n - n:
        raise ValueError(f"local_offset={local_offset} out of range for {n} local of {big_n} global pairs")
    k = torch.arange(n, device=z_local.device)
    self_a = local_offset + k  # (n,) global rows of local view-a anchors
    self_b = big_n + local_offset + k  # (n,) global rows of local view-b anchors
    self_index = torch.cat([self_a, self_b])  # (2n,)
    pos_index = torch.cat([self_b, self_a])  # (2n,) the other view of the same pair
    sim = z_local @ z_all.T  # (2n, 2N)
    return sim, pos_index, self_index


def _masked_logits(sim: torch.Tensor, self_index: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """Set each anchor's own column to -inf (it is not a candidate); None: every column is one
    (image-text rows, whose candidates are the other modality only)."""
    if self_index is None:
        return logits
    rows = torch.arange(sim.shape[0], device=sim.device)
    mask = torch.zeros_like(sim, dtype=torch.bool)
    mask[rows, self_index] = True
    return logits.masked_fill(mask, float("-inf"))


class ContrastiveLoss(nn.Module):
    """Base class: subclasses implement `loss_from_similarities`.

    `forward(z_a, z_b, temperature)` is the single-process entry point (N pairs of unit
    embeddings, (N, D) each). The distributed trainer calls `contrastive_similarities` on
    gathered embeddings and then `loss_from_similarities` with a cross-rank `gather`.
    """

    name: str = "base"

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor, temperature: float | torch.Tensor) -> LossOutput:
        if z_a.shape != z_b.shape:
            raise ValueError(f"views must have equal shapes, got {tuple(z_a.shape)} and {tuple(z_b.shape)}")
        z = torch.cat([z_a, z_b])  # (2N, D)
        sim, pos_index, self_index = contrastive_similarities(z, z, 0)
        return self.loss_from_similarities(sim, pos_index, self_index, temperature)

    def loss_from_similarities(
        self,
        sim: torch.Tensor,
        pos_index: torch.Tensor,
        self_index: torch.Tensor,
        temperature: float | torch.Tensor,
        gather: Gather = identity_gather,
    ) -> LossOutput:
        """Loss averaged over the 2n local anchors (rows of sim, (2n, 2N)).

        `gather(x)` concatenates a per-anchor tensor over ranks (detached); use it for any
        statistic shared across anchors so DDP ranks agree (see module docstring).
        """
        raise NotImplementedError

    def options(self) -> dict:
        """JSON-able constructor options for lineage (override when there are options)."""
        return {}


@register_loss("infonce")
class InfoNCELoss(ContrastiveLoss):
    """NT-Xent / InfoNCE: for anchor a with positive p and candidates C_a (all but a),

        loss_a = -s_ap / tau + log sum_{c in C_a} exp(s_ac / tau),

    averaged over anchors.
    """

    def loss_from_similarities(
        self, sim, pos_index, self_index, temperature, gather: Gather = identity_gather
    ):
        logits = _masked_logits(sim, self_index, sim / temperature)  # (2n, 2N)
        loss = F.cross_entropy(logits, pos_index)  # mean over the 2n local anchors
        with torch.no_grad():
            rows = torch.arange(sim.shape[0], device=sim.device)
            pos_sim = sim[rows, pos_index]  # (2n,)
            hit = (logits.argmax(dim=1) == pos_index).float()  # (2n,) positive ranked first
            stats = {
                "pos_sim_mean": float(gather(pos_sim).mean()),
                "top1_accuracy": float(gather(hit).mean()),
            }
        return LossOutput(loss=loss, stats=stats)
