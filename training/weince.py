"""WEINCE: InfoNCE with an anchor-adaptive Weibull-shortfall logit blend (papers.md section 2).

Cosine similarity is capped at 1, so the hard-negative tail has a finite endpoint (the Weibull
domain of extreme-value theory) and its natural coordinate is the shortfall delta = 1 - s.
For anchor i and candidate j WEINCE uses the logit

    l_ij = (1 - lambda_i) * s_ij / tau + lambda_i * (-beta_i * log(1 - s_ij)),   s_ij <= 1 - eps,

then the usual cross-entropy over the anchor's candidates (self excluded, positive is the target).
``lambda_i`` in [0, 1] and ``beta_i`` > 0 come from the current batch under no gradient:

* cap proximity rho_i = 1 - max_j s_ij over negatives; rho_0 = ``quantile`` of rho over the
  (global) batch, smoothed by an EMA across steps; lambda_rho = sigmoid(kappa_rho (log rho_0 - log rho_i));
* tail shape on the anchor's top-m negative shortfalls delta_(1) <= ... <= delta_(m) with empirical
  CDF F_k = k / (m + 1): least squares of log F on log delta (Weibull / power law, slope beta) and
  of log F on delta (Gumbel / exponential tail); dAIC = AIC_gumbel - AIC_weibull
  = n log(SSE_gumbel / SSE_weibull) (both fits have two parameters);
  lambda_aic = sigmoid(kappa_aic (dAIC - margin));
* lambda = lambda_rho * lambda_aic; beta = ``beta`` (1.0 as in the released blend) or, with
  ``beta="auto"``, the anchor's Weibull slope shrunk toward a batch EMA:
  beta_i = w_i beta_hat_i + (1 - w_i) beta_ema, w_i = n R2_i / (n R2_i + shrink_c).

This follows the definition in papers.md; the reference code (hsme98/weince) fits its Gumbel proxy
as log(-log F) on log delta instead, and uses a per-batch quantile without EMA.
No trainable parameters; ``lambda = 0`` is exactly InfoNCE.

Distributed training: the batch statistics (rho_0 quantile, beta EMA) must be identical on every
rank, so they are computed on per-anchor values passed through the ``gather`` hook of
``loss_from_similarities`` (training/losses.py contract); everything else is per anchor.
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from training.losses import ContrastiveLoss, Gather, LossOutput, identity_gather, register_loss

logger = logging.getLogger(__name__)

class TailFit(NamedTuple):
    """Per-row least-squares tail fits (all shaped like the leading dims of the input)."""

    beta: torch.Tensor          # slope of log F on log delta (Weibull / power-law exponent)
    daic: torch.Tensor          # AIC_gumbel - AIC_weibull; > 0 favours the finite-endpoint Weibull tail
    r2: torch.Tensor            # R^2 of the Weibull fit
    gumbel_rate: torch.Tensor   # slope of log F on delta (1 / scale of the exponential tail)
    n: int                      # points used per row


def tail_fit(shortfalls: torch.Tensor, burn: int = 0, eps: float = 1e-6, presorted: bool = False) -> TailFit:
    """Fit Weibull and Gumbel tails to each row of ``shortfalls`` (..., m), vectorised.

    Rows are sorted ascending; the k-th smallest gets F = k / (m + 1) (the normalisation only
    shifts intercepts, so the top-m of K negatives give the same slopes). The ``burn`` smallest
    points, the noisiest ranks, are dropped.
    """
    if shortfalls.dim() < 1 or shortfalls.shape[-1] - burn < 3:
        raise ValueError(f"need at least 3 shortfalls per row after burn={burn}, got shape {tuple(shortfalls.shape)}")
    work = shortfalls.detach()
    if work.dtype not in (torch.float32, torch.float64):
        work = work.float()
    d = work if presorted else work.sort(dim=-1).values  # (..., m) ascending
    m = d.shape[-1]
    k = torch.arange(1, m + 1, device=d.device, dtype=d.dtype)
    y = torch.log(k / (m + 1))[burn:]  # (n,) log empirical CDF
    d = d[..., burn:].clamp_min(eps)  # (..., n)
    n = m - burn
    yc = y - y.mean()
    syy = (yc * yc).sum()

    def ols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # y ~ a + b x: b = Sxy / Sxx, SSE = Syy - b Sxy
        xc = x - x.mean(dim=-1, keepdim=True)
        sxx = (xc * xc).sum(dim=-1)
        sxy = (xc * yc).sum(dim=-1)
        b = torch.where(sxx > 0, sxy / sxx.clamp_min(1e-30), torch.zeros_like(sxy))
        sse = (syy - b * sxy).clamp_min(1e-12 * float(syy) + 1e-30)
        return b, sse

    beta, sse_w = ols(torch.log(d))
    rate, sse_g = ols(d)
    # Gaussian-residual AIC = n log(SSE/n) + 2p with p equal for both models.
    daic = n * (torch.log(sse_g) - torch.log(sse_w))
    r2 = (1.0 - sse_w / syy.clamp_min(1e-30)).clamp(0.0, 1.0)
    return TailFit(beta=beta, daic=daic, r2=r2, gumbel_rate=rate, n=n)


def fit_tail(shortfalls: torch.Tensor, burn: int = 0, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, dAIC) per row of ``shortfalls`` (..., m); see ``tail_fit``."""
    fit = tail_fit(shortfalls, burn=burn, eps=eps)
    return fit.beta, fit.daic


