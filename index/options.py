"""The knobs of every path that makes a version, as two frozen records (no numpy, FAISS or torch here).

A function that makes a version takes what it is made of (a dataset, vectors, a base version, ids) as
arguments and how it is made as options: `EmbedOptions` where images are embedded, `CommitOptions`
(tuning target, quality gate, activation, pruning) everywhere. `index.build.BuildOptions` is both plus
what to build (kind, parameters).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from index.defaults import DEFAULT_MARGIN

if TYPE_CHECKING:
    from index.store import IndexVersion

#: evaluator(candidate, serving) -> {"candidate": score, "serving": score, ...}: the quality gate's scorer
Evaluator = Callable[["IndexVersion", "IndexVersion"], dict]
#: calibrator(candidate) -> {"temperature": tau*, ...} or None; injected like the evaluator
Calibrator = Callable[["IndexVersion"], "dict | None"]


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EmbedOptions:
    """How images are embedded (build, rebuild, add, sync)."""

    batch_size: int = 256  # embedding batch
    num_workers: int = 0  # DataLoader workers
    shard_size: int = 8192  # items per resumable embedding shard
    device: Any = None  # torch device (None: default_device)
    progress: bool = True  # progress bars

    def check(self) -> None:
        """User-facing checks, each naming the bad value (ValueError)."""
        for name, low in (("batch_size", 1), ("shard_size", 1), ("num_workers", 0)):
            _check_int(name, getattr(self, name), low)


@dataclasses.dataclass(frozen=True)
class CommitOptions:
    """How a staged version is tuned, gated, committed and activated (`index.commit.commit`)."""

    target_recall: float = 0.95  # recall@10 the FAISS parameters are tuned to reach
    evaluator: Evaluator | None = None  # the quality gate's scorer (index/gate.py)
    calibrator: Calibrator | None = None  # the search temperature's calibration (None: keep it)
    margin: float = DEFAULT_MARGIN  # quality gate: candidate >= serving - margin
    force: bool = False  # activate even when the activation rule refuses
    activate: bool = True
    keep: int | None = None  # prune to this many versions after activating

    def check(self) -> None:
        """User-facing checks, each naming the bad value (ValueError)."""
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if not 0 < self.target_recall <= 1:
            raise ValueError(f"target_recall must be in (0, 1], got {self.target_recall}")
        if self.keep is not None:
            _check_int("keep", self.keep, 1)
