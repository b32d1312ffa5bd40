"""The verification stage: scores against independent computations, the verified candidate sets against
brute force, the verified fit against a grid search of its likelihood, and a small planted case grouped."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter
from scipy.special import logsumexp

from search.duplicates import verify
from search.duplicates.calibration import DuplicateCalibration, fit, fit_with_geometry, scored_candidates
from search.duplicates.edits import edited_copy
from search.duplicates.groups import mutual_groups, verified_candidate_sets
from training.images import load_rgb


def _picture(seed: int, size=(90, 70)) -> np.ndarray:
    """A smooth random colour picture with a few sharp blocks (like a stamp: shapes on a background)."""
    rng = np.random.default_rng(seed)
    w, h = size
    small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    im = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC)).copy()
    for _ in range(4):
        x, y = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        im[y:y + int(rng.integers(8, 20)), x:x + int(rng.integers(8, 20))] = rng.integers(0, 256, 3)
    return im


def _ncc(u: np.ndarray, v: np.ndarray) -> float:
    u = u.astype(np.float64).ravel() - u.mean()
    v = v.astype(np.float64).ravel() - v.mean()
    return float(u @ v / np.sqrt((u @ u) * (v @ v)))


def test_score_of_a_crop_is_at_least_the_ncc_of_the_true_window():
    """A crop of 93 % x 96 % resampled: the search finds a window at least as good as the true one, whose
    ncc is computed here independently (float64, the crop box cut from the original's pixels by hand)."""
    rgb = _picture(0)
    h, w = rgb.shape[:2]
    box = (3, 1, 3 + int(0.93 * w), 1 + int(0.96 * h))
    crop = Image.fromarray(rgb).crop(box).resize((120, 95), Image.BICUBIC)
    a, b = verify.thumb(rgb), verify.thumb(np.asarray(crop))
    window = np.asarray(Image.fromarray(rgb).resize((verify.SIDE, verify.SIDE), Image.BILINEAR, box=box))
    whole = np.asarray(crop.resize((verify.SIDE, verify.SIDE), Image.BILINEAR))
    truth = _ncc(window, whole)
    assert truth > 0.99
    assert verify.score(a, b) >= truth - 1e-4
    # without the window search (whole against whole) the crop scores clearly lower
    assert _ncc(np.asarray(Image.fromarray(rgb).resize((verify.SIDE, verify.SIDE), Image.BILINEAR)), whole) < truth - 0.02


def test_match_geometry_of_a_crop_a_resize_and_a_stretch():
    """A crop is undone by the window: no stretch, and the log crop -log(sx sy) of the true box; a resize
    (aspect kept) needs neither; an anisotropic stretch of 8 % shows as a distortion of log 1.08 less the
    rounding allowance 0.5 (1/w_a + 1/h_a + 1/w_b + 1/h_b), computed here from the pictures' sizes."""
    rgb = _picture(0, size=(180, 140))
    h, w = rgb.shape[:2]
    a = verify.thumb(rgb)
    box = (6, 3, 6 + int(0.92 * w), 3 + int(0.95 * h))
    crop = verify.match(a, verify.thumb(np.asarray(Image.fromarray(rgb).crop(box))))
    assert crop.ncc > 0.995 and crop.distortion == 0.0
    assert crop.cropped == pytest.approx(-np.log((box[2] - box[0]) / w * (box[3] - box[1]) / h), abs=0.01)
    assert crop.penalties()[:2] == (crop.distortion, crop.cropped ** 2)
    assert crop.structure > 0.97 and crop.penalties()[2] == pytest.approx(np.log1p((1 - crop.structure) / 1e-3))
    resized = verify.match(a, verify.thumb(np.asarray(Image.fromarray(rgb).resize((120, 93), Image.BICUBIC))))
    assert resized.distortion == 0.0 and resized.cropped < 0.01
    stretched_size = (round(w * 1.08), h)
    stretched = verify.match(a, verify.thumb(np.asarray(Image.fromarray(rgb).resize(stretched_size, Image.BICUBIC))))
    allowance = 0.5 * (1 / w + 1 / h + 1 / stretched_size[0] + 1 / stretched_size[1])
    # the window may trade a little stretch for a crop, never the whole of it (the window keeps >= 85 %)
    assert stretched.ncc > 0.99
    assert np.log(stretched_size[0] / w) - allowance - 0.03 < stretched.distortion <= np.log(1.08) - allowance + 1e-6


def test_final_reading_is_at_least_the_hand_computed_ncc_at_the_pairs_bandwidth():
    """A small drawing shrunk and JPEG'd (as a copy of a stamp is): the score reads both sides at n x n,
    n = min(FINE, smaller picture's longest side), low-passed; it is at least the ncc of the whole
    pictures computed here by hand at that n (float64), which beats the same ncc without the low-pass."""
    rgb = _picture(20, size=(38, 34))
    small = Image.fromarray(rgb).resize((24, 21), Image.BICUBIC)
    buf = io.BytesIO()
    small.save(buf, format="JPEG", quality=60)
    copy = load_rgb(buf.getvalue())
    a, b = verify.thumb(rgb), verify.thumb(copy)
    n = verify.fine_size(a, b)
    assert n == min(verify.FINE, 24)

    def read(x, blur):
        im = Image.fromarray(x).resize((n, n), Image.BILINEAR)
        return np.asarray(im.filter(ImageFilter.GaussianBlur(blur)) if blur else im)

    by_hand = _ncc(read(rgb, verify.BLUR), read(copy, verify.BLUR))
    assert verify.score(a, b) >= by_hand - 1e-4
    assert by_hand > _ncc(read(rgb, 0.0), read(copy, 0.0))
    assert verify.fine_size(verify.thumb(_picture(21, size=(300, 200))), a) == min(verify.FINE, 38)


STAMPS = Path("/usr/share/tuxpaint/stamps")


@pytest.mark.skipif(not STAMPS.is_dir(), reason="tuxpaint-stamps-default not installed")
def test_real_stamps_a_shrunk_jpeg_copy_scores_above_the_look_alike_letter():
    """Real files: x and X of the filled alphabet are the same glyph at two sizes (ncc > 0.998), yet a copy of
    x shrunk to 63 % and saved as JPEG q60 scores closer to x than x's look-alike X does, and the small
    santahat drawing's copy loses at most half the ncc it lost at the plain 32 px reading."""
    def jpeg(rgb, scale, quality):
        im = Image.fromarray(rgb)
        im = im.resize((round(im.width * scale), round(im.height * scale)), Image.BICUBIC)
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality)
        return load_rgb(buf.getvalue())

    letters = STAMPS / "symbols/alphabets/english/filled"
    x = load_rgb(letters / "lowercase/x_filled.png")
    tx, tX, tcopy = verify.thumb(x), verify.thumb(load_rgb(letters / "uppercase/X_filled.png")), verify.thumb(jpeg(x, 0.63, 60))
    look_alike = verify.score(tx, tX)
    assert look_alike > 0.998
    assert verify.score(tcopy, tx) > look_alike and verify.score(tcopy, tx) > verify.score(tcopy, tX)
    # the look-alike needs a stretch no edit makes (94 x 84 against 111 x 110); the copy needs none
    assert verify.match(tx, tX).distortion > 0.02 and verify.match(tcopy, tx).distortion == 0.0
    hat = load_rgb(STAMPS / "seasonal/christmas/santahat.png")
    a, b = verify.thumb(hat), verify.thumb(jpeg(hat, 0.63, 60))
    plain = max(verify._one_way(a, b)[0], verify._one_way(b, a)[0])      # the 32 px reading alone
    assert 1 - verify.score(a, b) < 0.5 * (1 - plain)