def weince_logits(sim: torch.Tensor, lam: torch.Tensor, beta: torch.Tensor, temperature,
                  eps: float = 1e-6) -> torch.Tensor:
    """l_ij = (1 - lam_i) s_ij / tau + lam_i beta_i (-log(1 - min(s_ij, 1 - eps))); sim (A, C), lam/beta (A,)."""
    weibit = torch.log1p(-sim.clamp(max=1.0 - eps))  # (A, C) log delta (the Weibull coordinate, negated)
    # two fused passes over (A, C): sim * ((1 - lam)/tau) - (lam beta) * log delta
    return torch.addcmul(sim * ((1.0 - lam) / temperature)[:, None], weibit, -(lam * beta)[:, None])


@register_loss("weince")
class WEINCELoss(ContrastiveLoss):
    """InfoNCE whose logits blend in the Weibull shortfall coordinate per anchor (see module doc).

    Options (reference-grid defaults): ``margin`` in {0, 2, 6} (2), ``kappa_rho`` in {5, 10, 20} (10),
    ``kappa_aic`` in {0.5, 1, 2} (1), ``quantile`` of rho for rho_0 (0.2), tail size
    ``m`` = max(m, tail_frac * negatives) capped at the negatives (32, 0.1), ``burn_frac`` of the
    smallest shortfalls dropped from the fits (0.05, at least 1), ``eps`` (1e-6), ``beta`` (1.0 or
    "auto"), ``beta_min``/``beta_max`` (0.5, 16), ``shrink_c`` (100), ``ema`` momentum for rho_0 and
    the batch beta (0.9; 0 = this batch only), ``fixed_lambda`` (None; a number in [0, 1] forces
    lambda for ablations: 0 is InfoNCE).
    """

    def __init__(self, margin: float = 2.0, kappa_rho: float = 10.0, kappa_aic: float = 1.0,
                 quantile: float = 0.2, m: int = 32, tail_frac: float = 0.1, burn_frac: float = 0.05,
                 eps: float = 1e-6, beta: float | str = 1.0, beta_min: float = 0.5, beta_max: float = 16.0,
                 shrink_c: float = 100.0, ema: float = 0.9, fixed_lambda: float | None = None) -> None:
        super().__init__()
        for name, value in (("kappa_rho", kappa_rho), ("kappa_aic", kappa_aic), ("eps", eps),
                            ("beta_min", beta_min), ("beta_max", beta_max), ("shrink_c", shrink_c)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(margin, (int, float)) or math.isnan(margin):
            raise ValueError(f"margin must be a number, got {margin!r}")
        for name, value in (("quantile", quantile), ("tail_frac", tail_frac), ("ema", ema)):
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if not isinstance(burn_frac, (int, float)) or not 0.0 <= burn_frac < 0.5:
            raise ValueError(f"burn_frac must be in [0, 0.5), got {burn_frac!r}")
        if int(m) != m or m < 4:
            raise ValueError(f"m (tail size) must be an integer >= 4, got {m!r}")
        if eps >= 0.5:
            raise ValueError(f"eps must be < 0.5, got {eps!r}")
        if isinstance(beta, str):
            if beta != "auto":
                raise ValueError(f"beta must be a positive number or 'auto', got {beta!r}")
        elif not isinstance(beta, (int, float)) or not beta > 0:
            raise ValueError(f"beta must be a positive number or 'auto', got {beta!r}")
        if beta_max < beta_min:
            raise ValueError(f"beta_max ({beta_max}) must be >= beta_min ({beta_min})")
        if fixed_lambda is not None and (not isinstance(fixed_lambda, (int, float)) or not 0 <= fixed_lambda <= 1):
            raise ValueError(f"fixed_lambda must be None or in [0, 1], got {fixed_lambda!r}")
        self.margin, self.kappa_rho, self.kappa_aic = float(margin), float(kappa_rho), float(kappa_aic)
        self.quantile, self.m, self.tail_frac, self.burn_frac = float(quantile), int(m), float(tail_frac), float(burn_frac)
        self.eps, self.beta = float(eps), beta if isinstance(beta, str) else float(beta)
        self.beta_min, self.beta_max, self.shrink_c = float(beta_min), float(beta_max), float(shrink_c)
        self.ema = float(ema)
        self.fixed_lambda = None if fixed_lambda is None else float(fixed_lambda)
        # Running batch statistics (NaN until the first training step); saved in state_dict.
        self.register_buffer("rho0_ema", torch.tensor(float("nan"), dtype=torch.float64))
        self.register_buffer("beta_ema", torch.tensor(float("nan"), dtype=torch.float64))

    def options(self) -> dict:
        """JSON-able constructor options for lineage."""
        return {"margin": self.margin, "kappa_rho": self.kappa_rho, "kappa_aic": self.kappa_aic,
                "quantile": self.quantile, "m": self.m, "tail_frac": self.tail_frac,
                "burn_frac": self.burn_frac, "eps": self.eps, "beta": self.beta, "beta_min": self.beta_min,
                "beta_max": self.beta_max, "shrink_c": self.shrink_c, "ema": self.ema,
                "fixed_lambda": self.fixed_lambda}

    def tail_size(self, negatives: int) -> tuple[int, int]:
        """(m, burn) for an anchor with ``negatives`` candidates."""
        m = min(negatives, max(self.m, int(round(self.tail_frac * negatives))))
        burn = max(1, int(self.burn_frac * m)) if m - 1 >= 3 else 0
        return m, burn

    def _update_ema(self, buf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        value = value.to(buf.dtype)
        if not self.training:
            return value if torch.isnan(buf) else buf.clone()
        new = value if torch.isnan(buf) else self.ema * buf + (1.0 - self.ema) * value
        buf.copy_(new)
        return new

    @torch.no_grad()
    def gates(self, sim: torch.Tensor, pos_index: torch.Tensor, self_index: torch.Tensor | None,
              gather: Gather = identity_gather) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-anchor (lambda, beta) from the batch, no gradient; sim (A, C), indices (A,).

        Batch statistics use ``gather`` (cross-rank concatenation) so every rank agrees.
        """
        A, C = sim.shape
        s = sim.detach()
        if s.dtype not in (torch.float32, torch.float64):
            s = s.float()
        rows = torch.arange(A, device=s.device)
        neg = s.clone()  # (A, C) negatives only
        neg[rows, pos_index] = float("-inf")
        if self_index is not None:
            neg[rows, self_index] = float("-inf")
        negatives = C - 1 - (self_index is not None)
        if negatives < 4:
            raise ValueError(f"WEINCE needs at least 4 negatives per anchor, got {negatives}")
        m, burn = self.tail_size(negatives)
        top = neg.topk(m, dim=1).values  # (A, m) hardest negatives, descending s
        delta = 1.0 - top  # (A, m) ascending shortfalls
        rho = delta[:, 0].clamp_min(self.eps)  # (A,) cap proximity
        fit = tail_fit(delta, burn=burn, eps=self.eps, presorted=True)
        rho0 = self._update_ema(self.rho0_ema, torch.quantile(gather(rho).double(), self.quantile))
        log_rho0 = torch.log(rho0.clamp_min(self.eps)).to(s.dtype)
        lam_rho = torch.sigmoid(self.kappa_rho * (log_rho0 - torch.log(rho)))  # (A,)
        lam_aic = torch.sigmoid(self.kappa_aic * (fit.daic - self.margin))
        lam = lam_rho * lam_aic  # (A,)
        if self.fixed_lambda is not None:
            lam = torch.full_like(lam, self.fixed_lambda)
        beta_hat = fit.beta.clamp(self.beta_min, self.beta_max)
        if self.beta == "auto":
            beta_batch = self._update_ema(self.beta_ema, gather(beta_hat).double().mean())
            nr2 = fit.n * fit.r2
            w = nr2 / (nr2 + self.shrink_c)  # (A,) trust in the anchor's own slope
            beta = (w * beta_hat + (1.0 - w) * beta_batch.to(s.dtype)).clamp(self.beta_min, self.beta_max)
        else:
            beta = torch.full_like(lam, self.beta)
        # Per-anchor diagnostics, averaged over the global batch: (A, 7) gathered in one call.
        diag = torch.stack([lam, (lam > 0.5).to(lam.dtype), lam_rho, lam_aic, beta, fit.beta, fit.daic], dim=1)
        means = gather(diag.to(s.dtype)).mean(dim=0).tolist()
        stats = dict(zip(["weince_lambda_mean", "weince_lambda_frac_gt_half", "weince_lambda_rho_mean",
                          "weince_lambda_aic_mean", "weince_beta_mean", "weince_beta_hat_mean",
                          "weince_daic_mean"], means))
        stats["weince_rho0"] = float(rho0)
        return lam.to(sim.dtype), beta.to(sim.dtype), stats

    def loss_from_similarities(self, sim, pos_index, self_index, temperature,
                               gather: Gather = identity_gather) -> LossOutput:
        """WEINCE cross-entropy averaged over the local anchors; sim (A, C) cosine, pos/self (A,)."""
        lam, beta, stats = self.gates(sim, pos_index, self_index, gather)
        logits = weince_logits(sim, lam, beta, temperature, self.eps)  # (A, C)
        if self_index is not None:  # in place: addcmul's backward does not need its output
            logits[torch.arange(logits.shape[0], device=logits.device), self_index] = float("-inf")
        loss = F.cross_entropy(logits, pos_index)  # mean over local anchors, as InfoNCELoss
        with torch.no_grad():
            rows = torch.arange(sim.shape[0], device=sim.device)
            hit = (logits.argmax(dim=1) == pos_index).float()  # (A,) positive ranked first
            stats["pos_sim_mean"] = float(gather(sim[rows, pos_index].detach()).mean())
            stats["top1_accuracy"] = float(gather(hit).mean())
        return LossOutput(loss=loss, stats=stats)
