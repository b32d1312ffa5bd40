"""Duplicate detection: the calibrated model against data drawn from it, candidate sets against brute
force, the clique rule, and the edits."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from scipy.special import logsumexp

from search.duplicates.calibration import (DuplicateCalibration, calibrate, expected_calibration_error, fit,
                                           query_scores, threshold_for_precision, top1)
from search.duplicates.edits import edited_copy
from search.duplicates.groups import CandidateSet, candidate_sets, log_z_without_self, mutual_groups
from training.images import load_rgb


def _draw_queries(n: int, tau: float, bias: float, rng, n_items: int = 300):
    """Queries whose true answer is SAMPLED from the model p(.|x) at (tau, bias): a correct fit recovers
    (tau, bias) and its probabilities are calibrated by construction."""
    queries = []
    for _ in range(n):
        s = np.clip(rng.normal(0.55, 0.12, n_items), -1, 1)
        if rng.random() < 0.5:   # some queries have a close item (a copy-like neighbour)
            s[int(rng.integers(n_items))] = rng.uniform(0.85, 1.0)
        logits = np.r_[bias / tau, s / tau]
        p = np.exp(logits - logsumexp(logits))
        answer = int(rng.choice(n_items + 1, p=p)) - 1      # -1: "none"
        queries.append(query_scores(s, source=answer))
    return queries


def test_fit_recovers_the_generating_temperature_and_is_calibrated():
    rng = np.random.default_rng(0)
    queries = _draw_queries(1500, tau=0.02, bias=0.93, rng=rng)
    tau, bias = fit(queries[:1000])
    assert abs(np.log(tau / 0.02)) < 0.15 and abs(bias - 0.93) < 0.01
    scored = [top1(q, tau, bias) for q in queries[1000:]]
    ece, _ = expected_calibration_error(np.array([c for c, _ in scored]), np.array([ok for _, ok in scored]))
    assert ece < 0.05


def test_histogram_log_z_matches_the_exact_sum():
    rng = np.random.default_rng(1)
    s = np.clip(rng.normal(0.4, 0.1, 5000), -1, 1)
    q = query_scores(s, source=3, exclude=7)
    for tau, bias in ((0.01, 0.9), (0.05, 0.7), (0.3, 0.0)):
        exact = logsumexp(np.r_[bias / tau, np.delete(s, 7) / tau])
        # the tail is binned at width 1e-3: each tail term is off by at most exp(0.5e-3 / tau)
        assert abs(q.log_z(tau, bias) - exact) <= 0.5e-3 / tau + 1e-12
    assert 7 not in q.top_rows and q.top_rows[0] == int(np.argmax(np.where(np.arange(5000) == 7, -9, s)))


def test_threshold_meets_the_target_precision_on_the_calibration_queries():
    conf = np.array([0.999, 0.995, 0.99, 0.98, 0.97, 0.6, 0.5])
    correct = np.array([1, 1, 1, 1, 0, 0, 1], bool)
    # precision of "p >= t" over the queries: 1, 1, 1, 1, 0.8, 0.67, 0.71 -> the lowest t meeting 0.75 is 0.97
    assert threshold_for_precision(conf, correct, 0.75) == 0.97
    # 0.98 would meet 0.99 on these queries, but a calibrated p below the target is not that sure
    assert threshold_for_precision(conf, correct, 0.99) == 0.99
    assert threshold_for_precision(conf, np.zeros(7, bool), 0.9) == 0.9  # never reached: the target, warned


def _planted(n=400, d=24, seed=0):
    """Unit vectors with planted near-copies (cosine ~0.97 to their original): three pairs and one triple."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)

    def near(v, eps):
        w = v + eps * rng.normal(size=d)
        return w / np.linalg.norm(w)
    for a, b in ((0, 1), (2, 3), (4, 5)):
        x[b] = near(x[a], 0.05)
    x[7], x[8] = near(x[6], 0.05), near(x[6], 0.05)             # a triple
    return x.astype(np.float32)


class _Version:
    """The two things candidate_sets reads of an IndexVersion: embeddings and a top-k search."""

    def __init__(self, x):
        from index import faiss_index as fi
        self.embeddings = x
        self.index, _ = fi.build("flat", x)
        self.ids = [f"item{i}" for i in range(x.shape[0])]

    def search(self, q, k):
        from index import faiss_index as fi
        return fi.search(self.index, q, k)


def _brute_sets(x, tau, bias, threshold, max_group):
    s = x.astype(np.float64) @ x.astype(np.float64).T
    out = {}
    for i in range(x.shape[0]):
        others = np.delete(np.arange(x.shape[0]), i)
        logits = s[i, others] / tau
        log_z = np.logaddexp(bias / tau, logsumexp(logits))
        order = np.argsort(-logits, kind="stable")
        p = np.exp(logits[order] - log_z)
        reached = np.flatnonzero(np.cumsum(p[:max_group]) >= threshold)
        if reached.size:
            m = reached[0] + 1
            out[i] = (others[order[:m]], p[:m])
    return out


