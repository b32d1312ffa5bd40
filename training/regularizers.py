"""Vanishing Gaussianity regulariser of docs/theory.md §4 (arXiv 2602.24012).

    R(h) = E|h|^2 - log det Cov(h),      added to the loss with weight alpha_t -> 0,

on the pre-normalisation features h of the batch: low feature norm and high feature entropy
(a Gaussian's entropy is (1/2) log det (2 pi e Cov)). For fixed covariance the minimiser over
scale is Cov = I: with Cov = s I in D dims, R = D s - D log s (+ |mean|^2), minimised at s = 1.
The paper shows that with alpha_t -> 0 InfoNCE training keeps its limit and the representation
tends to a Gaussian under milder assumptions. The weight schedule is the project's own choice:
alpha_t = alpha_0 / (1 + t / decay_steps).
"""

from __future__ import annotations

import torch

RIDGE = 1e-4  # added to the covariance diagonal so log det stays finite when B <= D or h is degenerate


def gaussian_regularizer(h: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """E|h|^2 - log det(Cov(h) + ridge I) over a batch of features h (B, D); differentiable."""
    if h.dim() != 2 or h.shape[0] < 2:
        raise ValueError(f"need a (B, D) batch with B >= 2, got shape {tuple(h.shape)}")
    h = h.double() if h.dtype == torch.float64 else h.float()
    b, d = h.shape
    hc = h - h.mean(dim=0, keepdim=True)  # (B, D)
    cov = hc.T @ hc / (b - 1) + ridge * torch.eye(d, dtype=h.dtype, device=h.device)  # (D, D) unbiased
    return (h * h).sum(dim=1).mean() - torch.linalg.slogdet(cov).logabsdet


def vanishing_weight(step: int, alpha0: float, decay_steps: float) -> float:
    """alpha_t = alpha_0 / (1 + t / decay_steps): positive, decreasing, -> 0."""
    if alpha0 < 0 or decay_steps <= 0:
        raise ValueError(f"need alpha0 >= 0 and decay_steps > 0, got {alpha0}, {decay_steps}")
    return alpha0 / (1.0 + step / decay_steps)


def koleo(z: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """KoLeo spread term (Sablayrolles et al. 2019, SSCD's entropy regulariser): -mean_i log(min_{j != i}
    |z_i - z_j| + eps) over a batch (B, D) of embeddings -- large when two rows nearly coincide, so adding it
    to a contrastive loss spreads the embeddings (the Kozachenko-Leonenko entropy estimate, up to
    constants)."""
    if z.dim() != 2 or z.shape[0] < 2:
        raise ValueError(f"need a (B, D) batch with B >= 2, got shape {tuple(z.shape)}")
    sq = (z * z).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2.0 * z @ z.T).clamp_min(0.0)  # (B, B) squared distances
    d2 = d2 + torch.diag(torch.full((z.shape[0],), float("inf"), dtype=z.dtype, device=z.device))
    return -torch.log((d2.min(dim=1).values + eps * eps).sqrt() + eps).mean()
