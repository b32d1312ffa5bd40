"""How peaked a softmax search is, from its top-k probabilities and the index size N.

A calibrated search that cannot tell items apart spreads p(j|x) almost uniformly (1/N each): its top hit
is then no more probable than a random item, and a page that scales bars to the top hit hides that.
With only the top-k known, the entropy H(p) = -sum_j p_j log p_j over all N items is bounded above by
spreading the remaining mass r = 1 - sum_topk p evenly over the other N - k items:
    H(p) <= -sum_topk p_i log p_i - r log(r / (N - k)),
so exp(H) -- the effective number of candidates -- is at most that (exact when k = N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NEAR_UNIFORM_RATIO = 2.0  # top-1 below twice the uniform 1/N: the search barely prefers anything


@dataclass(frozen=True)
class Peakedness:
    top1_probability: float
    uniform_probability: float  # 1 / N
    top1_vs_uniform: float  # p_1 * N: 1 means no preference at all
    topk_mass: float  # sum of the returned probabilities
    effective_candidates_at_most: float  # exp(H) upper bound, out of N
    near_uniform: bool
    hint: str


def peakedness(top_probabilities, n_items: int) -> Peakedness:
    """Peakedness of a search over `n_items` whose top-k probabilities (any order) are given."""
    p = [float(v) for v in top_probabilities if v > 0]
    if n_items < 1:
        raise ValueError(f"n_items must be >= 1, got {n_items}")
    top1 = max(p, default=0.0)
    mass = min(1.0, sum(p))
    rest, others = max(0.0, 1.0 - mass), n_items - len(p)
    entropy = -sum(v * math.log(v) for v in p)
    if rest > 0 and others > 0:
        entropy -= rest * math.log(rest / others)
    ratio = top1 * n_items
    near = ratio < NEAR_UNIFORM_RATIO
    eff = math.exp(entropy)
    hint = (
        f"near-uniform: the top hit is only {ratio:.2g}x as probable as a random item; this search barely "
        f"tells the {n_items} items apart (try a lower temperature or a better encoder)"
        if near
        else f"the top hit is {ratio:.3g}x as probable as a random item; about {eff:.3g} of {n_items} items "
        f"share the probability (at most)"
    )
    return Peakedness(top1, 1.0 / n_items, ratio, mass, eff, near, hint)