@pytest.mark.parametrize("threshold", [0.9, 0.99])
def test_candidate_sets_equal_brute_force(threshold):
    x = _planted()
    calib = DuplicateCalibration(temperature=0.02, bias=0.85, threshold=threshold, target_precision=threshold,
                                 ece=0.0, held_out=0)
    sets, exact = candidate_sets(_Version(x), calib, np.arange(x.shape[0]), threshold=threshold, k=16, max_group=8,
                                 block=64, progress=False)
    ref = _brute_sets(x, 0.02, 0.85, threshold, 8)
    assert set(sets) == set(ref)
    for i, (rows, p) in ref.items():
        assert sets[i].rows.tolist() == rows.tolist()
        if sets[i].exact:
            np.testing.assert_allclose(sets[i].probabilities, p, rtol=1e-9)
        else:   # decided from the bounds: the reported p are lower bounds of the exact ones
            assert np.all(sets[i].probabilities <= p * (1 + 1e-12))
    groups = mutual_groups(sets)
    assert groups == [[6, 7, 8], [0, 1], [2, 3], [4, 5]]   # the planted copies, nothing else


def test_log_z_without_self_leaves_out_exactly_the_query_row():
    x = _planted(n=300)
    rows = np.array([0, 150, 299])
    got = log_z_without_self(x, x[rows], rows, 0.05, 0.8, block=64)
    s = x[rows].astype(np.float64) @ x.T.astype(np.float64) / 0.05
    s[np.arange(3), rows] = -np.inf
    np.testing.assert_allclose(got, np.logaddexp(0.8 / 0.05, logsumexp(s, axis=1)), rtol=1e-6)


def test_mutual_groups_split_components_into_cliques():
    def cs(rows):
        return CandidateSet(np.array(rows), np.full(len(rows), 0.5), np.ones(len(rows)), True)
    # 1-2, 2-3 mutual but 1-3 not: one component, not a clique
    sets = {1: cs([2]), 2: cs([1, 3]), 3: cs([2]), 4: cs([5, 6]), 5: cs([4, 6]), 6: cs([4, 5]), 7: cs([4])}
    groups = mutual_groups(sets)
    assert [4, 5, 6] in groups and sum(len(g) for g in groups if 2 in g) == 2
    assert not any(7 in g for g in groups)                # 7 -> 4 is not returned by 4


