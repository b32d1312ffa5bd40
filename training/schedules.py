"""Temperature schedules: softmax temperature tau_t for the loss and noise temperature T_t for Langevin.

Every schedule maps a training step (or epoch, see ``steps_per_epoch``) to a temperature.
The same classes serve two roles (docs/theory.md §3):

* **softmax temperature** tau_t of InfoNCE / WEINCE: dimensionless, logits are ``s / tau``
  with cosine similarity ``s`` in [-1, 1]; sensible values are 0.01 .. 1.
* **noise temperature** T_t of Langevin dynamics (``training/langevin.py``): in units of the
  loss (energy), the SGLD update adds ``sqrt(2 * lr * T_t) * N(0, I)``. T_t = 0 means no noise.

Schedules are ``nn.Module`` s so a learnable temperature lives in ``state_dict`` and is found by
``module.parameters()``; the fixed schedules hold no parameters (their options are recorded in
``options`` for checkpoint lineage). ``temperature(step)`` returns a Python float, except for
``learnable`` which returns a 0-dim tensor carrying gradient.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
from torch import nn

from training._registry import create_registered, make_register

logger = logging.getLogger(__name__)

SCHEDULES: dict[str, type["TemperatureSchedule"]] = {}


# class decorator, e.g. @register_schedule("name") on a class
register_schedule = make_register(SCHEDULES, "schedule")


def schedule_options(name: str) -> dict:
    """The options schedule ``name`` takes, with their defaults (from its constructor)."""
    import inspect

    sig = inspect.signature(SCHEDULES[name].__init__)
    return {
        p.name: p.default
        for p in list(sig.parameters.values())[1:]
        if p.default is not inspect.Parameter.empty
    }


def _toml(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value) if not isinstance(value, bool) else str(value).lower()


def describe_schedules() -> str:
    """One line per registered schedule: its options with defaults (for --help)."""
    lines = []
    for name in sorted(SCHEDULES):
        opts = ", ".join(f"{k} = {_toml(v)}" for k, v in schedule_options(name).items())
        lines.append(f"  {name:<10} {opts}")
    return "\n".join(lines)


def create_schedule(name: str, **options) -> "TemperatureSchedule":
    """Build the schedule registered as ``name`` with keyword ``options``."""
    try:
        return create_registered(SCHEDULES, "temperature schedule", name, **options)
    except ValueError as exc:  # unknown / missing keyword -> the options it takes, and how to replace a table
        if not isinstance(exc.__cause__, TypeError):
            raise
        takes = schedule_options(name)
        inline = ", ".join(
            f"{k} = {_toml(v)}"
            for k, v in takes.items()
            if k != "steps_per_epoch" and v is not None and not (isinstance(v, float) and math.isinf(v))
        )
        raise ValueError(
            f"{exc}. {name!r} takes "
            f"{', '.join(takes)}; an options table inherited from a config file must be replaced "
            f"whole, e.g. --set 'schedule_options={{{inline}}}' (noise_options for a noise "
            f"schedule)"
        ) from exc


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    """Validate a numeric option, naming it in the error."""
    try:
        value = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a number, got {value!r}") from exc
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def _clip_range(tau_min: float, tau_max: float) -> tuple[float, float]:
    tau_min = _positive("tau_min", tau_min, allow_zero=True)
    tau_max = _positive("tau_max", tau_max)
    if tau_max < tau_min:
        raise ValueError(f"tau_max ({tau_max}) must be >= tau_min ({tau_min})")
    return tau_min, tau_max


def _clip(schedule: "TemperatureSchedule", tau: float, step) -> float:
    """tau clipped to [tau_min, tau_max]; warns once when the floor ends an annealing schedule."""
    if tau < schedule.tau_min and not getattr(schedule, "_floor_warned", False):
        schedule._floor_warned = True
        warnings.warn(
            f"{schedule.name} schedule: the floor tau_min={schedule.tau_min} takes over at step {step}; "
            f"from here the temperature is constant and the schedule no longer anneals "
            f"(set tau_min = 0 to keep annealing)",
            RuntimeWarning,
            stacklevel=3,
        )
    return min(max(tau, schedule.tau_min), schedule.tau_max)


class TemperatureSchedule(nn.Module):
    """Base class: ``temperature(step)`` -> tau_t; ``forward`` is an alias."""

    name: str = "base"

    def __init__(self, steps_per_epoch: int = 1, **options) -> None:
        super().__init__()
        if int(steps_per_epoch) != steps_per_epoch or steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
        self.steps_per_epoch = int(steps_per_epoch)
        # JSON-able description for lineage / metrics (name + constructor options).
        self.options = {"steps_per_epoch": self.steps_per_epoch, **options}

    @property
    def learnable(self) -> bool:
        """True when the schedule has trainable parameters (the optimizer must include them)."""
        return any(p.requires_grad for p in self.parameters())

    def _time(self, step: int | float) -> float:
        """Schedule time t: the step, or the (integer) epoch when ``steps_per_epoch`` > 1."""
        if isinstance(step, torch.Tensor):
            step = float(step)
        if not isinstance(step, (int, float)) or math.isnan(step) or step < 0:
            raise ValueError(f"step must be a non-negative number, got {step!r}")
        return float(step // self.steps_per_epoch) if self.steps_per_epoch > 1 else float(step)

    def temperature(self, step: int | float) -> float | torch.Tensor:
        raise NotImplementedError

    def forward(self, step: int | float) -> float | torch.Tensor:
        return self.temperature(step)

    def describe(self) -> dict:
        """``{"name": ..., **options}``: enough for ``create_schedule(**d)`` to rebuild it."""
        return {"name": self.name, **self.options}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.items())


@register_schedule("fixed")
class FixedSchedule(TemperatureSchedule):
    """Constant temperature tau (as a noise schedule: constant T)."""

    def __init__(self, tau: float = 0.1, steps_per_epoch: int = 1) -> None:
        tau = _positive("tau", tau)
        super().__init__(steps_per_epoch, tau=tau)
        self.tau = tau

    def temperature(self, step: int | float) -> float:
        self._time(step)  # validates step
        return self.tau


@register_schedule("learnable")
class LearnableSchedule(TemperatureSchedule):
    """CLIP-style learnable temperature: parameter ``logit_scale`` = log(1/tau).

    tau = 1 / exp(clamp(logit_scale, log(1/tau_max), log(1/tau_min))); CLIP initialises
    tau = 0.07 and caps the inverse temperature at 100 (tau_min = 0.01, tau_max = 1).
    The clamp passes zero gradient outside the range, like CLIP's post-step clamp.
    """

    def __init__(
        self, tau: float = 0.07, tau_min: float = 0.01, tau_max: float = 1.0, steps_per_epoch: int = 1
    ) -> None:
        tau = _positive("tau", tau)
        tau_min, tau_max = _clip_range(tau_min, tau_max)
        if tau_min == 0:
            raise ValueError("tau_min must be > 0 for a learnable temperature")
        if not tau_min <= tau <= tau_max:
            raise ValueError(f"tau ({tau}) must lie in [tau_min, tau_max] = [{tau_min}, {tau_max}]")
        super().__init__(steps_per_epoch, tau=tau, tau_min=tau_min, tau_max=tau_max)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / tau), dtype=torch.float32))
        self.tau_min, self.tau_max = tau_min, tau_max

    def temperature(self, step: int | float) -> torch.Tensor:
        self._time(step)
        scale = self.logit_scale.clamp(math.log(1.0 / self.tau_max), math.log(1.0 / self.tau_min))
        return torch.exp(-scale)  # 0-dim, requires grad


@register_schedule("log")
class LogSchedule(TemperatureSchedule):
    """Logarithmic annealing of the inverse temperature (the guaranteed one, docs/theory.md §3).

    1/tau_t = 1/tau_0 + log(1 + t/t_0) / c, then tau_t clipped to [tau_min, tau_max].
    With tau_0 = c / log(t_0) (``tau_0=None``, the default; needs t_0 > 1) this is exactly the paper's
    1/T_t = log(t + t_0) / c, since log(t_0) + log(1 + t/t_0) = log(t + t_0). For convergence to the
    global minimisers c must exceed the energy-barrier depth (in loss units for a noise schedule).
    The floor tau_min is off by default: a floor stops the annealing the guarantee rests on, so when a
    configured floor takes over a warning names the step.
    """

    def __init__(
        self,
        tau_0: float | None = None,
        t_0: float = 2.0,
        c: float = 1.0,
        tau_min: float = 0.0,
        tau_max: float = float("inf"),
        steps_per_epoch: int = 1,
    ) -> None:
        t_0 = _positive("t_0", t_0)
        c = _positive("c", c)
        if tau_0 is None:
            if t_0 <= 1:
                raise ValueError(f"tau_0=None (paper form c/log(t_0)) needs t_0 > 1, got t_0={t_0}")
            tau_0 = c / math.log(t_0)
        tau_0 = _positive("tau_0", tau_0)
        tau_min, tau_max = _clip_range(tau_min, tau_max)
        super().__init__(steps_per_epoch, tau_0=tau_0, t_0=t_0, c=c, tau_min=tau_min, tau_max=tau_max)
        self.tau_0, self.t_0, self.c, self.tau_min, self.tau_max = tau_0, t_0, c, tau_min, tau_max

    def temperature(self, step: int | float) -> float:
        t = self._time(step)
        inv = 1.0 / self.tau_0 + math.log1p(t / self.t_0) / self.c
        return _clip(self, 1.0 / inv, step)


@register_schedule("exp")
class ExpSchedule(TemperatureSchedule):
    """Exponential decay tau_t = tau_0 * gamma^t clipped to [tau_min, tau_max] (a fast schedule)."""

    def __init__(
        self,
        tau_0: float = 1.0,
        gamma: float = 0.999,
        tau_min: float = 0.01,
        tau_max: float = float("inf"),
        steps_per_epoch: int = 1,
    ) -> None:
        tau_0 = _positive("tau_0", tau_0)
        gamma = _positive("gamma", gamma)
        if gamma > 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        tau_min, tau_max = _clip_range(tau_min, tau_max)
        super().__init__(steps_per_epoch, tau_0=tau_0, gamma=gamma, tau_min=tau_min, tau_max=tau_max)
        self.tau_0, self.gamma, self.tau_min, self.tau_max = tau_0, gamma, tau_min, tau_max

    def temperature(self, step: int | float) -> float:
        t = self._time(step)
        # tau_0 * gamma^t computed in log space so huge t underflows cleanly to 0.
        tau = self.tau_0 * math.exp(t * math.log(self.gamma)) if self.gamma < 1 else self.tau_0
        return _clip(self, tau, step)


@register_schedule("cosine")
class CosineSchedule(TemperatureSchedule):
    """Kukleva et al. (ICLR 2023) cosine temperature.

    tau(e) = tau_min + (tau_max - tau_min) * (1 + cos(2 pi e / T)) / 2, with e the step (or the
    epoch when ``steps_per_epoch`` > 1) and T = ``period`` in the same unit. Defaults tau_min = 0.1,
    tau_max = 1.0 as in the paper. It oscillates; it does not anneal.
    """

    def __init__(
        self, tau_min: float = 0.1, tau_max: float = 1.0, period: float = 400.0, steps_per_epoch: int = 1
    ) -> None:
        tau_min, tau_max = _clip_range(tau_min, tau_max)
        period = _positive("period", period)
        super().__init__(steps_per_epoch, tau_min=tau_min, tau_max=tau_max, period=period)
        self.tau_min, self.tau_max, self.period = tau_min, tau_max, period

    def temperature(self, step: int | float) -> float:
        e = self._time(step)
        return (
            self.tau_min
            + (self.tau_max - self.tau_min) * (1.0 + math.cos(2.0 * math.pi * e / self.period)) / 2.0
        )