def test_score_is_symmetric_one_for_the_same_picture_and_low_for_a_mirror():
    rgb = _picture(1)
    a = verify.thumb(rgb)
    assert verify.score(a, verify.thumb(rgb.copy())) == pytest.approx(1.0, abs=1e-5)
    b = verify.thumb(np.ascontiguousarray(rgb[:, ::-1]))
    assert verify.score(a, b) == verify.score(b, a)
    assert verify.score(a, b) < 0.9
    c = verify.thumb(_picture(2))
    assert verify.score(a, c) == verify.score(c, a) < 0.9


def test_gain_and_offset_do_not_change_the_score():
    """ncc ignores a global gain and offset: a picture darkened by x0.8 + 20 still scores ~1."""
    rgb = _picture(3)
    darker = np.clip(rgb.astype(np.float64) * 0.8 + 20, 0, 255).astype(np.uint8)
    assert verify.score(verify.thumb(rgb), verify.thumb(darker)) > 0.999


def test_blank_pictures_match_only_blank_pictures_of_their_colour():
    white, grey = np.full((40, 40, 3), 255, np.uint8), np.full((30, 50, 3), 128, np.uint8)
    assert verify.thumb(white).blank
    assert verify.score(verify.thumb(white), verify.thumb(white.copy())) == 1.0
    assert verify.score(verify.thumb(white), verify.thumb(grey)) == pytest.approx(1 - 127 / 255)
    assert verify.score(verify.thumb(white), verify.thumb(_picture(4))) == 0.0
    # a blank picture shares no local structure with a drawing: the penalty of an unrelated pair, not none
    blank_vs_drawing = verify.match(verify.thumb(white), verify.thumb(_picture(4)))
    assert blank_vs_drawing.structure == 0.0 and blank_vs_drawing.penalties()[2] == pytest.approx(np.log1p(1e3))
    assert verify.match(verify.thumb(white), verify.thumb(white.copy())).penalties() == (0.0, 0.0, 0.0)


