"""Search-temperature calibration: the tau minimising held-out H(q, p) (docs/theory.md §1).

H(q) does not depend on tau, so minimising H(q, p) minimises the gap KL(q || p). In beta = 1/tau,
H(q, p) = log Z(beta) - beta E_q[s] is convex (log Z is a log-partition function), hence unimodal
in log tau: a bounded 1-D Brent search in log tau finds the global minimum.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize_scalar

from search.evaluation.gap import GapResult, softmax_gap

logger = logging.getLogger(__name__)


@dataclass
class CalibrationResult:
    """tau* and the gap summaries at the training tau and at tau*, plus the gap-vs-tau curve."""

    temperature: float  # tau*
    train_temperature: float | None
    gap_at_train: dict | None  # GapResult.summary() at the training tau
    gap_at_calibrated: dict  # GapResult.summary() at tau*
    curve_tau: np.ndarray = field(default_factory=lambda: np.empty(0))
    curve_cross_entropy: np.ndarray = field(default_factory=lambda: np.empty(0))
    curve_kl: np.ndarray = field(default_factory=lambda: np.empty(0))
    n_evaluations: int = 0

    def __iter__(self):
        """`tau, gap = calibrate_temperature(...)` as in the architecture contract."""
        yield self.temperature
        yield self.gap_at_calibrated["kl"]

    def to_dict(self) -> dict:
        return {
            "temperature": self.temperature,
            "train_temperature": self.train_temperature,
            "gap_at_train": self.gap_at_train,
            "gap_at_calibrated": self.gap_at_calibrated,
            "curve": {
                "tau": self.curve_tau.tolist(),
                "cross_entropy": self.curve_cross_entropy.tolist(),
                "kl": self.curve_kl.tolist(),
            },
            "n_evaluations": self.n_evaluations,
        }


def calibrate_temperature(
    query_emb,
    db_emb,
    query_meta,
    db_meta,
    generator,
    train_temperature: float | None = None,
    bounds: tuple[float, float] = (1e-4, 10.0),
    xatol: float = 1e-4,
    n_curve: int = 17,
    block_q: int = 512,
    block_n: int = 8192,
    device=None,
) -> CalibrationResult:
    """argmin over tau in `bounds` of mean held-out H(q, p), by Brent in log tau (tolerance `xatol`).

    Also evaluates the gap at `train_temperature` and on an `n_curve`-point log grid spanning
    tau* and the training tau (a factor 4 either side) for the report's gap-vs-tau plot.
    """
    lo, hi = bounds
    if not (0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"temperature bounds must satisfy 0 < low < high, got {bounds}")
    if train_temperature is not None and not train_temperature > 0:
        raise ValueError(f"train_temperature must be positive, got {train_temperature!r}")
    cache: dict[float, GapResult] = {}

    def evaluate(tau: float) -> GapResult:
        if tau not in cache:
            cache[tau] = softmax_gap(
                query_emb,
                db_emb,
                query_meta,
                db_meta,
                generator,
                tau,
                block_q=block_q,
                block_n=block_n,
                device=device,
            )
        return cache[tau]

    def objective(log_tau: float) -> float:
        return float(evaluate(math.exp(log_tau)).cross_entropy.mean())

    opt = minimize_scalar(
        objective, bounds=(math.log(lo), math.log(hi)), method="bounded", options={"xatol": xatol}
    )
    tau_star = float(math.exp(opt.x))
    if min(abs(opt.x - math.log(lo)), abs(opt.x - math.log(hi))) < 10 * xatol:
        logger.warning("calibrated temperature %.4g sits at the search bound %s", tau_star, bounds)
    at_star = evaluate(tau_star).summary()
    at_train = evaluate(float(train_temperature)).summary() if train_temperature is not None else None
    n_evals = len(cache)
    ref = [tau_star] + ([float(train_temperature)] if train_temperature is not None else [])
    grid = np.exp(np.linspace(math.log(min(ref) / 4), math.log(max(ref) * 4), max(n_curve, 2)))
    grid = np.unique(np.concatenate([grid, ref]))
    ce = np.array([evaluate(float(t)).cross_entropy.mean() for t in grid])
    kl = np.array([evaluate(float(t)).kl.mean() for t in grid])
    logger.info(
        "calibrated tau %.5g (train tau %s): gap %.4g -> %.4g",
        tau_star,
        train_temperature,
        at_train["kl"] if at_train else float("nan"),
        at_star["kl"],
    )
    return CalibrationResult(
        tau_star,
        None if train_temperature is None else float(train_temperature),
        at_train,
        at_star,
        grid,
        ce,
        kl,
        n_evals,
    )