def test_edited_copies_decode_upright_and_differ():
    base = np.full((48, 64, 3), 230, np.uint8)
    base[:12, :12] = (200, 20, 20)                         # a red corner that must stay top-left
    image = Image.fromarray(base)
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(40):
        data, names = edited_copy(image, rng)
        seen.update(names)
        rgb = load_rgb(data)
        assert rgb.shape[1] >= rgb.shape[0]                # landscape again after EXIF rotation
        corner = rgb[: max(1, rgb.shape[0] // 8), : max(1, rgb.shape[1] // 8)].reshape(-1, 3).mean(0)
        assert corner[0] > 120 and corner[1] < 110         # red, top-left
        assert data != io.BytesIO().getvalue()
    assert {"jpeg", "resize", "crop", "exif_rotate", "colour", "as_png", "as_jpeg"} <= seen


def test_precision_curve_and_what_the_model_can_promise():
    from search.duplicates.calibration import precision_curve

    conf = np.array([0.999, 0.995, 0.99, 0.98, 0.97, 0.6, 0.5])
    correct = np.array([1, 1, 1, 1, 0, 0, 1], bool)
    curve = {r["threshold"]: (r["pairs"], r["precision"]) for r in precision_curve(conf, correct)}
    assert curve[0.99] == (3, 1.0) and curve[0.95] == (5, 0.8) and curve[0.5] == (7, 5 / 7)
    calib = DuplicateCalibration(temperature=0.02, bias=0.97, threshold=0.99, target_precision=0.99, ece=0.0,
                                 held_out=0, precision_curve=precision_curve(conf, correct))
    assert calib.reachable
    wrong_first = np.array([0, 1, 1, 1, 0, 0, 1], bool)   # the surest query is wrong: 0.999 is out of reach
    capped = DuplicateCalibration(temperature=0.02, bias=0.97, threshold=0.99, target_precision=0.999, ece=0.0,
                                  held_out=0, max_probability=0.8, precision_curve=precision_curve(conf, wrong_first))
    assert not capped.reachable and "at most 0.8 sure" in capped.limit_note()
    assert DuplicateCalibration.from_json(capped.to_json()).limit_note() == capped.limit_note()
    # the penalty weights travel with the calibration; a file written before them reads as no penalty, one
    # written before the local-structure penalty as that weight zero
    weighed = DuplicateCalibration(temperature=0.5, bias=4.0, threshold=0.9, target_precision=0.99, ece=0.0,
                                   held_out=0, stage="verified", geometry_weights=[30.0, 12.0, 0.5])
    again = DuplicateCalibration.from_json(weighed.to_json())
    assert again.geometry_weights == [30.0, 12.0, 0.5]
    np.testing.assert_allclose(again.energy([5.0, 6.0], [[0.1, 0.0, 2.0], [0.0, 0.05, 0.0]]), [1.0, 5.4])
    older = {k: v for k, v in weighed.to_json().items() if k != "geometry_weights"}
    assert DuplicateCalibration.from_json(older).geometry_weights == [0.0, 0.0, 0.0]
    two = {**weighed.to_json(), "geometry_weights": [30.0, 12.0]}
    assert DuplicateCalibration.from_json(two).geometry_weights == [30.0, 12.0, 0.0]


def test_calibrate_needs_enough_queries():
    with pytest.raises(ValueError, match="at least 20"):
        calibrate([query_scores(np.zeros(5), -1)] * 5)


def test_expected_precision_threshold_is_the_lowest_whose_mean_confidence_reaches_the_target():
    """Brute force over every candidate threshold (each confidence, ties included) and over the fixed levels;
    and with pairs right at the rate their confidence says (drawn here), the pairs kept at that threshold are
    right about as often as the target asks."""
    from search.duplicates.calibration import LEVELS, threshold_for_expected_precision

    def by_hand(conf, target, candidates):
        return min((t for t in candidates if (conf >= t).any() and conf[conf >= t].mean() >= target), default=None)

    conf = np.array([0.9999, 0.9995, 0.999, 0.998, 0.97, 0.93, 0.85, 0.55])
    assert threshold_for_expected_precision(conf, 0.99) == by_hand(conf, 0.99, conf) == 0.97   # top 5: 0.9933
    assert threshold_for_expected_precision(conf, 0.99, LEVELS) == by_hand(conf, 0.99, LEVELS) == 0.95
    assert threshold_for_expected_precision(conf, 0.9) == 0.55                     # mean of all 8 = 0.9117
    assert threshold_for_expected_precision(np.array([0.6, 0.7]), 0.99) is None
    assert threshold_for_expected_precision([], 0.99) is None
    ties = np.array([0.999, 0.9, 0.9])   # t = 0.9 keeps both 0.9s: mean 0.933 < 0.95, so only 0.999 is kept
    assert threshold_for_expected_precision(ties, 0.95) == by_hand(ties, 0.95, ties) == 0.999
    assert threshold_for_expected_precision([1.0, 1.0], 0.99) == 0.9999   # P stays below 1
    rng = np.random.default_rng(5)
    for _ in range(200):
        conf = np.round(rng.uniform(0.5, 0.99, rng.integers(1, 30)), 2)   # rounding makes ties
        target = rng.uniform(0.8, 0.99)
        assert threshold_for_expected_precision(conf, target) == by_hand(conf, target, conf)
    rng = np.random.default_rng(3)
    conf = np.concatenate([1 - rng.beta(0.3, 300, 4000), rng.uniform(0.5, 0.99, 1000)])
    right = rng.random(conf.size) < conf
    t = threshold_for_expected_precision(conf, 0.98)
    assert t is not None and abs(right[conf >= t].mean() - conf[conf >= t].mean()) < 0.01
    assert right[conf >= t].mean() > 0.97


def test_default_level_is_the_expected_precision_level_never_below_the_floor():
    """The default P: 79 sure groups and one look-alike at 0.69 average >= 0.99, so the expected-precision rule alone
    keeps the look-alike (P = 0.69); with the floor 0.9 it is left out and every sure group kept. A floor below the
    rule's level changes nothing, and no group reaching the target stays None whatever the floor."""
    from search.duplicates.calibration import default_level, threshold_for_expected_precision
    from search.duplicates.job import MIN_PROBABILITY

    conf = np.r_[np.full(79, 0.998), 0.69]
    assert conf.mean() >= 0.99 and threshold_for_expected_precision(conf, 0.99) == pytest.approx(0.69)
    assert default_level(conf, 0.99, 0.0) == pytest.approx(0.69)
    level = default_level(conf, 0.99, MIN_PROBABILITY)
    assert level == MIN_PROBABILITY and (conf >= level).sum() == 79
    assert default_level(np.r_[np.full(10, 0.999), 0.97], 0.99, MIN_PROBABILITY) == pytest.approx(0.97)
    assert default_level(np.array([0.6, 0.7]), 0.99, MIN_PROBABILITY) is None
    assert default_level([1.0, 1.0], 0.99, 1.0) == 0.9999        # P stays below 1
