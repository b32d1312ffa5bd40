"""WEINCE: InfoNCE with an anchor-adaptive Weibull-shortfall logit blend (docs/theory.md §2).

Cosine similarity is capped at 1, so the hard-negative tail has a finite endpoint (the Weibull
domain of extreme-value theory) and its natural coordinate is the shortfall delta = 1 - s.
For anchor i and candidate j WEINCE uses the logit

    l_ij = (1 - lambda_i) * s_ij / tau + lambda_i * (-beta_i * log(1 - s_ij)),   s_ij <= 1 - eps,

then the usual cross-entropy over the anchor's candidates (self excluded, positive is the target).
``lambda_i`` in [0, 1] and ``beta_i`` > 0 come from the current batch under no gradient:

* cap proximity rho_i = 1 - max_j s_ij over negatives; rho_0 = ``quantile`` of rho over the
  (global) batch (optionally smoothed by an EMA across steps);
  lambda_rho = sigmoid(kappa_rho (log rho_0 - log rho_i));
* tail shape on the anchor's top-m negative shortfalls delta_(1) <= ... <= delta_(m) with empirical
  CDF F_k = k / (m + 1): least squares of log F on log delta (Weibull / power law, slope beta)
  against a Gumbel proxy, either log F on delta (exponential tail, docs/theory.md §2) or, as the
  reference code, log(-log F) on log delta; dAIC = AIC_gumbel - AIC_weibull
  = n log(SSE_gumbel / SSE_weibull) (both fits have two parameters);
  lambda_aic = sigmoid(kappa_aic (dAIC - margin));
* lambda = lambda_rho * lambda_aic; beta = ``beta`` (1.0 as in the released blend) or, with
  ``beta="auto"``, the anchor's Weibull slope shrunk toward a batch EMA:
  beta_i = w_i beta_hat_i + (1 - w_i) beta_ema, w_i = n R2_i / (n R2_i + shrink_c).

``variant="paper"`` (the default) is the objective the paper ran (hsme98/weince,
``policy=tlambda_select`` with ``auto_weib_beta``, ``use_weib_topm``, ``use_pl_topm``): the blend
above, with the reference's gate rules, plus two terms over {positive + top-M hardest negatives}:

    L = L_blend + weib_lambda * CE_topM(-beta_t log(1 - s)) + pl_lambda * CE_topM(s / tau),

where beta_t is an EMA (momentum 0.9, start 4) of the power-law slope fitted to the smallest 5 %
(at least 1024) of all negative shortfalls in the batch, the fit clamped to [beta_min, beta_max]
and used only when its R^2 >= 0.85. ``variant="blend"`` is the blend alone with the project's
gate rules (docs/theory.md §2). docs/weince.md tabulates what still differs from the reference.
No trainable parameters; ``lambda = 0`` without top-M terms is exactly InfoNCE.

Distributed training: the batch statistics (rho_0 quantile, EMAs, the beta_t tail) must be
identical on every rank, so they are computed on values passed through the ``gather`` hook of
``loss_from_similarities`` (training/losses.py contract); everything else is per anchor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F

from training.losses import ContrastiveLoss, Gather, LossOutput, identity_gather, register_loss

logger = logging.getLogger(__name__)

GUMBEL_PROXIES = ("exponential", "loglog")
# The reference adds this to a fit's SSE when its slope has the wrong sign (Weibull beta <= 0;
# Gumbel proxy slope of the wrong sign), so a nonsensical fit cannot win the AIC comparison.
SLOPE_PENALTY = 1e6


class TailFit(NamedTuple):
    """Per-row least-squares tail fits (all shaped like the leading dims of the input)."""

    beta: torch.Tensor  # slope of log F on log delta (Weibull / power-law exponent)
    daic: torch.Tensor  # AIC_gumbel - AIC_weibull; > 0 favours the finite-endpoint Weibull tail
    r2: torch.Tensor  # R^2 of the Weibull fit
    gumbel_rate: torch.Tensor  # slope of the Gumbel proxy (log F on delta, or log(-log F) on log delta)
    n: int  # points used per row


def tail_fit(
    shortfalls: torch.Tensor,
    burn: int = 0,
    eps: float = 1e-6,
    presorted: bool = False,
    gumbel: str = "exponential",
    slope_penalty: bool = False,
) -> TailFit:
    """Fit Weibull and Gumbel tails to each row of ``shortfalls`` (..., m), vectorised.

    Rows are sorted ascending; the k-th smallest gets F = k / (m + 1) (the normalisation only
    shifts intercepts, so the top-m of K negatives give the same slopes). The ``burn`` smallest
    points, the noisiest ranks, are dropped. ``gumbel``: "exponential" regresses log F on delta
    (docs/theory.md), "loglog" regresses log(-log F) on log delta (the reference code).
    ``slope_penalty`` adds SLOPE_PENALTY to the SSE of a fit whose slope has the wrong sign.
    """
    if shortfalls.dim() < 1 or shortfalls.shape[-1] - burn < 3:
        raise ValueError(
            f"need at least 3 shortfalls per row after burn={burn}, got shape {tuple(shortfalls.shape)}"
        )
    if gumbel not in GUMBEL_PROXIES:
        raise ValueError(f"gumbel must be one of {GUMBEL_PROXIES}, got {gumbel!r}")
    work = shortfalls.detach()
    if work.dtype not in (torch.float32, torch.float64):
        work = work.float()
    d = work if presorted else work.sort(dim=-1).values  # (..., m) ascending
    m = d.shape[-1]
    k = torch.arange(1, m + 1, device=d.device, dtype=d.dtype)
    log_f = torch.log(k / (m + 1))  # (m,) log empirical CDF
    y = log_f[burn:]  # (n,)
    d = d[..., burn:].clamp_min(eps)  # (..., n)
    n = m - burn

    def ols(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # y ~ a + b x: b = Sxy / Sxx; returns (b, SSE, Syy). SSE is the sum of squared residuals
        # sum_i (yc_i - b xc_i)^2 computed directly: the shortcut Syy - b Sxy cancels in float32 when the
        # fit is good (relative error ~ eps * Syy / SSE), which biased dAIC by ~1e-3.
        yc = y - y.mean()
        syy = (yc * yc).sum()
        xc = x - x.mean(dim=-1, keepdim=True)
        sxx = (xc * xc).sum(dim=-1)
        sxy = (xc * yc).sum(dim=-1)
        b = torch.where(sxx > 0, sxy / sxx.clamp_min(1e-30), torch.zeros_like(sxy))
        resid = yc - b.unsqueeze(-1) * xc
        sse = (resid * resid).sum(dim=-1).clamp_min(1e-12 * float(syy) + 1e-30)
        return b, sse, syy

    log_d = torch.log(d)
    beta, sse_w, syy = ols(log_d, y)
    if gumbel == "exponential":  # log F = a + rate * delta: rate > 0
        rate, sse_g, _ = ols(d, y)
        bad_gumbel = rate <= 0
    else:  # log(-log F) = a - kappa log delta: slope < 0
        rate, sse_g, _ = ols(log_d, torch.log(-log_f)[burn:])
        bad_gumbel = rate >= 0
    r2 = (1.0 - sse_w / syy.clamp_min(1e-30)).clamp(0.0, 1.0)
    if slope_penalty:
        sse_w = torch.where(beta <= 0, sse_w + SLOPE_PENALTY, sse_w)
        sse_g = torch.where(bad_gumbel, sse_g + SLOPE_PENALTY, sse_g)
    # Gaussian-residual AIC = n log(SSE/n) + 2p with p equal for both models.
    daic = n * (torch.log(sse_g) - torch.log(sse_w))
    return TailFit(beta=beta, daic=daic, r2=r2, gumbel_rate=rate, n=n)


def fit_tail(shortfalls: torch.Tensor, burn: int = 0, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta, dAIC) per row of ``shortfalls`` (..., m); see ``tail_fit``."""
    fit = tail_fit(shortfalls, burn=burn, eps=eps)
    return fit.beta, fit.daic