def test_the_products_edits_score_higher_than_other_pictures():
    rng = np.random.default_rng(5)
    pictures = [_picture(10 + i) for i in range(6)]
    thumbs = [verify.thumb(p) for p in pictures]
    for p, t in zip(pictures, thumbs):
        for _ in range(3):
            copy = verify.thumb(load_rgb(edited_copy(Image.fromarray(p), rng)[0]))
            own = verify.score(copy, t)
            assert own > 0.95
            assert own > max(verify.score(copy, o) for o in thumbs if o is not t)


class _Version:
    """The two things the candidate scans read of an IndexVersion: embeddings and a top-k search."""

    def __init__(self, x):
        from index import faiss_index as fi
        self.embeddings = x
        self.index, _ = fi.build("flat", x)

    def search(self, q, k):
        from index import faiss_index as fi
        return fi.search(self.index, q, k)


def _planted_pictures(n=24, seed=0):
    """n pictures, copies planted: 1 of 0 and 3 of 2 (edited), 5 of 4 (the same pixels: a file stored twice)."""
    rng = np.random.default_rng(seed)
    pics = [_picture(100 + i) for i in range(n)]
    pics[1] = load_rgb(edited_copy(Image.fromarray(pics[0]), rng)[0])
    pics[3] = load_rgb(edited_copy(Image.fromarray(pics[2]), rng)[0])
    pics[5] = pics[4].copy()
    return pics


