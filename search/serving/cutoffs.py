"""Cut-offs and pages over a ranked softmax search: what to return from the top of p(.|x).

Hits arrive sorted by probability, highest first. Three rules, applied to ranks 1.. before paging:
- ``min_probability``: keep hits with p >= min_probability (a prefix, since p decreases);
- ``mass`` (top-p): keep the shortest prefix whose probabilities sum to at least ``mass``;
- then ``offset`` skips that many of the kept hits and ``k`` caps the page.
``n_passed`` counts the hits that passed among those fetched; ``more_may_pass`` says the fetch ended
before the cut-off did (every fetched hit passed), so more items beyond it could pass too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Page:
    start: int  # first returned position in the ranked hits
    stop: int  # one past the last
    n_passed: int  # ranked hits (among those fetched) that pass the cut-offs
    more_may_pass: bool  # every fetched hit passed: the cut-off may extend past the fetch


def cut_and_page(
    probabilities,
    k: int,
    offset: int = 0,
    min_probability: float | None = None,
    mass: float | None = None,
    fetched_all: bool = False,
) -> Page:
    """The page [start, stop) of ranked ``probabilities`` (descending) under the cut-offs.

    ``fetched_all``: the probabilities cover the whole index (then nothing more can pass)."""
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 1 or np.any(np.diff(p) > 1e-12 * max(1.0, float(p.max(initial=0.0)))):
        raise ValueError("probabilities must be a 1-d array sorted in decreasing order")
    if k < 1 or offset < 0:
        raise ValueError(f"k must be >= 1 and offset >= 0, got k={k}, offset={offset}")
    passed = p.size
    if min_probability is not None:
        passed = min(passed, int(np.count_nonzero(p >= min_probability)))
    reached = False
    if mass is not None:
        # shortest prefix with cumulative sum >= mass: the first index where the running sum reaches it
        hit = np.flatnonzero(np.cumsum(p) >= mass * (1 - 1e-12))
        if hit.size:
            passed, reached = min(passed, int(hit[0]) + 1), True
    more = (not fetched_all) and passed == p.size and not reached
    start = min(offset, passed)
    return Page(start, min(passed, start + k), passed, more)
