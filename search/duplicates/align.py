"""Pair alignment: one thumbnail warped onto the other by an affine map and a gain/offset, fitted by
inverse-compositional Lucas-Kanade (coarse to fine), started from a search that needs no gradient (phase
correlation over a few zooms: sparse pictures such as star fields have nothing for Lucas-Kanade to follow
from the identity); in every step the worst-fitting TRIM of the pixels, chosen by their residual in grey
levels and then after the fitted gain, take no part, so an overlay does not pull the map; batched over pairs
with torch. A
crop, resize, small rotation or brightness/contrast change is an affine map of the pixels and their values,
so after the fit a copy correlates with its original almost perfectly; two different pictures do not,
however the fit bends.

Features per pair (the better of both directions, and of the mirror with flips):
  ncc      normalised cross-correlation over the template pixels that land inside the other picture
  robust   the same with the worst-fitting 15 % of the picture left out, in cells and only where an
           overlay can reach (a caption along the top or bottom, a badge in a corner; a look-alike's other
           letter or emblem in the middle stays in): the better of two choices of them, by the residual
           after the least-squares gain and after the gain refitted on the pixels closest in grey levels (a
           caption on a dark picture sets the first gain)
  coverage share of the template that lands inside the other picture
  stretch  |log area ratio| + |log aspect ratio| of the fitted map (how much it had to bend)
  chroma   share of the template's colour (opponent chroma of the small colour thumbnails, warped by the
           same map) that the other's, at its best gain, does not explain, over all but the worst TRIM of
           the cells an overlay can reach (an overlay's colour): a saturation change keeps it near 0, a
           recoloured look-alike (the same icon in red and in blue) does not
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from search.duplicates.config import DedupConfig
from search.duplicates.edits import BADGE_REACH, CAPTION_REACH

FEATURES = ("ncc", "robust", "coverage", "stretch", "chroma")
CHROMA_FLOOR = 8.0  # chroma levels (of 255): below this an image counts as grey, its colour unmeasured
TRIM = 0.15
# the maps the fit may reach: what edits.py's crop (<= 20 % of the area, aspect +-10 %), resize and
# rotation (<= 5 degrees) make, with a margin; a look-alike is not fitted by bending further
MAX_SCALE = 1.4
MAX_SHEAR = 0.15
MAX_SHIFT = 0.4
_BLUR = torch.tensor([1.0, 2.0, 1.0]) / 4.0


def _blur(x: torch.Tensor) -> torch.Tensor:
    """[1 2 1] / 4 binomial blur, separable, edges replicated."""
    k = _BLUR.to(x)
    x = F.conv2d(F.pad(x, (1, 1, 0, 0), mode="replicate"), k.view(1, 1, 1, 3))
    return F.conv2d(F.pad(x, (0, 0, 1, 1), mode="replicate"), k.view(1, 1, 3, 1))


def _grid(side: int, device=None) -> torch.Tensor:
    c = (torch.arange(side, dtype=torch.float32, device=device) + 0.5) / side * 2 - 1
    y, x = torch.meshgrid(c, c, indexing="ij")
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)  # (P, 2): x, y


def _warp(img: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """img (B,1,S,S) sampled at theta (B,2,3) applied to the pixel grid -> (B,P), border-padded (the grid
    computed by broadcasting: affine_grid's batched 3-term matmul was the scan's slowest step)."""
    b, _, side, _ = img.shape
    pts = _grid(side, img.device)
    x, y = pts[:, 0], pts[:, 1]
    gx = theta[:, 0, 0, None] * x + theta[:, 0, 1, None] * y + theta[:, 0, 2, None]
    gy = theta[:, 1, 0, None] * x + theta[:, 1, 1, None] * y + theta[:, 1, 2, None]
    grid = torch.stack([gx, gy], dim=2).reshape(b, side, side, 2)
    return F.grid_sample(img, grid, mode="bilinear", padding_mode="border", align_corners=False).flatten(1)


def _inside(theta: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
    w = torch.einsum("bij,pj->bpi", theta[:, :, :2], pts) + theta[:, None, :, 2]
    return (w.abs() <= 1.0).all(dim=2).float()


def _masked_ncc(tv: torch.Tensor, v: torch.Tensor, w: torch.Tensor):
    """(ncc (B,), tv centred, v centred): the correlation of rows tv and v over the pixels weighted by w,
    each centred on its weighted mean."""
    n = w.sum(1).clamp(min=1.0)
    mt, mv = (w * tv).sum(1) / n, (w * v).sum(1) / n
    a, c = tv - mt[:, None], v - mv[:, None]
    cov = (w * a * c).sum(1)
    return cov / torch.sqrt((w * a * a).sum(1) * (w * c * c).sum(1) + 1e-9), a, c


def _fit(t: torch.Tensor, i: torch.Tensor, theta: torch.Tensor, iters: int) -> torch.Tensor:
    """Inverse-compositional Lucas-Kanade: the template's Jacobian and Hessian once, then per step
    only the warped image (its gain and offset fitted on the pixels kept) and a 6 x P product."""
    side = t.shape[-1]
    b = t.shape[0]
    pts = _grid(side, t.device)
    x, y = pts[:, 0], pts[:, 1]
    t_in = t
    t = (t - t.mean(dim=(2, 3), keepdim=True)) / (t.std(dim=(2, 3), keepdim=True) + 1e-3)
    gx = (torch.roll(t, -1, 3) - torch.roll(t, 1, 3)) * (side / 4.0)
    gy = (torch.roll(t, -1, 2) - torch.roll(t, 1, 2)) * (side / 4.0)
    gx[..., 0], gx[..., -1] = 0, 0
    gy[..., 0, :], gy[..., -1, :] = 0, 0
    gx, gy = gx.flatten(1), gy.flatten(1)
    jac = torch.stack([gx * x, gx * y, gx, gy * x, gy * y, gy], dim=2)  # (B, P, 6)
    h = torch.einsum("bpi,bpj->bij", jac, jac)
    h = h + (1e-3 * h.diagonal(dim1=1, dim2=2).mean(1) + 1e-6)[:, None, None] * torch.eye(6)
    k = torch.linalg.solve(h, jac.transpose(1, 2))  # (B, 6, P)
    full = torch.zeros(b, 3, 3)
    full[:, 2, 2] = 1.0
    full[:, :2] = theta
    eye = torch.eye(3)
    keep = max(1, int(round(side * side * (1 - TRIM))))
    t_raw = t_in.flatten(1)
    t_med, t_std = t_raw.median(1, keepdim=True).values, t_raw.std(1, keepdim=True) + 1e-3
    w = None
    for _ in range(iters):
        v = _warp(i, full[:, :2])
        # the worst-fitting TRIM of the pixels take no part in the step: an overlay does not pull. Which
        # pixels: first by the residual in grey levels about the medians, then after the gain and offset
        # fitted on the rest (standardising over all pixels would let a bright caption on a dark picture
        # set the scale)
        if w is None:
            r0 = ((t_raw - t_med) - (v - v.median(1, keepdim=True).values)).abs()
            w = (r0 <= r0.kthvalue(keep, dim=1, keepdim=True).values).float()
        n = w.sum(1, keepdim=True).clamp(min=1.0)
        mv, mt = (w * v).sum(1, keepdim=True) / n, (w * t_raw).sum(1, keepdim=True) / n
        g = (w * (v - mv) * (t_raw - mt)).sum(1, keepdim=True) / (
            (w * (v - mv) ** 2).sum(1, keepdim=True) + 1e-6
        )
        e = (g * (v - mv) - (t_raw - mt)) / t_std
        cut = torch.maximum(
            e.abs().kthvalue(keep, dim=1, keepdim=True).values,
            3 * e.abs().median(dim=1, keepdim=True).values,
        )
        w = (e.abs() <= cut).float()  # the next step's gain is fitted on these
        e = e * w
        d = torch.bmm(k, e[:, :, None])[:, :, 0].clamp(-0.3, 0.3)
        delta = eye.repeat(b, 1, 1)
        delta[:, :2] += d.reshape(b, 2, 3)
        full = full @ torch.linalg.inv(delta)
        # inside the edit family: a crop or resize of up to ~1.4x per axis, a few degrees of rotation
        diag = full[:, [0, 1], [0, 1]].clamp(1 / MAX_SCALE, MAX_SCALE)
        full[:, 0, 0], full[:, 1, 1] = diag[:, 0], diag[:, 1]
        full[:, 0, 1] = full[:, 0, 1].clamp(-MAX_SHEAR, MAX_SHEAR)
        full[:, 1, 0] = full[:, 1, 0].clamp(-MAX_SHEAR, MAX_SHEAR)
        full[:, :2, 2] = full[:, :2, 2].clamp(-MAX_SHIFT, MAX_SHIFT)
    return full[:, :2]


def _score(t: torch.Tensor, i: torch.Tensor, theta: torch.Tensor, cell: int) -> torch.Tensor:
    side = t.shape[-1] // 2
    pts = _grid(side, t.device)
    v = F.avg_pool2d(_warp(i, theta).reshape(i.shape), 2).flatten(1)
    m = _inside(theta, pts)
    tv = F.avg_pool2d(t, 2).flatten(1)

    def ncc(w):
        return _masked_ncc(tv, v, w)

    full, a, c = ncc(m)
    # robust: drop the worst-fitting TRIM of the picture in cell x cell cells (an overlay is one compact
    # region; a look-alike's differences -- other stars, another emblem's edges -- are spread over many
    # cells and are not dropped with it), chosen twice: first by the residual in grey levels about the
    # medians (an edit keeps the gain near 1; a least-squares gain would follow a bright caption on a dark
    # picture), then by the residual after the gain fitted on the rest
    cells = side // cell
    mc = F.avg_pool2d(m.reshape(-1, 1, side, side), cell).flatten(1)  # share of each cell inside
    keep_c = ((mc > 0).sum(1) * (1 - TRIM)).round().long().clamp(min=1)
    fixed = ~overlay_cells(cells).to(t.device).flatten()  # cells an overlay cannot reach: always kept

    def kept(res):
        r = F.avg_pool2d((res * m).reshape(-1, 1, side, side), cell).flatten(1) / mc.clamp(min=1e-6)
        r = torch.where(fixed, torch.full_like(r, -1.0), r)
        order = torch.where(mc > 0, r, torch.full_like(r, float("inf"))).argsort(dim=1)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1], device=t.device).expand_as(order))
        kept_cells = ((rank < keep_c[:, None]) & (mc > 0)).float().reshape(-1, 1, cells, cells)
        return F.interpolate(kept_cells, scale_factor=cell, mode="nearest").flatten(1) * m

    w2 = kept(((tv - tv.median(1, keepdim=True).values) - (v - v.median(1, keepdim=True).values)).abs())
    _, a2, c2 = ncc(w2)
    gain = (w2 * a2 * c2).sum(1) / ((w2 * c2 * c2).sum(1) + 1e-9)
    robust = ncc(kept((a2 - gain[:, None] * c2).abs()))[0]
    det = (theta[:, 0, 0] * theta[:, 1, 1] - theta[:, 0, 1] * theta[:, 1, 0]).abs().clamp(min=1e-3)
    sx = theta[:, :, 0].norm(dim=1).clamp(min=1e-3)
    sy = theta[:, :, 1].norm(dim=1).clamp(min=1e-3)
    stretch = det.log().abs() + (sx / sy).log().abs()
    return torch.stack([full, robust, m.mean(1), stretch], dim=1)


def overlay_cells(cells: int) -> torch.Tensor:
    """(cells, cells) bool: the cells of a picture's grid an overlay of edits.py can reach -- a caption along
    the top or bottom edge, a badge in a corner (a look-alike's other letter or emblem in the middle of the
    picture is then never dropped as if it were one)."""
    start = torch.arange(cells, dtype=torch.float32) / cells  # where each row (column) of cells begins
    near = torch.minimum(start, 1.0 - start - 1.0 / cells)  # its nearest point's distance to an edge
    band = near < CAPTION_REACH
    corner = near < BADGE_REACH
    return band[:, None] | (corner[:, None] & corner[None, :])


def _hann(side: int) -> torch.Tensor:
    w = torch.hann_window(side, periodic=False)
    return w[:, None] * w[None, :]


def phase_correlation(t: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift (B,2) x, y in pixels, peak (B,)) such that t(p) ~ i(p + shift): the peak of the inverse
    FFT of the whitened cross-power spectrum of the two Hann-windowed pictures (B,1,S,S), on the integer
    grid (a shift in [-S/2, S/2)). Needs no gradient: a sparse picture (a star field) aligns as well as a
    dense one."""
    side = t.shape[-1]
    w = _hann(side).to(t)

    def spec(x):
        x = x[:, 0]
        return torch.fft.rfft2((x - x.mean(dim=(1, 2), keepdim=True)) * w)

    cross = torch.conj(spec(t)) * spec(i)
    r = torch.fft.irfft2(cross / (cross.abs() + 1e-6), s=(side, side)).flatten(1)
    peak, at = r.max(dim=1)
    dy, dx = at // side, at % side
    shift = torch.stack([dx, dy], dim=1).float()
    return torch.where(shift >= side / 2, shift - side, shift), peak


