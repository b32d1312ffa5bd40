"""Langevin noise for training: turns an optimizer step into an SGLD step (docs/theory.md §3).

Discrete Langevin (SGLD):  theta <- theta - eta * grad L + sqrt(2 * eta * T_t) * xi,  xi ~ N(0, I).
The optimizer has already done the gradient part when ``LangevinNoise.apply`` runs, so this module
adds only the noise term. ``T_t`` is a noise temperature in units of the loss (energy), read from a
``training.schedules`` schedule (``log`` is the convergent one: 1/T_t = log(t + t_0)/c).

Parameters constrained to the unit sphere (rows of a free embedding table, unit vectors) get
Riemannian Langevin noise: the Gaussian step is projected onto the tangent space at x and the
point is retracted to the sphere,

    x <- normalize(x + P_x(sqrt(2 eta T) xi)),   P_x = I - x x^T   (row-wise, last dimension).

With an adaptive optimizer (Adam) the result is a preconditioned-free noise on top of an adaptive
drift, which is a heuristic rather than exact SGLD; with plain SGD it is exact SGLD.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch

from training.schedules import TemperatureSchedule

logger = logging.getLogger(__name__)


def tangent_project(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P_x v = v - (v . x) x row-wise over the last dimension; x has unit rows."""
    return v - (v * x).sum(dim=-1, keepdim=True) * x  # (..., D)


def sphere_retract(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """normalize(x + step) row-wise: the projection retraction onto the unit sphere."""
    y = x + step  # (..., D)
    return y / y.norm(dim=-1, keepdim=True).clamp_min(1e-12)


class LangevinNoise:
    """Adds sqrt(2 lr T_t) Gaussian noise after each optimizer step (SGLD).

    ``noise_schedule``: a ``TemperatureSchedule`` (its ``temperature(step)`` is T_t), a constant
    float T, or None for no noise. ``riemannian_params``: parameters whose rows (last dimension)
    are kept on the unit sphere; they get tangent-space noise and are renormalised.
    ``generator``: optional ``torch.Generator`` for reproducible noise (CPU tensors).
    """

    def __init__(
        self,
        noise_schedule: TemperatureSchedule | float | None,
        riemannian_params: Iterable[torch.Tensor] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        if noise_schedule is not None and not isinstance(noise_schedule, TemperatureSchedule):
            try:
                value = float(noise_schedule)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"noise_schedule must be a TemperatureSchedule, a number or None, got {noise_schedule!r}"
                ) from exc
            if math.isnan(value) or value < 0:
                raise ValueError(f"constant noise temperature must be >= 0, got {value!r}")
            noise_schedule = value
        self.noise_schedule = noise_schedule
        self._riemannian = {id(p) for p in riemannian_params}
        self.generator = generator

    def temperature(self, step: int) -> float:
        """T_t at ``step`` as a float (0 when there is no noise)."""
        if self.noise_schedule is None:
            return 0.0
        if isinstance(self.noise_schedule, float):
            return self.noise_schedule
        return float(torch.as_tensor(self.noise_schedule.temperature(step)).detach())

    def _randn(self, p: torch.Tensor) -> torch.Tensor:
        if self.generator is not None and p.device.type == self.generator.device.type:
            return torch.randn(p.shape, generator=self.generator, device=p.device, dtype=p.dtype)
        return torch.randn_like(p)

    @torch.no_grad()
    def apply(self, params: Iterable[torch.Tensor], lr: float, step: int) -> float:
        """Add the SGLD noise to ``params`` in place; returns the temperature T_t used.

        T_t = 0 (or no schedule) leaves the parameters exactly as the optimizer left them.
        """
        lr = float(lr)
        if math.isnan(lr) or lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        temp = self.temperature(step)
        if temp < 0 or math.isnan(temp):
            raise ValueError(f"noise temperature must be >= 0, got {temp!r} at step {step}")
        if temp == 0.0 or lr == 0.0:
            return temp
        std = math.sqrt(2.0 * lr * temp)  # sqrt(2 eta T)
        for p in params:
            if isinstance(p, dict):  # an optimizer param group
                raise ValueError("pass tensors to apply(); use apply_to_optimizer for param groups")
            if not p.is_floating_point():
                continue
            xi = self._randn(p) * std
            if id(p) in self._riemannian:
                p.copy_(sphere_retract(p, tangent_project(p, xi)))
            else:
                p.add_(xi)
        return temp

    def apply_to_optimizer(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """``apply`` to every param group with that group's current learning rate."""
        temp = 0.0
        for group in optimizer.param_groups:
            temp = self.apply(group["params"], group["lr"], step)
        return temp