def power_law_slope(sorted_shortfalls: torch.Tensor, eps: float = 1e-6) -> tuple[float, float]:
    """(slope, R^2) of log F on log delta over one ascending tail (k,), F = i / (k + 1).

    The reference's global beta_t fit: the ``max(1, k // 20)`` smallest points are burned and a
    negative slope is reported as 0 (no update); fewer than 10 points give (nan, 0).
    """
    d = sorted_shortfalls.detach().double()
    k = d.numel()
    burn = max(1, k // 20)
    if k < 10 or k - burn < 2:
        return float("nan"), 0.0
    f = torch.arange(1, k + 1, device=d.device, dtype=d.dtype) / (k + 1.0)
    x, y = torch.log(d.clamp_min(eps))[burn:], torch.log(f)[burn:]
    xc, yc = x - x.mean(), y - y.mean()
    slope = (xc * yc).sum() / (xc * xc).sum().clamp_min(1e-12)
    resid = yc - slope * xc
    r2 = (1.0 - (resid * resid).sum() / (yc * yc).sum().clamp_min(1e-12)).clamp(0.0, 1.0)
    return max(float(slope), 0.0), float(r2)


def weince_logits(
    sim: torch.Tensor, lam: torch.Tensor, beta: torch.Tensor, temperature, eps: float = 1e-6
) -> torch.Tensor:
    """l_ij = (1 - lam_i) s_ij / tau + lam_i beta_i (-log(1 - min(s_ij, 1 - eps))); sim (A, C), lam/beta
    (A,)."""
    weibit = torch.log1p(-sim.clamp(max=1.0 - eps))  # (A, C) log delta (the Weibull coordinate, negated)
    # two fused passes over (A, C): sim * ((1 - lam)/tau) - (lam beta) * log delta
    return torch.addcmul(sim * ((1.0 - lam) / temperature)[:, None], weibit, -(lam * beta)[:, None])


# Options whose default depends on ``variant``: the paper's as-run rules vs the project's blend.
VARIANTS: dict[str, dict] = {
    "paper": {
        "ema": 0.0,
        "gumbel_proxy": "loglog",
        "slope_penalty": True,
        "rho0_rule": "nearest",
        "weib_lambda": 0.5,
        "pl_lambda": 0.5,
    },
    "blend": {
        "ema": 0.9,
        "gumbel_proxy": "exponential",
        "slope_penalty": False,
        "rho0_rule": "linear",
        "weib_lambda": 0.0,
        "pl_lambda": 0.0,
    },
}
RHO0_RULES = ("linear", "nearest")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


_INT_OPTIONS = ("m", "weib_top_m", "pl_top_m", "weib_min_tail_points")
_FLOAT_OPTIONS = (
    "margin",
    "kappa_rho",
    "kappa_aic",
    "quantile",
    "tail_frac",
    "burn_frac",
    "eps",
    "beta",
    "beta_min",
    "beta_max",
    "shrink_c",
    "ema",
    "fixed_lambda",
    "weib_lambda",
    "pl_lambda",
    "weib_beta",
    "weib_beta_init",
    "weib_beta_momentum",
    "weib_r2_min",
    "weib_tail_frac",
)


@dataclass(frozen=True)
class WEINCEConfig:
    """Every WEINCE option, validated once (see WEINCELoss for what each means). The six options whose
    default depends on ``variant`` (VARIANTS) are None until resolved in ``__post_init__``."""

    variant: str = "paper"
    margin: float = 2.0
    kappa_rho: float = 10.0
    kappa_aic: float = 1.0
    quantile: float = 0.2
    m: int = 32
    tail_frac: float = 0.1
    burn_frac: float = 0.05
    eps: float = 1e-6
    beta: float | str = 1.0
    beta_min: float = 0.5
    beta_max: float = 16.0
    shrink_c: float = 100.0
    ema: float | None = None
    fixed_lambda: float | None = None
    gumbel_proxy: str | None = None
    slope_penalty: bool | None = None
    rho0_rule: str | None = None
    weib_lambda: float | None = None
    weib_top_m: int = 50
    pl_lambda: float | None = None
    pl_top_m: int = 50
    weib_beta: float | str = "auto"
    weib_beta_init: float = 4.0
    weib_beta_momentum: float = 0.9
    weib_r2_min: float = 0.85
    weib_tail_frac: float = 0.05
    weib_min_tail_points: int = 1024

    def __post_init__(self) -> None:
        variant = self.variant
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
        for key in ("ema", "gumbel_proxy", "slope_penalty", "rho0_rule", "weib_lambda", "pl_lambda"):
            if getattr(self, key) is None:
                object.__setattr__(self, key, VARIANTS[variant][key])
        _validate(**{f.name: getattr(self, f.name) for f in fields(self)})
        for name in _INT_OPTIONS:
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in _FLOAT_OPTIONS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, float(value))

    def options(self) -> dict:
        """JSON-able options for lineage (variant-dependent ones resolved)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _validate(
    *,
    variant,
    margin,
    kappa_rho,
    kappa_aic,
    quantile,
    m,
    tail_frac,
    burn_frac,
    eps,
    beta,
    beta_min,
    beta_max,
    shrink_c,
    ema,
    fixed_lambda,
    gumbel_proxy,
    slope_penalty,
    rho0_rule,
    weib_lambda,
    weib_top_m,
    pl_lambda,
    pl_top_m,
    weib_beta,
    weib_beta_init,
    weib_beta_momentum,
    weib_r2_min,
    weib_tail_frac,
    weib_min_tail_points,
) -> None:
    """ValueError naming the first option out of its range."""
    for name, value in (
        ("kappa_rho", kappa_rho),
        ("kappa_aic", kappa_aic),
        ("eps", eps),
        ("beta_min", beta_min),
        ("beta_max", beta_max),
        ("shrink_c", shrink_c),
        ("weib_beta_init", weib_beta_init),
        ("weib_tail_frac", weib_tail_frac),
    ):
        if not _is_number(value) or not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not _is_number(margin):
        raise ValueError(f"margin must be a number, got {margin!r}")
    for name, value in (
        ("quantile", quantile),
        ("tail_frac", tail_frac),
        ("ema", ema),
        ("weib_beta_momentum", weib_beta_momentum),
        ("weib_r2_min", weib_r2_min),
        ("weib_tail_frac", weib_tail_frac),
    ):
        if not _is_number(value) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    for name, value in (("weib_lambda", weib_lambda), ("pl_lambda", pl_lambda)):
        if not _is_number(value) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if not _is_number(burn_frac) or not 0.0 <= burn_frac < 0.5:
        raise ValueError(f"burn_frac must be in [0, 0.5), got {burn_frac!r}")
    for name, value, low in (
        ("m", m, 4),
        ("weib_top_m", weib_top_m, 1),
        ("pl_top_m", pl_top_m, 1),
        ("weib_min_tail_points", weib_min_tail_points, 10),
    ):
        if not _is_number(value) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if eps >= 0.5:
        raise ValueError(f"eps must be < 0.5, got {eps!r}")
    for name, value in (("beta", beta), ("weib_beta", weib_beta)):
        if isinstance(value, str):
            if value != "auto":
                raise ValueError(f"{name} must be a positive number or 'auto', got {value!r}")
        elif not _is_number(value) or not value > 0:
            raise ValueError(f"{name} must be a positive number or 'auto', got {value!r}")
    if beta_max < beta_min:
        raise ValueError(f"beta_max ({beta_max}) must be >= beta_min ({beta_min})")
    if fixed_lambda is not None and (not _is_number(fixed_lambda) or not 0 <= fixed_lambda <= 1):
        raise ValueError(f"fixed_lambda must be None or in [0, 1], got {fixed_lambda!r}")
    if gumbel_proxy not in GUMBEL_PROXIES:
        raise ValueError(f"gumbel_proxy must be one of {GUMBEL_PROXIES}, got {gumbel_proxy!r}")
    if rho0_rule not in RHO0_RULES:
        raise ValueError(f"rho0_rule must be one of {RHO0_RULES}, got {rho0_rule!r}")
    if not isinstance(slope_penalty, bool):
        raise ValueError(f"slope_penalty must be true or false, got {slope_penalty!r}")


@register_loss("weince")
class WEINCELoss(ContrastiveLoss):
    """InfoNCE whose logits blend in the Weibull shortfall coordinate per anchor (see module doc).

    ``variant``: "paper" (default; the reference's as-run objective) or "blend" (the blend alone);
    it sets the defaults of ``ema``, ``gumbel_proxy``, ``slope_penalty``, ``rho0_rule``,
    ``weib_lambda`` and ``pl_lambda`` (VARIANTS), each of which can still be given explicitly.

    Gate options (reference-grid defaults): ``margin`` in {0, 2, 6} (2), ``kappa_rho`` in
    {5, 10, 20} (10), ``kappa_aic`` in {0.5, 1, 2} (1), ``quantile`` of rho for rho_0 (0.2) taken
    by ``rho0_rule`` ("linear" interpolation or the "nearest" order statistic q (n - 1), as the
    reference), tail size ``m`` = max(m, tail_frac * negatives) capped at the negatives (32, 0.1),
    ``burn_frac`` of the smallest shortfalls dropped from the fits (0.05, at least 1), ``eps``
    (1e-6), ``gumbel_proxy`` ("exponential" | "loglog"), ``slope_penalty`` (bool), blend ``beta``
    (1.0 or "auto"), ``beta_min``/``beta_max`` (0.5, 16; also clamp beta_t), ``shrink_c`` (100),
    ``ema`` momentum for rho_0 and the batch beta (0 = this batch only), ``fixed_lambda`` (None; a
    number in [0, 1] forces lambda for ablations: 0 with no top-M terms is InfoNCE).

    Top-M terms: ``weib_lambda`` x CE over {positive + ``weib_top_m`` hardest negatives} of
    -beta_t log(1 - s), ``pl_lambda`` x CE over {positive + ``pl_top_m``} of s / tau (0 = off;
    top-M 50). beta_t: ``weib_beta`` ("auto" or a fixed number), EMA start ``weib_beta_init`` (4),
    ``weib_beta_momentum`` (0.9), update gate ``weib_r2_min`` (0.85), global tail
    max(``weib_min_tail_points``, ``weib_tail_frac`` x all negatives) (1024, 0.05).
    """

    def __init__(self, config: WEINCEConfig | None = None, **options) -> None:
        """`WEINCELoss(WEINCEConfig(...))`, or the options as keywords (what a TOML [loss_options] gives)."""
        super().__init__()
        if config is not None and options:
            raise ValueError("give a WEINCEConfig or keyword options, not both")
        self.config = config if config is not None else WEINCEConfig(**options)
        for f in fields(self.config):  # plain attributes: the hot path reads them every step
            setattr(self, f.name, getattr(self.config, f.name))
        # Running batch statistics (NaN until the first training step); saved in state_dict.
        self.register_buffer("rho0_ema", torch.tensor(float("nan"), dtype=torch.float64))
        self.register_buffer("beta_ema", torch.tensor(float("nan"), dtype=torch.float64))
        # beta_t of the top-M Weibull term: EMA started at weib_beta_init, as the reference.
        self.register_buffer("weib_beta_ema", torch.tensor(self.weib_beta_init, dtype=torch.float64))

    def options(self) -> dict:
        """JSON-able constructor options for lineage (variant-dependent ones resolved)."""
        return self.config.options()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before the top-M terms existed have no beta_t buffer: keep the start value.
        state_dict.setdefault(prefix + "weib_beta_ema", self.weib_beta_ema.detach().clone())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def tail_size(self, negatives: int) -> tuple[int, int]:
        """(m, burn) for an anchor with ``negatives`` candidates."""
        m = min(negatives, max(self.m, int(round(self.tail_frac * negatives))))
        burn = max(1, int(self.burn_frac * m)) if m - 1 >= 3 else 0
        return m, burn

    def _update_ema(self, buf: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        value = value.to(buf.dtype)
        if self.ema == 0.0:  # this batch only, in training and evaluation alike
            if self.training:
                buf.copy_(value)
            return value
        if not self.training:
            return value if torch.isnan(buf) else buf.clone()
        new = value if torch.isnan(buf) else self.ema * buf + (1.0 - self.ema) * value
        buf.copy_(new)
        return new

    def _quantile(self, values: torch.Tensor) -> torch.Tensor:
        if self.rho0_rule == "nearest":  # the reference: sorted[round(q (n - 1))]
            return values.sort().values[int(round(self.quantile * (values.numel() - 1)))]
        return torch.quantile(values, self.quantile)

    @staticmethod
    def _negatives(
        sim: torch.Tensor, pos_index: torch.Tensor, self_index: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        """(detached sim with -inf at the positive and self columns, negatives per anchor)."""
        s = sim.detach()
        if s.dtype not in (torch.float32, torch.float64):
            s = s.float()
        rows = torch.arange(s.shape[0], device=s.device)
        neg = s.clone()  # (A, C) negatives only
        neg[rows, pos_index] = float("-inf")
        if self_index is not None:
            neg[rows, self_index] = float("-inf")
        negatives = s.shape[1] - 1 - (self_index is not None)
        if negatives < 4:
            raise ValueError(f"WEINCE needs at least 4 negatives per anchor, got {negatives}")
        return neg, negatives

    @torch.no_grad()
    def gates(
        self,
        sim: torch.Tensor,
        pos_index: torch.Tensor,
        self_index: torch.Tensor | None,
        gather: Gather = identity_gather,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-anchor (lambda, beta) from the batch, no gradient; sim (A, C), indices (A,).

        Batch statistics use ``gather`` (cross-rank concatenation) so every rank agrees.
        """
        neg, negatives = self._negatives(sim, pos_index, self_index)
        m, _ = self.tail_size(negatives)
        return self._gates(neg.topk(m, dim=1).values, negatives, sim.dtype, gather)

    def _gates(
        self, top: torch.Tensor, negatives: int, out_dtype: torch.dtype, gather: Gather
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        # top: (A, >= m) hardest negatives' similarities, descending
        m, burn = self.tail_size(negatives)
        delta = 1.0 - top[:, :m]  # (A, m) ascending shortfalls
        rho = delta[:, 0].clamp_min(self.eps)  # (A,) cap proximity
        fit = tail_fit(
            delta,
            burn=burn,
            eps=self.eps,
            presorted=True,
            gumbel=self.gumbel_proxy,
            slope_penalty=self.slope_penalty,
        )
        rho0 = self._update_ema(self.rho0_ema, self._quantile(gather(rho).double()))
        log_rho0 = torch.log(rho0.clamp_min(self.eps)).to(top.dtype)
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
            beta = (w * beta_hat + (1.0 - w) * beta_batch.to(top.dtype)).clamp(self.beta_min, self.beta_max)
        else:
            beta = torch.full_like(lam, self.beta)
        # Per-anchor diagnostics, averaged over the global batch: (A, 7) gathered in one call.
        diag = torch.stack(
            [lam, (lam > 0.5).to(lam.dtype), lam_rho, lam_aic, beta, fit.beta, fit.daic], dim=1
        )
        means = gather(diag.to(top.dtype)).mean(dim=0).tolist()
        stats = dict(
            zip(
                [
                    "weince_lambda_mean",
                    "weince_lambda_frac_gt_half",
                    "weince_lambda_rho_mean",
                    "weince_lambda_aic_mean",
                    "weince_beta_mean",
                    "weince_beta_hat_mean",
                    "weince_daic_mean",
                ],
                means,
            )
        )
        stats["weince_rho0"] = float(rho0)
        return lam.to(out_dtype), beta.to(out_dtype), stats

    @torch.no_grad()
    def _beta_t(self, neg: torch.Tensor, negatives: int, gather: Gather) -> tuple[float, dict[str, float]]:
        """beta_t for the top-M Weibull term: fixed, or the reference's EMA of the global tail slope.

        The tail is the k smallest shortfalls among *all* negatives of the global batch (each
        anchor's row; the candidates are the global anchors, training/losses.py layout), with
        k = max(weib_min_tail_points, weib_tail_frac x count). Each rank keeps its own k smallest
        (exactly the ones that can be globally smallest); the gathered lists are merged and cut to k.
        """
        if self.weib_beta != "auto":
            return float(self.weib_beta), {"weince_beta_t": float(self.weib_beta)}
        total = neg.shape[1] * negatives
        k_tail = min(total, max(self.weib_min_tail_points, int(self.weib_tail_frac * total)))
        k_local = min(k_tail, neg.shape[0] * negatives)
        shortfall = (1.0 - neg).flatten()  # +inf at the positive / self columns, never among the smallest
        tail = gather(shortfall.topk(k_local, largest=False, sorted=True).values)
        if tail.numel() > k_local:  # several ranks' sorted lists: merge, keep the k smallest
            tail = tail.topk(k_tail, largest=False, sorted=True).values
        slope, r2 = power_law_slope(tail, self.eps)
        ema = self.weib_beta_ema
        updated = self.training and r2 >= self.weib_r2_min and slope > 0.0
        if updated:
            clamped = min(self.beta_max, max(self.beta_min, slope))
            ema.copy_(self.weib_beta_momentum * ema + (1.0 - self.weib_beta_momentum) * clamped)
        beta_t = float(ema)
        return beta_t, {
            "weince_beta_t": beta_t,
            "weince_beta_t_hat": slope,
            "weince_beta_t_r2": r2,
            "weince_beta_t_updated": float(updated),
        }

    def loss_from_similarities(
        self, sim, pos_index, self_index, temperature, gather: Gather = identity_gather
    ) -> LossOutput:
        """WEINCE cross-entropy (+ top-M terms) averaged over the local anchors; sim (A, C) cosine, pos/self
        (A,)."""
        neg, negatives = self._negatives(sim, pos_index, self_index)
        weib_m = min(self.weib_top_m, negatives) if self.weib_lambda > 0 else 0
        pl_m = min(self.pl_top_m, negatives) if self.pl_lambda > 0 else 0
        # one top-k serves the gates' tail (m) and the top-M terms: (A, K) descending s
        hardest = neg.topk(max(self.tail_size(negatives)[0], weib_m, pl_m), dim=1)
        with torch.no_grad():
            lam, beta, stats = self._gates(hardest.values, negatives, sim.dtype, gather)
        logits = weince_logits(sim, lam, beta, temperature, self.eps)  # (A, C)
        rows = torch.arange(sim.shape[0], device=sim.device)
        if self_index is not None:  # in place: addcmul's backward does not need its output
            logits[rows, self_index] = float("-inf")
        terms = {"blend": F.cross_entropy(logits, pos_index, reduction="none")}  # (A,) per anchor
        loss = terms["blend"].mean()  # mean over local anchors, as InfoNCELoss
        if weib_m or pl_m:
            # (A, 1 + M) with gradient: the positive in column 0 (the CE target), then the top-M
            top_idx = hardest.indices[:, : max(weib_m, pl_m)]
            cand = torch.cat([sim.gather(1, pos_index[:, None]), sim.gather(1, top_idx)], dim=1)
            target = torch.zeros_like(pos_index)
            if weib_m:
                beta_t, beta_stats = self._beta_t(neg, negatives, gather)
                stats.update(beta_stats)
                weib_logits = -beta_t * torch.log1p(-cand[:, : 1 + weib_m].clamp(max=1.0 - self.eps))
                terms["weib_topm"] = F.cross_entropy(weib_logits, target, reduction="none")
                loss = loss + self.weib_lambda * terms["weib_topm"].mean()
            if pl_m:
                terms["pl_topm"] = F.cross_entropy(
                    cand[:, : 1 + pl_m] / temperature, target, reduction="none"
                )
                loss = loss + self.pl_lambda * terms["pl_topm"].mean()
        with torch.no_grad():
            hit = (logits.argmax(dim=1) == pos_index).to(sim.dtype)  # (A,) positive ranked first
            per_anchor = torch.stack(
                [sim[rows, pos_index].detach(), hit, *(t.detach() for t in terms.values())], 1
            )
            means = gather(per_anchor).mean(dim=0).tolist()
            stats["pos_sim_mean"], stats["top1_accuracy"] = means[0], means[1]
            for name, value in zip(terms, means[2:]):
                stats[f"weince_loss_{name}"] = value
        return LossOutput(loss=loss, stats=stats)