def _ncc_at(t: torch.Tensor, i: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Correlation of t with i warped by theta over the pixels that land inside i."""
    m = _inside(theta, _grid(t.shape[-1], t.device))
    return _masked_ncc(t.flatten(1), _warp(i, theta), m)[0]


def coarse_start(t: torch.Tensor, i: torch.Tensor, zooms: tuple[float, ...]) -> torch.Tensor:
    """(B,2,3) start of the fit without gradients: for each zoom into i (the map's scale, a crop's inverse)
    the shift by phase correlation; the zoom and shift whose map correlates best, unless the identity does
    better (it then stays the start)."""
    b, side = t.shape[0], t.shape[-1]
    best = torch.zeros(b, 2, 3, device=t.device)
    best[:, 0, 0] = best[:, 1, 1] = 1.0
    score = _ncc_at(t, i, best)
    for z in zooms:
        theta = torch.zeros(b, 2, 3, device=t.device)
        theta[:, 0, 0] = theta[:, 1, 1] = z
        zoomed = _warp(i, theta).reshape(i.shape)
        shift, _ = phase_correlation(t, zoomed)
        theta[:, :, 2] = (z * shift * (2.0 / side)).clamp(-MAX_SHIFT, MAX_SHIFT)
        s = _ncc_at(t, i, theta)
        better = s > score
        best = torch.where(better[:, None, None], theta, best)
        score = torch.where(better, s, score)
    return best


def _pooled(x: torch.Tensor) -> torch.Tensor:
    return _blur(F.avg_pool2d(x, 2))


def _one_way(t: torch.Tensor, i: torch.Tensor, iters: tuple[int, int], zooms, cell: int) -> torch.Tensor:
    """From the coarse search's map (phase correlation over zooms, no gradients), fit on 2x-pooled
    thumbnails (coarse: 4x), score on the full ones warped, then pooled: the pooled reading of a warped
    sharp thumbnail is what a resize would make, not bilinear blur."""
    t2, i2 = _pooled(t), _pooled(i)
    theta = coarse_start(t2, i2, zooms)
    theta = _fit(_pooled(t2), _pooled(i2), theta, iters[0])
    theta = _fit(t2, i2, theta, iters[1])
    return _score(t, i, theta, cell), theta


def _chroma_residual(ca: torch.Tensor, cb: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """ca, cb (B,2,s,s) chroma; cb warped onto ca by theta; ||ca - g cb||^2 / (||ca||^2 + floor), g fitted,
    over the cells but the worst-fitting TRIM of them, taken only where an overlay can reach (an overlay's
    colour is not the picture's; a look-alike recoloured in its middle is not explained)."""
    w = torch.cat([_warp(cb[:, c : c + 1], theta) for c in range(cb.shape[1])], dim=1)
    a = ca.flatten(1)
    g = ((a * w).sum(1) / ((w * w).sum(1) + 1e-6)).clamp(0.5, 2.0)
    cells = ((a - g[:, None] * w) ** 2).reshape(len(a), ca.shape[1], -1).sum(1)  # (B, s*s)
    keep = max(1, int(round(cells.shape[1] * (1 - TRIM))))
    fixed = ~overlay_cells(ca.shape[-1]).to(ca.device).flatten()
    chosen = torch.where(fixed, torch.full_like(cells, -1.0), cells).topk(keep, dim=1, largest=False).indices
    res = cells.gather(1, chosen).sum(1)
    return res / ((1 - TRIM) * ((a * a).sum(1) + CHROMA_FLOOR**2 * a.shape[1]))


def pair_features(
    thumbs: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    *,
    colours: np.ndarray,
    iters=DedupConfig.iterations,
    zooms=DedupConfig.zooms,
    cell: int = DedupConfig.cell,
    flips: bool = False,
    other: np.ndarray | None = None,
    other_colours: np.ndarray | None = None,
    batch: int = 2048,
    progress=None,
) -> np.ndarray:
    """(len(a), len(FEATURES)) float32 features of pairs (thumbs[a], other[b]) (other: thumbs by default;
    colours: the (n, s, s, 2) chroma thumbnails beside them): each direction aligned, the direction (and,
    with flips, the mirror) with the higher robust ncc kept, its colour compared through the same map."""
    other = thumbs if other is None else other
    other_colours = colours if other_colours is None else other_colours
    out = np.zeros((len(a), len(FEATURES)), np.float32)
    with torch.no_grad():
        for s in range(0, len(a), batch):
            ta = torch.from_numpy(np.asarray(thumbs[a[s : s + batch]], np.float32))[:, None]
            tb = torch.from_numpy(np.asarray(other[b[s : s + batch]], np.float32))[:, None]
            ca = torch.from_numpy(np.asarray(colours[a[s : s + batch]], np.float32)).permute(0, 3, 1, 2)
            cb = torch.from_numpy(np.asarray(other_colours[b[s : s + batch]], np.float32)).permute(0, 3, 1, 2)
            tries = [(ta, tb, ca, cb), (tb, ta, cb, ca)]
            if flips:
                fb, fcb = torch.flip(tb, dims=[3]), torch.flip(cb, dims=[3])
                tries += [(ta, fb, ca, fcb), (fb, ta, fcb, ca)]
            scored = []
            for t, i, ct, ci in tries:
                f, theta = _one_way(t, i, iters, zooms, cell)
                scored.append(torch.cat([f, _chroma_residual(ct, ci, theta)[:, None]], dim=1))
            stack = torch.stack(scored)  # (T, B, F)
            best = stack[:, :, 1].argmax(dim=0)
            out[s : s + len(ta)] = stack[best, torch.arange(len(ta))].numpy()
            if progress is not None:
                progress.update(len(ta))
    return out
