"""Duplicate groups of an index version at a calibrated probability threshold P.

For each item i (searched with its stored embedding against the index without itself) the model's
probabilities p(j | i) use the duplicate temperature and the "none" option (calibration.py). Its
candidate set S_i is the shortest prefix of its ranked neighbours whose probabilities sum to at
least P -- "at least P sure that i's original is among these" -- kept only when it has at most
`max_group` items (a diffuse answer means no copy). Items i and j are linked when each is in the
other's set (mutual: a look-alike that attracts i does not link it unless it is also drawn to i),
and groups are the cliques of that graph: each connected component is split greedily into groups
where every member is linked to every other, so a chain A-B-C with A and C unlinked never becomes
one group. A group is kept when every member is at least P sure that its original is among the
others (its confidence, `describe_group`). At the verified stage a picture stored twice (equal decoded
pixels) is one picture: an item's twins are always in its set and stay out of its softmax, and twins among
its candidates count as one candidate, so an edited copy of a file stored twice joins both.

Candidates come from the ANN index (top-k per item, never N^2 pairs); log Z is bounded from the
top-k (lower: those k alone; upper: every other item at the k-th similarity), and only an item whose
set differs between the two bounds gets an exact pass over the stored vectors. Memory is
O(block * N_block + N * max_group).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp
from tqdm.auto import tqdm

from search.duplicates.calibration import DuplicateCalibration

SCAN_BLOCK = 65_536


@dataclass
class CandidateSet:
    """S_i: rows and their p(j | i), most probable first; `exact` says whether log Z was summed exactly."""

    rows: np.ndarray
    probabilities: np.ndarray
    similarities: np.ndarray
    exact: bool
    twins: frozenset = frozenset()   # rows with the same pixels as this one (verified stage): p 1, always linked


def _prefix(p: np.ndarray, threshold: float, max_group: int) -> int:
    """Length of the shortest prefix of `p` (descending) with mass >= threshold, 0 if none within max_group."""
    reached = np.flatnonzero(np.cumsum(p[:max_group]) >= threshold)
    return int(reached[0]) + 1 if reached.size else 0


def log_z_without_self(embeddings: np.ndarray, queries: np.ndarray, self_rows: np.ndarray, tau: float,
                       bias: float, block: int = SCAN_BLOCK) -> np.ndarray:
    """Exact log(exp(b/tau) + sum_{l != self} exp(s_l/tau)) per query, streamed over the stored rows."""
    q = np.asarray(queries, dtype=np.float32)
    acc = np.full(q.shape[0], bias / tau)
    for start in range(0, embeddings.shape[0], block):
        logits = (q @ np.asarray(embeddings[start:start + block]).T).astype(np.float64) / tau
        mine = (self_rows >= start) & (self_rows < start + logits.shape[1])
        logits[np.flatnonzero(mine), self_rows[mine] - start] = -np.inf
        acc = np.logaddexp(acc, logsumexp(logits, axis=1))
    return acc


def _neighbour_blocks(version, rows: np.ndarray, k: int, block: int, desc: str, progress: bool):
    """Per block of `rows`: (the rows, their stored embeddings z (B, D) float32, their k nearest other
    rows (B, k) int64 from the version's ANN index, the row itself and FAISS's -1 fill dropped, -1 padded)."""
    emb = version.embeddings
    with tqdm(total=rows.size, desc=desc, unit="item", disable=not progress) as bar:
        for start in range(0, rows.size, block):
            mine = rows[start:start + block]
            z = np.ascontiguousarray(np.asarray(emb[mine]), dtype=np.float32)
            _, found = version.search(z, k + 1)
            cand = np.full((mine.size, k), -1, np.int64)
            for i in range(mine.size):
                others = found[i][(found[i] >= 0) & (found[i] != mine[i])][:k]
                cand[i, : others.size] = others
            yield mine, z, cand
            bar.update(mine.size)


def candidate_sets(version, calibration: DuplicateCalibration, rows, *, threshold: float, k: int = 32,
                   max_group: int = 8, block: int = 1024, progress: bool = True) -> tuple[dict[int, CandidateSet], int]:
    """{row: S_row} for the given rows (only non-empty sets), and how many rows needed an exact log Z."""
    tau, bias = calibration.temperature, calibration.bias
    emb = version.embeddings
    n = int(emb.shape[0])
    rows = np.asarray(rows, dtype=np.int64)
    k = min(int(k), n - 1)
    out: dict[int, CandidateSet] = {}
    exact_scans = 0
    if k < 1:
        return out, 0
    for mine, z, cand in _neighbour_blocks(version, rows, k, block, "duplicate candidates", progress):
        valid = cand >= 0
        sims = np.einsum("qd,qkd->qk", z.astype(np.float64), np.asarray(emb[np.maximum(cand, 0)], dtype=np.float64))
        sims[~valid] = -np.inf
        order = np.argsort(-sims, axis=1, kind="stable")   # exact order (the index may be approximate)
        cand, sims = np.take_along_axis(cand, order, 1), np.take_along_axis(sims, order, 1)
        logits = sims / tau
        # bounds on log Z: the top-k alone (lower), every other item at the k-th similarity (upper)
        log_lo = np.logaddexp(bias / tau, logsumexp(logits, axis=1))
        rest = n - 1 - valid.sum(axis=1)
        kth = np.where(np.isfinite(sims[:, -1]), sims[:, -1], -1.0)
        with np.errstate(divide="ignore"):
            log_hi = np.logaddexp(log_lo, np.log(np.maximum(rest, 0)) + kth / tau)
        need_exact = []
        decided: dict[int, float] = {}
        for i in range(mine.size):
            longest = _prefix(np.exp(logits[i] - log_lo[i]), threshold, max_group)   # most generous p
            if longest == 0:
                continue                                   # even the upper bound on p reaches no set
            shortest = _prefix(np.exp(logits[i] - log_hi[i]), threshold, max_group)
            if shortest == longest:
                decided[i] = log_hi[i]
            else:
                need_exact.append(i)
        exact_rows = set(need_exact)
        if need_exact:
            idx = np.array(need_exact)
            exact = log_z_without_self(emb, z[idx], mine[idx], tau, bias)
            decided.update({int(i): float(v) for i, v in zip(idx, exact)})
            exact_scans += idx.size
        for i, log_z in decided.items():
            p = np.exp(logits[i] - log_z)
            m = _prefix(p, threshold, max_group)
            if m:
                out[int(mine[i])] = CandidateSet(cand[i, :m].copy(), p[:m].copy(), sims[i, :m].copy(),
                                                 exact=i in exact_rows)
    return out, exact_scans


class VerifiedScores:
    """Each scanned row's verified candidates, their scores v_j (ncc) and energies s_j, kept between scans of
    one calibration at different thresholds (neither depends on P, only the sets cut from them do): the
    default threshold's scan and the final one verify each pair once. Dense per row: n x k (int64 + two
    float64), 24 k bytes a row."""

    def __init__(self, n: int, k: int):
        self.known = np.zeros(int(n), dtype=bool)
        self.rows = np.full((int(n), int(k)), -1, dtype=np.int64)
        self.scores = np.full((int(n), int(k)), -np.inf)
        self.energies = np.full((int(n), int(k)), -np.inf)
        self.digests = np.zeros(int(n), dtype=np.int64)    # verify.Thumb.digest of each row read (0: not yet)

    def get(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if not self.known[row]:
            return None
        kept = self.rows[row] >= 0
        return self.rows[row][kept], self.scores[row][kept], self.energies[row][kept]

    def none_probabilities(self, calibration: DuplicateCalibration) -> np.ndarray:
        """p(none | i) of every row scored so far (a row with no verified candidate: 1), the input of
        calibration.collection_share."""
        energies = self.energies[self.known] / calibration.temperature
        with np.errstate(divide="ignore", invalid="ignore"):
            log_z = np.logaddexp(calibration.bias / calibration.temperature, logsumexp(energies, axis=1))
        return np.exp(calibration.bias / calibration.temperature - log_z)

    def put(self, row: int, others: np.ndarray, v: np.ndarray, s: np.ndarray) -> None:
        m = min(others.size, self.rows.shape[1])
        self.rows[row, :m], self.scores[row, :m], self.energies[row, :m] = others[:m], v[:m], s[:m]
        self.known[row] = True


def verified_candidate_sets(version, calibration: DuplicateCalibration, rows, thumbs, *, threshold: float,
                            max_group: int = 8, block: int = 256, progress: bool = True,
                            cache: VerifiedScores | None = None) -> tuple[dict[int, CandidateSet], int]:
    """{row: S_row} at the verified stage: the row's `calibration.verify_k` nearest items by cosine (ANN
    index, the row itself left out) with cosine >= `calibration.floor` are re-scored by verify.match: ncc
    v_j read as evidence e_j = -log(1 - v_j + EPS) (verify.evidence), less what the match's penalties g_j
    (stretch, crop, local structure) cost, s_j = e_j - w . g_j (calibration.energy), and

        p(j | i) = exp(s_j / tau) / (exp(b / tau) + sum_{l verified} exp(s_l / tau)),

    every other item at p = 0 (exactly the model calibration.py fitted on the verified calibration queries).
    `thumbs(row)` gives a row's verify.Thumb (None: unreadable, never a candidate). Memory: a block of
    rows' neighbours plus the thumb cache. The sets' `similarities` are the verification scores v_j. With
    `cache` (made for this calibration) a row verified by an earlier scan is not verified again."""
    from search.duplicates import verify

    tau, bias = calibration.temperature, calibration.bias
    emb = version.embeddings
    rows = np.asarray(rows, dtype=np.int64)
    k = min(int(calibration.verify_k), int(emb.shape[0]) - 1)
    out: dict[int, CandidateSet] = {}
    if k < 1:
        return out, 0

    def digest(r: int) -> int:
        """The pixel digest of row r (0: unreadable), kept in the cache once its thumb has been read."""
        if cache is not None and cache.digests[r]:
            return int(cache.digests[r])
        t = thumbs(r)
        d = t.digest if t is not None else 0
        if cache is not None:
            cache.digests[r] = d
        return d

    for mine, z, cand in _neighbour_blocks(version, rows, k, block, "duplicate candidates (verified)", progress):
        for i, row in enumerate(mine):
            known = cache.get(row) if cache is not None else None
            if known is None:
                others = cand[i][cand[i] >= 0]
                cos = np.asarray(emb[others], dtype=np.float64) @ z[i].astype(np.float64)
                others = others[cos >= calibration.floor]
                me = thumbs(row) if others.size else None
                others = others if me is not None else others[:0]
                v, geometry = verify.matched(me, [thumbs(j) for j in others])
                s = calibration.energy(verify.evidence(v), geometry)   # unreadable: v = e = -inf, p = 0
                order = np.argsort(-s, kind="stable")
                known = others[order], v[order], s[order]
                if cache is not None:
                    cache.put(row, *known)
            others, v, e = known
            if not others.size:
                continue
            found = _twin_aware_set(row, others, v, e, digest, tau, bias, threshold, max_group)
            if found is not None:
                out[int(row)] = found
    return out, int(rows.size)


def _twin_aware_set(row, others, v, e, digest, tau, bias, threshold, max_group) -> CandidateSet | None:
    """S_row from its verified candidates (e descending), with pictures stored twice (twins: equal pixel
    digests) as one picture: the row's own twins are always in its set (p 1) and left out of its softmax (the
    original of a picture is not the picture itself), and twins among the other candidates are one candidate
    whose p is their sum (a copy of a file stored twice is a copy of either)."""
    own = digest(row)
    digests = np.array([digest(int(j)) for j in others], dtype=np.int64)
    twin = (digests == own) & (own != 0)
    rest = np.flatnonzero(~twin & np.isfinite(e))
    log_z = np.logaddexp(bias / tau, logsumexp(e[rest] / tau)) if rest.size else bias / tau
    p = np.exp(e[rest] / tau - log_z)
    pictures: dict[int, list[int]] = {}          # digest (unknown: never merged) -> positions in `rest`
    for k, d in enumerate(digests[rest].tolist()):
        pictures.setdefault(d if d else -(k + 1), []).append(k)
    members = list(pictures.values())
    picture_p = np.array([p[m].sum() for m in members])
    order = np.argsort(-picture_p, kind="stable")
    m = _prefix(picture_p[order], threshold, max_group)
    if not m and not twin.any():
        return None
    picked = np.array([k for c in order[:m] for k in members[c]], dtype=np.int64)   # positions in `rest`
    chosen = rest[picked]
    return CandidateSet(np.r_[others[twin], others[chosen]].astype(np.int64),
                        np.r_[np.ones(int(twin.sum())), p[picked]], np.r_[v[twin], v[chosen]], exact=True,
                        twins=frozenset(others[twin].tolist()))


def mutual_groups(sets: dict[int, CandidateSet]) -> list[list[int]]:
    """Groups (lists of rows) from mutual links, each a clique: components split greedily, members with
    more links first."""
    links: dict[int, set[int]] = {}
    for i, cs in sets.items():
        for j in cs.rows.tolist():
            if j in sets and i in sets[j].rows.tolist():
                links.setdefault(i, set()).add(j)
                links.setdefault(j, set()).add(i)
    groups, assigned = [], set()
    for node in sorted(links, key=lambda r: (-len(links[r]), r)):
        if node in assigned:
            continue
        group = [node]
        for other in sorted(links[node] - assigned, key=lambda r: (-len(links[r]), r)):
            if all(other in links[g] for g in group):
                group.append(other)
        if len(group) > 1:
            groups.append(sorted(group))
            assigned.update(group)
    return sorted(groups, key=lambda g: (-len(g), g))


def describe_group(group: list[int], sets: dict[int, CandidateSet], ids: list[str]) -> dict:
    """JSON record of one group: ids, rows, each pair's p both ways and similarity, and the confidence
    min_i sum_{j in group, j != i} p(j | i), where i's twins (the same pixels) are left out of the sum and a
    member whose others are all its twins is sure (1)."""
    def p_of(a: int, b: int) -> tuple[float, float]:
        cs = sets[a]
        hit = np.flatnonzero(cs.rows == b)
        return (float(cs.probabilities[hit[0]]), float(cs.similarities[hit[0]])) if hit.size else (0.0, float("nan"))

    pairs = []
    for x, a in enumerate(group):
        for b in group[x + 1:]:
            p_ab, s = p_of(a, b)
            p_ba, _ = p_of(b, a)
            pairs.append({"a": ids[a], "b": ids[b], "p_ab": p_ab, "p_ba": p_ba, "similarity": s})
    def member_confidence(a: int) -> float:
        others = [b for b in group if b != a and b not in sets[a].twins]
        return sum(p_of(a, b)[0] for b in others) if others else 1.0   # only its twins: the same picture

    confidence = min(member_confidence(a) for a in group)
    return {"ids": [ids[r] for r in group], "rows": group, "confidence": confidence, "pairs": pairs}
