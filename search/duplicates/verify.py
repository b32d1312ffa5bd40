"""The verification stage: does x look like a copy of j pixel for pixel, once a small crop is undone?

The encoder decides which items are candidates; this stage re-scores the few candidates of each item
with a representation that keeps what the product's edits (edits.py) keep and look-alikes do not: the
WHOLE picture (the encoder sees a centre square, so a tall "i" and "l" or two wide music clefs share
it) at SIDE x SIDE in colour. A crop keeping >= 90 % of each side is undone by searching the window
(x0, y0, width fraction sx, height fraction sy) of one picture that, resampled to SIDE x SIDE, best
matches the other by normalised cross-correlation

    ncc(u, v) = <u - mean u, v - mean v> / (|u - mean u| |v - mean v|),

which ignores a global gain and offset (brightness / contrast edits); JPEG noise, resampling and EXIF
rotation (undone at decode) leave it near 1. The search is a grid over sx, sy in COARSE_SCALES and
integer offsets (one matrix product over all windows), then a compass search in continuous coordinates
from the best grid windows; every window is resampled from the picture's own pixels in one step (a
second resampling of the whole picture would cost sharp drawings ~0.5 % of ncc).

The score is then read at the pair's own bandwidth: both sides at n x n, n = min(FINE, the smaller
picture's longest side), low-passed by a Gaussian of BLUR px, the window refined again there. A copy
cannot hold detail finer than its own pixels, and JPEG rings at the edges of small sharp drawings; at
32 px a 24 x 22 JPEG copy of a 38 x 34 drawing lost 1-2 % of ncc to detail the original has and the
copy never had. (Chosen on copies made with design seeds 5 and 7, never the bench's: on 464 copies of
the 116 stamps of <= 80 px, copies with 1 - ncc > 0.005 fell from 135 to 53; docs/results.md §12.)
The score is the larger of the two directions, so it is symmetric. A blank (constant) picture matches
only another blank one of the same colour.

The calibrated model (calibration.py) reads the score as evidence e = -log(1 - ncc + EPS): copies sit at
distances 1 - ncc of ~1e-4..1e-2 and look-alikes mostly above, a range a softmax over ncc itself (one
temperature, linear in ncc) cannot be sharp on; EPS is the distance below which ncc differences are
resampling noise, and caps the evidence of an identical copy at -log(EPS).

The match also says what geometry it needed (`Match`), because the edits constrain it: a crop is undone
by the window, and resizing keeps the aspect ratio, so a copy needs no anisotropic stretch beyond pixel
rounding, and at most a small crop. A free window search fits look-alikes by reaching for both (lowercase
x_filled 94 x 84 against uppercase X_filled 111 x 110 matches at ncc 0.9991 only through a window with a
5 % aspect change). The free search is not told that, so on pictures with flat regions (a filled bar matches many
of its windows equally well) it may settle on a stretched window for a plain copy; when the free window needs a
stretch, the best window without one (`_plain`) is taken if its distance 1 - ncc + EPS is within PLAIN_RATIO of
the free one's (docs/results.md §12, "A stretch the copies never had").

One more reading says WHERE the pictures differ. Two originals drawn alike can differ in one small part (the
dreidels of the Tux Paint stamps differ only in their letter: 1 - ncc 0.002, no stretch or crop, as close as a
JPEG copy of a small drawing), while an edit spreads its loss over the picture. At a detail reading (both sides at
min(DETAIL, the smaller picture's longest side) px, low-passed by DETAIL_BLUR px, the window refined there) the
worst local structure similarity (SSIM's structure term over Gaussian windows inside the picture, `local_structure`)
is ~0.998 for a median copy and 0.917 for the dreidels. The calibration weighs these three numbers against the ncc
(calibration.py; docs/results.md section 12 "Where the pictures differ").
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from PIL import Image, ImageFilter
from scipy.ndimage import gaussian_filter

SIDE = 32
WORK = 256                      # longest side of the working copy windows are resampled from
COARSE_SCALES = (1.0, 0.95, 0.9)   # fraction of each side a crop keeps (edits.py crops keep >= 0.9)
MIN_SCALE = 0.85
STARTS = 2                      # coarse windows the refinement starts from
STEP, MIN_STEP = 0.02, 0.001    # compass-search step (fractions of a side): first and last
FINE, BLUR = 24, 0.5            # the final reading: at most FINE px a side, Gaussian low-pass of BLUR px
FINE_STEP = 0.01                # its compass search's first step
EPS = 1e-4
# the detail reading: both sides at min(DETAIL, the smaller picture's longest side) px, low-passed by DETAIL_BLUR px;
# local structure in Gaussian windows of DETAIL / 16 px with a floor of STRUCTURE_FLOOR times the mean energy
DETAIL, DETAIL_BLUR, STRUCTURE_WINDOW, STRUCTURE_FLOOR = 48, 1.0, 1 / 16, 0.1
STRUCTURE_EPS = 1e-3            # 1 - s below which local structures count as the same
STRUCTURE_MARGIN = 2.0          # window centres closer than this many window sigmas to the border are left out
PLAIN_RATIO = 2.0               # a window without stretch wins within this factor of the free one's 1 - ncc + EPS
PENALTIES = 3                   # Match.penalties(): stretch, squared log crop, local-structure deficit
_FLAT = 1e-3                    # pixel std (0-255 scale) below which a picture counts as blank


@dataclass
class Thumb:
    """One picture prepared for verification."""

    work: Image.Image              # the whole picture, longest side at most WORK (RGB)
    base: np.ndarray               # (SIDE * SIDE * 3,) zero-mean unit vector of the whole picture, zeros if blank
    mean: float                    # mean pixel value (what blank pictures are compared on)
    renders: list                  # (sx, sy, uint8 render at SIDE/sx x SIDE/sy) for the coarse window grid
    wholes: dict = field(default_factory=dict)   # (n, blur) -> unit vector of the whole picture at n x n, low-passed
    digest: int = 0                # hash of the decoded pixels: equal for the same picture stored twice (twins)

    @property
    def blank(self) -> bool:
        return not self.base.any()


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    rows = rows - rows.mean(axis=-1, keepdims=True)
    norm = np.linalg.norm(rows, axis=-1, keepdims=True)
    flat = norm[..., 0] < _FLAT * np.sqrt(rows.shape[-1])
    rows = rows / np.where(norm > 0, norm, 1.0)
    rows[flat] = 0.0
    return rows


def thumb(rgb: np.ndarray) -> Thumb:
    """(H, W, 3) uint8, decoded as indexing decodes it (training/images.py) -> its Thumb."""
    work = Image.fromarray(np.asarray(rgb, dtype=np.uint8)).convert("RGB")
    if max(work.size) > WORK:   # aspect kept: every window is resampled from these pixels in one step
        work = work.resize(tuple(max(1, round(v * WORK / max(work.size))) for v in work.size), Image.BOX)
    base = np.asarray(work.resize((SIDE, SIDE), Image.BILINEAR), dtype=np.float32)
    renders = [(sx, sy, np.asarray(work.resize((int(round(SIDE / sx)), int(round(SIDE / sy))), Image.BILINEAR)))
               for sy in COARSE_SCALES for sx in COARSE_SCALES]
    return Thumb(work, _unit(base.reshape(-1)), float(base.mean()), renders, digest=pixel_digest(rgb))


def pixel_digest(rgb: np.ndarray) -> int:
    """A non-zero 63-bit hash of decoded pixels and their shape: the same picture stored twice has one digest."""
    arr = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))
    h = hashlib.blake2b(repr(arr.shape).encode() + arr.tobytes(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1 or 1


def _window(work: Image.Image, params, n: int = SIDE, blur: float = 0.0) -> np.ndarray:
    """The unit vector of the window (x0, y0, sx, sy) (fractions of the side) resampled to n x n (and
    low-passed by a Gaussian of `blur` px); params None: the whole picture."""
    w, h = work.size
    box = (0.0, 0.0, float(w), float(h))
    if params is not None:
        x0, y0, sx, sy = (float(v) for v in params)
        # clipped to the picture: x0 + sx may exceed 1 by a rounding error, which PIL refuses
        box = (min(max(x0 * w, 0.0), w), min(max(y0 * h, 0.0), h), min((x0 + sx) * w, w), min((y0 + sy) * h, h))
    im = work.resize((n, n), Image.BILINEAR, box=box)
    if blur:
        im = im.filter(ImageFilter.GaussianBlur(blur))
    return _unit(np.asarray(im, dtype=np.float32).reshape(-1))


def _whole(t: Thumb, n: int, blur: float = BLUR) -> np.ndarray:
    """The whole picture at n x n, low-passed by `blur` px (the final or the detail reading; cached on the thumb)."""
    if (n, blur) not in t.wholes:
        t.wholes[n, blur] = _window(t.work, None, n, blur)
    return t.wholes[n, blur]


def _compass(f, params, step: float, clip=None):
    """(value, params) of a compass search maximising f from `params`: each coordinate stepped both ways (kept
    inside by `clip`, default _clipped), the step halved when nothing improves, down to MIN_STEP."""
    clip = clip or _clipped
    value = f(params)
    while step >= MIN_STEP:
        moved = False
        for axis in range(len(params)):
            for sign in (1.0, -1.0):
                trial = list(params)
                trial[axis] += sign * step
                trial = clip(trial)
                v = f(trial)
                if v > value + 1e-7:
                    params, value, moved = trial, v, True
        if not moved:
            step /= 2
    return value, params


def _clipped(params) -> tuple[float, float, float, float]:
    """The window nearest to `params` inside the picture with scales in [MIN_SCALE, 1] (the refinement
    searches freely; a step past a wall lands on it instead of failing)."""
    x0, y0, sx, sy = (float(v) for v in params)
    sx, sy = min(max(sx, MIN_SCALE), 1.0), min(max(sy, MIN_SCALE), 1.0)
    return min(max(x0, 0.0), 1.0 - sx), min(max(y0, 0.0), 1.0 - sy), sx, sy


def _one_way(a: Thumb, b: Thumb) -> tuple[float, tuple]:
    """(ncc, window) of the best window of `a` against the whole of `b` at SIDE x SIDE: the coarse grid, then
    a compass search from its STARTS best windows."""
    found = []
    for sx, sy, render in a.renders:
        view = sliding_window_view(render, (SIDE, SIDE, 3))[:, :, 0]       # (ny, nx, SIDE, SIDE, 3)
        ny, nx = view.shape[:2]
        values = _unit(view.reshape(ny * nx, -1)) @ b.base
        i = int(np.argmax(values))
        h, w = render.shape[:2]
        found.append((float(values[i]), ((i % nx) / w, (i // nx) / h, SIDE / w, SIDE / h)))
    found.sort(key=lambda f: -f[0])
    best = (found[0][0], _clipped(found[0][1]))
    for _, params in found[:STARTS]:
        best = max(best, _compass(lambda p: float(_window(a.work, p) @ b.base), _clipped(params), STEP))
    return best


def fine_size(a: Thumb, b: Thumb, cap: int = FINE) -> int:
    """n of a reading at the pair's bandwidth: min(cap, the smaller picture's longest side), at least 8 (cap FINE:
    the final reading; DETAIL: the detail reading)."""
    return int(max(8, min(cap, max(a.work.size), max(b.work.size))))


def _fine(a: Thumb, b: Thumb, params, n: int) -> tuple[float, tuple]:
    """(ncc, window) of the window of `a` (refined from `params`) with the whole of `b`, both at n x n
    low-passed."""
    whole = _whole(b, n)
    return _compass(lambda p: float(_window(a.work, p, n, BLUR) @ whole), _clipped(params), FINE_STEP)


@dataclass(frozen=True)
class Match:
    """The verification of a pair: the best ncc, the geometry that window needed, and where the pictures differ.

    distortion: |log(aspect of the window) - log(aspect of the other picture)| beyond what pixel rounding
        explains (half a pixel on each side of both pictures: 0.5 (1/w_a + 1/h_a + 1/w_b + 1/h_b));
    cropped: -log(sx sy), the log of the share of the picture the window leaves out;
    structure: the worst local structure similarity at the detail reading (local_structure; 1: alike everywhere).
    """

    ncc: float
    distortion: float = 0.0
    cropped: float = 0.0
    structure: float = 1.0

    def penalties(self) -> tuple[float, float, float]:
        """The features the calibrated energy penalises (DuplicateCalibration.energy): the stretch, the square of
        the log crop (a Gaussian prior on the kept share, centred on the uncropped picture), and how far the worst
        local window is from the same structure, log(1 + (1 - s) / STRUCTURE_EPS) (0 when every window agrees)."""
        return self.distortion, self.cropped ** 2, float(np.log1p(max(0.0, 1.0 - self.structure) / STRUCTURE_EPS))


def _geometry(window_side: Thumb, other: Thumb, params) -> tuple[float, float]:
    """(distortion, cropped) of matching the window `params` of `window_side` to the whole of `other`."""
    _, _, sx, sy = params
    (ws, hs), (wo, ho) = window_side.work.size, other.work.size
    mismatch = abs(float(np.log((sx * ws) / (sy * hs))) - float(np.log(wo / ho)))
    rounding = 0.5 * (1.0 / ws + 1.0 / hs + 1.0 / wo + 1.0 / ho)
    return max(0.0, mismatch - rounding), -float(np.log(sx * sy))


def _plain(side: Thumb, other: Thumb, n: int, start) -> tuple[float, tuple]:
    """(ncc, window) of the best window of `side` with the aspect ratio of `other` (no stretch: what a resize or
    a crop can make) against the whole of `other` at the final reading; a compass search over (x0, y0, k), the
    window k (ax, ay) with (ax, ay) the largest of that aspect, from the centred largest window and from the free
    window `start` shrunk onto that aspect (the better of the two)."""
    (ws, hs), (wo, ho) = side.work.size, other.work.size
    ratio = (wo / ho) / (ws / hs)               # sx / sy of a window with the other's aspect: (sx ws)/(sy hs) = wo/ho
    ax, ay = (ratio, 1.0) if ratio <= 1.0 else (1.0, 1.0 / ratio)
    # windows thinner than MIN_SCALE of a side are beyond the crops a copy can have, as in the free search
    low = max(MIN_SCALE / ax, MIN_SCALE / ay, MIN_SCALE)

    def clip(p):
        k = min(max(float(p[2]), low), 1.0)
        return min(max(float(p[0]), 0.0), 1.0 - k * ax), min(max(float(p[1]), 0.0), 1.0 - k * ay), k

    if low > 1.0:   # the aspects differ by more than a crop can explain: no plain window exists
        return float("-inf"), start
    window = lambda p: (p[0], p[1], p[2] * ax, p[2] * ay)
    whole = _whole(other, n)
    x0, y0, sx, sy = start
    k = min(1.0, max(sx / ax, sy / ay))
    best = None
    for p in ((0.5 * (1.0 - ax), 0.5 * (1.0 - ay), 1.0), (x0 + 0.5 * (sx - k * ax), y0 + 0.5 * (sy - k * ay), k)):
        found = _compass(lambda q: float(_window(side.work, window(q), n, BLUR) @ whole), clip(p), FINE_STEP, clip)
        if best is None or found[0] > best[0]:
            best = found
    return best[0], window(best[1])


def local_structure(u: np.ndarray, w: np.ndarray, n: int, window: float = STRUCTURE_WINDOW,
                    floor: float = STRUCTURE_FLOOR, margin: float = STRUCTURE_MARGIN) -> float:
    """The worst local structure similarity of two zero-mean unit pictures (n*n*3,): SSIM's structure term,

        s(x) = (cov_uw(x) + c) / sqrt((var_u(x) + c)(var_w(x) + c)),

    with moments over a Gaussian window of sigma = n `window` px (channels summed) and c = `floor` / n^2 (by default
    a tenth of the mean per-pixel energy: windows flat in both read as alike; the design scripts vary both), over
    the window centres at least `margin` sigma from the border. A gain or offset anywhere leaves it at 1; a stroke
    one picture has and the other lacks (a dreidel's letter) drops it in that window alone. The border is left out
    because a crop's residual misalignment (the window found to a fraction of a pixel) shows there: among 120
    edited copies the worst window's deficit 1 - s had a 99 % quantile of 0.21 over all centres and 0.07 over the
    interior, while the dreidels' letter (0.083) is inside the picture."""
    u, w = u.reshape(n, n, 3).astype(np.float64), w.reshape(n, n, 3).astype(np.float64)
    sigma = max(1.0, n * window)
    blur = lambda x: gaussian_filter(x, sigma=(sigma, sigma, 0))
    mu_u, mu_w = blur(u), blur(w)
    var_u = np.maximum((blur(u * u) - mu_u ** 2).sum(axis=2), 0.0)
    var_w = np.maximum((blur(w * w) - mu_w ** 2).sum(axis=2), 0.0)
    cov = (blur(u * w) - mu_u * mu_w).sum(axis=2)
    c = floor / (n * n)
    inner = min(int(round(margin * sigma)), (n - 1) // 2)
    s = (cov + c) / np.sqrt((var_u + c) * (var_w + c))
    return float(s[inner:n - inner, inner:n - inner].min())


def _detail(side: Thumb, other: Thumb, params) -> float:
    """The worst local structure of the window `params` of `side` (refined at the detail reading) with `other`."""
    n = fine_size(side, other, DETAIL)
    whole = _whole(other, n, DETAIL_BLUR)
    _, params = _compass(lambda p: float(_window(side.work, p, n, DETAIL_BLUR) @ whole), _clipped(params), FINE_STEP)
    return local_structure(_window(side.work, params, n, DETAIL_BLUR), whole, n)


def match(a: Thumb, b: Thumb) -> Match:
    """The better of the two directions (a window of a against b, of b against a): the window found at
    SIDE x SIDE, read at the pair's bandwidth (fine_size, BLUR); its ncc is symmetric in a and b. When that
    window needs a stretch, the best window without one (_plain) is taken instead if it is within a factor
    PLAIN_RATIO of the distance, 1 - v + EPS <= PLAIN_RATIO (1 - v_free + EPS): on a picture with flat regions
    (a filled letter) many windows match equally well and the free search may settle on a stretched one, while
    a look-alike that needs its stretch (l_outline ~ I_outline) loses two orders of magnitude without it."""
    if a.blank and b.blank:
        return Match(1.0 - abs(a.mean - b.mean) / 255.0)
    if a.blank or b.blank:   # nothing in common: no correlation, and no local structure shared either
        return Match(0.0, structure=0.0)
    n = fine_size(a, b)
    found = []
    for side, other in ((a, b), (b, a)):
        value, params = _fine(side, other, _one_way(side, other)[1], n)
        found.append((value, side, other, params))
    value, side, other, params = max(found, key=lambda f: f[0])
    distortion, cropped = _geometry(side, other, params)
    if distortion > 0.0:
        plain = max(((*_plain(s, o, n, p), s, o) for _, s, o, p in found), key=lambda f: f[0])
        if 1.0 - plain[0] + EPS <= PLAIN_RATIO * (1.0 - value + EPS):
            value, params, side, other = plain
            distortion, cropped = _geometry(side, other, params)
    return Match(float(value), distortion, cropped, _detail(side, other, params))


def score(a: Thumb, b: Thumb) -> float:
    """Verification score in [-1, 1]: the best ncc of a window of one picture with the other picture
    (match(a, b).ncc)."""
    return match(a, b).ncc


def evidence(v):
    """-log(1 - v + EPS): the verification score on the scale the calibrated softmax uses."""
    return -np.log(np.maximum(1.0 - np.asarray(v, dtype=np.float64), 0.0) + EPS)


BEST_EVIDENCE = float(-np.log(EPS))     # an identical copy


def matched(query: Thumb, others: list) -> tuple[np.ndarray, np.ndarray]:
    """(ncc (k,), penalties (k, PENALTIES)) of query matched with each other thumb (None: unreadable, ncc -inf)."""
    found = [match(query, o) if o is not None else None for o in others]
    v = np.array([m.ncc if m is not None else -np.inf for m in found], dtype=np.float64)
    g = np.array([m.penalties() if m is not None else (0.0,) * PENALTIES for m in found],
                 dtype=np.float64).reshape(-1, PENALTIES)
    return v, g
