"""Pair alignment: one thumbnail warped onto the other by an affine map and a gain/offset, fitted by
inverse-compositional Lucas-Kanade (coarse to fine; once the coarse fit has settled, the worst-fitting TRIM
of the pixels take no part in a step, so an overlay does not pull the map), batched over pairs with torch. A
crop, resize, small rotation or brightness/contrast change is an affine map of the pixels and their values,
so after the fit a copy correlates with its original almost perfectly; two different pictures do not,
however the fit bends.

Features per pair (the better of both directions, and of the mirror with flips):
  ncc      normalised cross-correlation over the template pixels that land inside the other picture
  robust   the same with the worst-fitting 15 % of those pixels left out (an overlay, a caption)
  coverage share of the template that lands inside the other picture
  stretch  |log area ratio| + |log aspect ratio| of the fitted map (how much it had to bend)
  chroma   share of the template's colour (opponent chroma of the small colour thumbnails, warped by the
           same map) that the other's, at its best gain, does not explain, over all but the worst TRIM of
           the cells (an overlay's colour): a saturation change keeps it near 0, a recoloured look-alike (the
           same icon in red and in blue) does not
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

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


def _norm_rows(v: torch.Tensor) -> torch.Tensor:
    v = v - v.mean(1, keepdim=True)
    return v * torch.rsqrt((v * v).mean(1, keepdim=True) + 1e-6)


def _fit(
    t: torch.Tensor, i: torch.Tensor, theta: torch.Tensor, iters: int, trim: bool = False, trim_from: int = 0
) -> torch.Tensor:
    """Inverse-compositional Lucas-Kanade: the template's Jacobian and Hessian once, then per step
    only the warped image (standardised: the gain and offset drop out) and a 6 x P product."""
    side = t.shape[-1]
    b = t.shape[0]
    pts = _grid(side, t.device)
    x, y = pts[:, 0], pts[:, 1]
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
    tv = _norm_rows(t.flatten(1))
    full = torch.zeros(b, 3, 3)
    full[:, 2, 2] = 1.0
    full[:, :2] = theta
    eye = torch.eye(3)
    keep = max(1, int(round(tv.shape[1] * (1 - TRIM))))
    for step in range(iters):
        e = _norm_rows(_warp(i, full[:, :2])) - tv
        if (
            trim and step >= trim_from
        ):  # the worst-fitting TRIM of the pixels take no part in the step: an overlay does not pull
            cut = torch.maximum(
                e.abs().kthvalue(keep, dim=1, keepdim=True).values,
                3 * e.abs().median(dim=1, keepdim=True).values,
            )
            e = torch.where(e.abs() <= cut, e, torch.zeros_like(e))
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


def _score(t: torch.Tensor, i: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    side = t.shape[-1] // 2
    pts = _grid(side, t.device)
    v = F.avg_pool2d(_warp(i, theta).reshape(i.shape), 2).flatten(1)
    m = _inside(theta, pts)
    tv = F.avg_pool2d(t, 2).flatten(1)

    def ncc(w):
        n = w.sum(1).clamp(min=1.0)
        mt, mv = (w * tv).sum(1) / n, (w * v).sum(1) / n
        a, c = tv - mt[:, None], v - mv[:, None]
        cov = (w * a * c).sum(1)
        return cov / torch.sqrt((w * a * a).sum(1) * (w * c * c).sum(1) + 1e-9), a, c

    full, a, c = ncc(m)
    # robust: drop the worst-fitting TRIM of the inside pixels (residual after the least-squares gain)
    gain = (m * a * c).sum(1) / ((m * c * c).sum(1) + 1e-9)
    res = torch.where(m > 0, (a - gain[:, None] * c).abs(), torch.full_like(a, float("inf")))
    keep_n = (m.sum(1) * (1 - TRIM)).long().clamp(min=1)
    order = res.argsort(dim=1)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=t.device).expand_as(order))
    w2 = ((rank < keep_n[:, None]) & (m > 0)).float()
    robust, _, _ = ncc(w2)
    det = (theta[:, 0, 0] * theta[:, 1, 1] - theta[:, 0, 1] * theta[:, 1, 0]).abs().clamp(min=1e-3)
    sx = theta[:, :, 0].norm(dim=1).clamp(min=1e-3)
    sy = theta[:, :, 1].norm(dim=1).clamp(min=1e-3)
    stretch = det.log().abs() + (sx / sy).log().abs()
    return torch.stack([full, robust, m.mean(1), stretch], dim=1)


def _one_way(t: torch.Tensor, i: torch.Tensor, iters: tuple[int, int]) -> torch.Tensor:
    """Fit on 2x-pooled thumbnails (coarse: 4x), score on the full ones warped, then pooled: the pooled
    reading of a warped sharp thumbnail is what a resize would make, not bilinear blur."""
    b = t.shape[0]
    theta = torch.zeros(b, 2, 3, device=t.device)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    t2, i2 = _blur(F.avg_pool2d(t, 2)), _blur(F.avg_pool2d(i, 2))
    theta = _fit(
        _blur(F.avg_pool2d(t2, 2)),
        _blur(F.avg_pool2d(i2, 2)),
        theta,
        iters[0],
        trim=True,
        trim_from=iters[0] // 2,
    )
    theta = _fit(t2, i2, theta, iters[1], trim=True)
    return _score(t, i, theta), theta


def _chroma_residual(ca: torch.Tensor, cb: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """ca, cb (B,2,s,s) chroma; cb warped onto ca by theta; ||ca - g cb||^2 / (||ca||^2 + floor), g fitted,
    over the cells but the worst-fitting TRIM of them (an overlay's colour is not the picture's)."""
    w = torch.cat([_warp(cb[:, c : c + 1], theta) for c in range(cb.shape[1])], dim=1)
    a = ca.flatten(1)
    g = ((a * w).sum(1) / ((w * w).sum(1) + 1e-6)).clamp(0.5, 2.0)
    cells = ((a - g[:, None] * w) ** 2).reshape(len(a), ca.shape[1], -1).sum(1)  # (B, s*s)
    keep = max(1, int(round(cells.shape[1] * (1 - TRIM))))
    res = cells.topk(keep, dim=1, largest=False).values.sum(1)
    return res / ((1 - TRIM) * ((a * a).sum(1) + CHROMA_FLOOR**2 * a.shape[1]))


def pair_features(
    thumbs: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    *,
    colours: np.ndarray,
    iters=(16, 8),
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
                f, theta = _one_way(t, i, iters)
                scored.append(torch.cat([f, _chroma_residual(ct, ci, theta)[:, None]], dim=1))
            stack = torch.stack(scored)  # (T, B, F)
            best = stack[:, :, 1].argmax(dim=0)
            out[s : s + len(ta)] = stack[best, torch.arange(len(ta))].numpy()
            if progress is not None:
                progress.update(len(ta))
    return out