def _embeddings(pics, rng):
    """Stand-in encoder output: a noisy 16 x 16 grey thumbnail (copies are close, all items comparable)."""
    z = np.stack([np.asarray(Image.fromarray(p).convert("L").resize((16, 16)), dtype=np.float64).ravel()
                  for p in pics])
    z = z - z.mean(axis=1, keepdims=True) + 3.0 * rng.normal(size=z.shape)
    return (z / np.linalg.norm(z, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("threshold, weights", [(0.5, [0.0, 0.0, 0.0]), (0.9, [0.0, 0.0, 0.0]),
                                                    (0.9, [40.0, 30.0, 0.5])])
def test_verified_candidate_sets_equal_brute_force_and_group_the_planted_copies(threshold, weights):
    pics = _planted_pictures()
    x = _embeddings(pics, np.random.default_rng(1))
    thumbs = [verify.thumb(p) for p in pics]
    calib = DuplicateCalibration(temperature=0.5, bias=2.0, threshold=threshold, target_precision=threshold,
                                 ece=0.0, held_out=0, stage="verified", verify_k=5, floor=0.2,
                                 geometry_weights=weights)
    sets, _ = verified_candidate_sets(_Version(x), calib, np.arange(len(pics)), lambda r: thumbs[r],
                                      threshold=threshold, max_group=4, block=7, progress=False)
    # brute force: every pair's cosine, the 5 nearest with cosine >= floor, every verify score, the softmax
    s = x.astype(np.float64) @ x.astype(np.float64).T
    for i in range(len(pics)):
        others = [j for j in np.argsort(-np.where(np.arange(len(pics)) == i, -np.inf, s[i]), kind="stable")[:5]
                  if s[i, j] >= 0.2]
        found = [verify.match(thumbs[i], thumbs[j]) for j in others]
        if not others:
            assert i not in sets
            continue
        v = np.array([m.ncc for m in found])
        # the evidence less the geometry's cost, written out
        e = -np.log(1.0 - v + 1e-4) - np.array([weights[0] * m.distortion + weights[1] * m.cropped ** 2
                                                 + weights[2] * np.log1p(max(0.0, 1 - m.structure) / 1e-3)
                                                 for m in found])
        # twins (the same pixels, compared directly) are in the set at p 1 and out of the softmax
        twins = [j for j in others if np.array_equal(pics[j], pics[i])]
        rest = [k for k, j in enumerate(others) if j not in twins]
        p = np.exp(e[rest] / 0.5 - np.logaddexp(2.0 / 0.5, logsumexp(e[rest] / 0.5))) if rest else np.zeros(0)
        order = np.argsort(-p, kind="stable")      # no two of the rest share pixels here: one picture each
        reached = np.flatnonzero(np.cumsum(p[order][:4]) >= threshold)
        expect = {j: 1.0 for j in twins}
        if reached.size:
            expect.update({others[rest[o]]: p[o] for o in order[:reached[0] + 1]})
        if not expect:
            assert i not in sets
            continue
        got = dict(zip(sets[i].rows.tolist(), sets[i].probabilities.tolist()))
        assert got.keys() == expect.keys() and sets[i].twins == frozenset(twins)
        np.testing.assert_allclose([got[j] for j in expect], list(expect.values()), rtol=1e-9)
    assert mutual_groups(sets) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("threshold", [0.5, 0.9, 0.99])
def test_an_edited_copy_of_a_file_stored_twice_joins_both(threshold):
    """4 and 5 are one file stored twice, 24 an edited copy of it: the copy's p splits between the twins and
    each twin's mass sits on the other, so without twin handling the copy fell out of the group whenever the
    twin alone reached P. Now the three are one group at every P, each member sure its original is among the
    others; the confidence leaves a member's twins out (they are the picture itself)."""
    from search.duplicates.groups import describe_group

    pics = _planted_pictures()
    pics.append(load_rgb(edited_copy(Image.fromarray(pics[4]), np.random.default_rng(3))[0]))
    x = _embeddings(pics, np.random.default_rng(1))
    thumbs = [verify.thumb(p) for p in pics]
    assert thumbs[4].digest == thumbs[5].digest != thumbs[24].digest
    calib = DuplicateCalibration(temperature=0.5, bias=2.0, threshold=threshold, target_precision=threshold,
                                 ece=0.0, held_out=0, stage="verified", verify_k=5, floor=0.2)
    sets, _ = verified_candidate_sets(_Version(x), calib, np.arange(len(pics)), lambda r: thumbs[r],
                                      threshold=threshold, max_group=4, block=7, progress=False)
    groups = mutual_groups(sets)
    assert [4, 5, 24] in groups and [0, 1] in groups and [2, 3] in groups
    record = describe_group([4, 5, 24], sets, [str(r) for r in range(len(pics))])
    # 4's only non-twin is the copy: its p with the twin left out of the softmax
    e = verify.evidence(verify.match(thumbs[4], thumbs[24]).ncc)
    p_copy = 1.0 / (1.0 + np.exp((2.0 - e) / 0.5))
    copy_mass = sum(dict(zip(sets[24].rows.tolist(), sets[24].probabilities.tolist()))[t] for t in (4, 5))
    assert record["confidence"] == pytest.approx(min(p_copy, copy_mass), rel=1e-6) and record["confidence"] >= threshold
    assert {(pr["a"], pr["b"]): pr["p_ab"] for pr in record["pairs"]}[("4", "5")] == 1.0


def test_verified_fit_equals_a_grid_search_of_the_likelihood():
    """Queries whose answer is drawn from the verified model (scores of a few candidates, no tail): the
    Nelder-Mead fit lands on the minimum of the mean negative log-likelihood found by a plain grid."""
    rng = np.random.default_rng(7)
    tau0, b0 = 0.004, 0.985
    queries = []
    for _ in range(600):
        v = np.sort(rng.uniform(0.9, 0.995, 5))[::-1]
        if rng.random() < 0.5:
            v[0] = rng.uniform(0.975, 1.0)
        logits = np.r_[b0 / tau0, v / tau0]
        p = np.exp(logits - logsumexp(logits))
        answer = int(rng.choice(6, p=p)) - 1
        rows = np.arange(5) + 1000
        queries.append(scored_candidates(v, rows, int(rows[answer]) if answer >= 0 else -1))
    tau, bias = fit(queries)

    v = np.stack([q.top for q in queries])                                   # (queries, 5)
    answer = np.array([np.flatnonzero(q.top_rows == q.source)[0] if q.source >= 0 else -1 for q in queries])

    def nll(t, b):   # written out again: -log p(answer) with p over {none} + the candidates
        log_z = np.logaddexp(b / t, logsumexp(v / t, axis=1))
        chosen = np.where(answer >= 0, v[np.arange(len(queries)), np.maximum(answer, 0)] / t, b / t)
        return float(np.mean(log_z - chosen))

    grid = [(nll(t, b), t, b) for t in np.geomspace(0.002, 0.008, 49) for b in np.linspace(0.975, 0.995, 81)]
    best = min(grid)
    assert nll(tau, bias) <= best[0] + 1e-9                        # at least as good as every grid point
    assert abs(np.log(tau / best[1])) < 0.06 and abs(bias - best[2]) < 1e-3
    assert abs(np.log(tau / tau0)) < 0.3 and abs(bias - b0) < 3e-3


def test_geometry_fit_recovers_the_generating_weights_and_equals_a_grid_search():
    """Queries whose answer is drawn from s_j = e_j - w . g_j at (tau, b, w): fit_with_geometry recovers them,
    and no point of a grid around its answer has a lower likelihood (written out again here)."""
    rng = np.random.default_rng(3)
    tau0, b0, w0 = 0.6, 4.0, np.array([30.0, 12.0, 2.0])
    queries = []
    for _ in range(3000):
        e = rng.uniform(0.0, 9.0, 6)
        g = np.abs(rng.normal(0.0, [0.1, 0.1, 1.0], (6, 3)))
        logits = np.r_[b0 / tau0, (e - g @ w0) / tau0]
        answer = int(rng.choice(7, p=np.exp(logits - logsumexp(logits)))) - 1
        rows = np.arange(6) + 50
        queries.append(scored_candidates(e, rows, int(rows[answer]) if answer >= 0 else -1, g))
    tau, bias, w = fit_with_geometry(queries)
    assert abs(np.log(tau / tau0)) < 0.1 and abs(bias - b0) < 0.3
    assert abs(w[0] - w0[0]) < 4.0 and abs(w[1] - w0[1]) < 3.0 and abs(w[2] - w0[2]) < 0.4

    def nll(t, b, u):
        total = 0.0
        for q in queries:
            logits = np.r_[b / t, (q.top - q.geometry @ u) / t]
            at = np.flatnonzero(q.top_rows == q.source)
            total += logsumexp(logits) - (logits[1 + at[0]] if at.size else b / t)
        return total / len(queries)

    best = nll(tau, bias, np.array(w))
    for dt in (0.97, 1.03):
        for db in (-0.05, 0.05):
            for du in np.vstack([np.eye(3), -np.eye(3)]) * [1.0, 1.0, 0.05]:
                assert best <= nll(tau * dt, bias + db, np.array(w) + du) + 1e-9
    # without geometry the weighed queries are the queries themselves
    assert queries[0].weighed([0.0, 0.0, 0.0]) is queries[0]
    moved = queries[0].weighed(w)
    np.testing.assert_allclose(np.sort(moved.top)[::-1], moved.top)
    np.testing.assert_allclose(np.sort(moved.top), np.sort(queries[0].top - queries[0].geometry @ np.array(w)))


def test_evidence_is_the_log_distance_capped_at_an_identical_copy():
    np.testing.assert_allclose(verify.evidence([1.0, 0.999, 0.9]), -np.log([1e-4, 1e-3 + 1e-4, 0.1 + 1e-4]))
    assert verify.BEST_EVIDENCE == pytest.approx(-np.log(1e-4)) and verify.evidence(-np.inf) == -np.inf


def test_scored_candidates_orders_and_drops_unscored_rows():
    q = scored_candidates(np.array([0.5, -np.inf, 0.9]), np.array([10, 11, 12]), 12)
    assert q.top.tolist() == [0.9, 0.5] and q.top_rows.tolist() == [12, 10] and q.source == 12
    assert not q.tail_counts.any()


def test_verified_calibration_round_trips_through_json():
    calib = DuplicateCalibration(temperature=0.004, bias=0.98, threshold=0.99, target_precision=0.99, ece=0.01,
                                 held_out=10, stage="verified", verify_k=8, floor=0.93)
    back = DuplicateCalibration.from_json(calib.to_json())
    assert (back.stage, back.verify_k, back.floor) == ("verified", 8, 0.93)
    old = {k: v for k, v in calib.to_json().items() if k not in ("stage", "verify_k", "floor")}
    assert DuplicateCalibration.from_json(old).stage == "encoder"     # scans written before the stage existed


def test_thumb_reads_a_copy_from_bytes():
    buf = io.BytesIO()
    Image.fromarray(_picture(8)).save(buf, format="PNG")
    assert verify.score(verify.thumb(load_rgb(buf.getvalue())), verify.thumb(_picture(8))) == pytest.approx(1.0, abs=1e-5)


def _structure_by_hand(u: np.ndarray, w: np.ndarray, n: int) -> float:
    """verify.local_structure written out: an explicit normalised Gaussian kernel (radius 4 sigma, mirrored
    edges as scipy's 'reflect'), the windowed moments summed over channels at every pixel at least 2 sigma
    (rounded) from the border, the minimum."""
    u, w = u.reshape(n, n, 3).astype(np.float64), w.reshape(n, n, 3).astype(np.float64)
    sigma = max(1.0, n * verify.STRUCTURE_WINDOW)
    r = int(4.0 * sigma + 0.5)
    k1 = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    kernel = np.outer(k1, k1) / k1.sum() ** 2
    pad = lambda x: np.pad(x, ((r, r), (r, r), (0, 0)), mode="symmetric")
    pu, pw = pad(u), pad(w)
    c = verify.STRUCTURE_FLOOR / (n * n)
    worst = np.inf
    inner = int(round(2 * sigma))
    for y in range(inner, n - inner):
        for x in range(inner, n - inner):
            a, b = pu[y:y + 2 * r + 1, x:x + 2 * r + 1], pw[y:y + 2 * r + 1, x:x + 2 * r + 1]
            m = lambda z: np.einsum("ij,ijc->c", kernel, z)
            ma, mb = m(a), m(b)
            var_a, var_b = (m(a * a) - ma ** 2).sum(), (m(b * b) - mb ** 2).sum()
            cov = (m(a * b) - ma * mb).sum()
            worst = min(worst, (cov + c) / np.sqrt((max(var_a, 0) + c) * (max(var_b, 0) + c)))
    return float(worst)


def test_local_structure_equals_the_hand_computed_windows_and_ignores_gain_and_offset():
    n = 24
    rgb = _picture(21, size=(n, n)).astype(np.float64)
    u = verify._unit(rgb.reshape(-1))
    other = rgb.copy()
    other[8:13, 9:15] = 255 - other[8:13, 9:15]           # one part differs: a stroke the other lacks
    w = verify._unit(other.reshape(-1))
    assert verify.local_structure(u, w, n) == pytest.approx(_structure_by_hand(u, w, n), abs=1e-9)
    assert verify.local_structure(u, w, n) < 0.8
    # a gain and offset of the whole picture leave every window's structure as it was
    brighter = verify._unit((rgb * 0.7 + 40).reshape(-1))
    assert verify.local_structure(u, brighter, n) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.skipif(not STAMPS.is_dir(), reason="tuxpaint-stamps-default not installed")
def test_real_stamps_the_dreidels_letters_differ_locally_where_a_jpeg_copy_does_not():
    """Real files: dreidel gimmel and nun are one drawing but for the letter (1 - ncc ~ 0.002, no stretch or
    crop, as close as a JPEG copy); the worst local window tells them apart: the copy keeps every window's
    structure, the other letter does not."""
    hanukkah = STAMPS / "seasonal/hanukkah"
    gimmel = load_rgb(hanukkah / "dreydl-gimmel.png")
    buf = io.BytesIO()
    Image.fromarray(gimmel).resize((120, 113), Image.BICUBIC).save(buf, format="JPEG", quality=50)
    a = verify.thumb(gimmel)
    look_alike = verify.match(a, verify.thumb(load_rgb(hanukkah / "dreydl-nun.png")))
    copy = verify.match(a, verify.thumb(load_rgb(buf.getvalue())))
    assert look_alike.ncc > 0.997 and look_alike.distortion == 0.0
    assert look_alike.structure < 0.95 and copy.structure > 0.98
    assert look_alike.penalties()[2] > copy.penalties()[2] + 1.0


def test_plain_window_is_at_least_a_brute_force_grid_of_windows_without_stretch():
    """verify._plain searches only windows with the other picture's aspect (what a crop then a resize makes): its
    window has exactly that aspect, and its ncc is at least the best of a brute-force grid of such windows whose
    ncc is computed here by hand (float64, PIL's box resample and blur); a crop that changes the aspect is found."""
    rgb = _picture(3, size=(160, 120))
    box = (9, 4, 9 + 146, 4 + 113)                      # keeps 91 % x 94 %: the aspect changes by 3 %
    copy = np.asarray(Image.fromarray(rgb).crop(box).resize((110, 85), Image.BICUBIC))
    a, b = verify.thumb(rgb), verify.thumb(copy)
    n = verify.fine_size(a, b)
    start = verify._fine(a, b, verify._one_way(a, b)[1], n)[1]
    value, (x0, y0, sx, sy) = verify._plain(a, b, n, start)
    assert (sx * 160) / (sy * 120) == pytest.approx(110 / 85, rel=1e-9)

    def read(im, window=None):
        w, h = im.size
        crop = None if window is None else (window[0] * w, window[1] * h, (window[0] + window[2]) * w,
                                            (window[1] + window[3]) * h)
        return np.asarray(im.resize((n, n), Image.BILINEAR, box=crop).filter(ImageFilter.GaussianBlur(verify.BLUR)))

    whole = read(Image.fromarray(copy))
    ax = (110 / 85) / (160 / 120)                         # the largest window of the copy's aspect: ax x 1
    grid = max(_ncc(read(Image.fromarray(rgb), (x, y, k * ax, k)), whole)
               for k in np.linspace(0.9, 1.0, 11) for x in np.linspace(0, 1 - 0.9 * ax, 9) for y in np.linspace(0, 0.1, 9)
               if x + k * ax <= 1 and y + k <= 1)
    assert grid > 0.99
    assert value >= grid - 1e-4
    assert verify.match(a, b).distortion == 0.0


@pytest.mark.skipif(not STAMPS.is_dir(), reason="tuxpaint-stamps-default not installed")
def test_real_stamps_a_copy_of_a_flat_letter_needs_no_stretch_and_l_and_I_outlines_still_do(monkeypatch):
    """Real files: I_filled is a solid bar, so many windows match its JPEG copy equally well and the free search
    alone settles on a stretched one (distortion ~0.02, shown with PLAIN_RATIO 0); the window without stretch is as
    good, so the match takes it. l_outline ~ I_outline (two rectangle outlines 31 x 115 and 32 x 110) match at
    1 - ncc ~ 3e-4 only through a stretch: without one they lose two orders of magnitude, and keep it."""
    letters = STAMPS / "symbols/alphabets/english"
    bar = load_rgb(letters / "filled/uppercase/I_filled.png")
    buf = io.BytesIO()
    Image.fromarray(bar).save(buf, format="JPEG", quality=75)
    a, b = verify.thumb(bar), verify.thumb(load_rgb(buf.getvalue()))
    assert verify.match(a, b).distortion == 0.0 and verify.match(a, b).ncc > 0.9999
    monkeypatch.setattr(verify, "PLAIN_RATIO", 0.0)
    assert verify.match(verify.thumb(bar), verify.thumb(load_rgb(buf.getvalue()))).distortion > 0.01
    monkeypatch.undo()
    l, I = verify.thumb(load_rgb(letters / "outlined/lowercase/l_outline.png")), verify.thumb(
        load_rgb(letters / "outlined/uppercase/I_outline.png"))
    found = verify.match(l, I)
    assert found.ncc > 0.999 and found.distortion > 0.05
    n = verify.fine_size(l, I)
    plain = max(verify._plain(s, o, n, verify._fine(s, o, verify._one_way(s, o)[1], n)[1])[0]
                for s, o in ((l, I), (I, l)))
    assert 1 - plain > 100 * (1 - found.ncc)


def test_an_unreadable_calibration_copy_is_a_query_with_no_candidates():
    """job._verified without a thumb (the copy could not be decoded): no candidate is scored, and the query carries a
    geometry of PENALTIES columns like every other (it was 2 columns wide before the third penalty)."""
    from search.duplicates.job import _verified

    q = _verified(None, np.arange(5), np.full(5, 0.99), thumbs=None, source=3, floor=0.9)
    assert q.source == -1 and q.top.size == 0 and q.geometry.shape == (0, verify.PENALTIES)
