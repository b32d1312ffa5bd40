"""A copy detector trained on the collection itself (`--verifier encoder` / `both`), SSCD-style.

In a paragraph: a small open_clip ViT tower is trained on this collection's own items, each item its own
class (the `instance` generator's task): two views of an item, each edited as a copy is -- crop of <= 20 %
of the area, rotation of <= 5 degrees, brightness / contrast / colour 0.8-1.2, a blur for re-encoding and
resizing, a caption bar or badge -- are positives under InfoNCE, every other item of the batch is a
negative, and a KoLeo term spreads the embeddings (Pizzi et al. 2022). The collection's own variants (a
tinted icon, a sibling texture) are thus negatives the tower learns to tell from an edit. Each item's
nearest items by the tower's cosine are its candidates; a softmax over them with a "none" option,
logits `scale * cosine` against a `none` logit, reads off how likely each is its copy. `scale` and `none` are
fitted without labels on held-apart synthetic copies (edits.py, the real edits: JPEG, resize, crop,
rotation, colour, overlay, format), each a query twice: with its original among the candidates (the answer
is the original) and without it (the answer is "none"); the share of items that have a copy, which sets
`none`, is then re-estimated on the collection by EM (Saerens et al. 2002).

Its limit (docs/results.md, "Near-duplicates: a trained copy detector"): a copy already stored in the
collection is an item like any other, so training also separates it from its original; the longer the tower
trains, the more copies it misses. Hence an option beside the alignment, not the default.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

# the edits as the tower's augmentation (training.augment.AugmentConfig's fields): crops of <= 20 % of
# the area (aspect within e^+-0.2), +-5 degrees, 0.8-1.2 photometric, a blur standing in for JPEG and
# resizing, an overlay; configs/copy.toml trains on the same
COPY_EDITS = dict(
    crop_scale=(0.8, 1.0),
    crop_ratio=(math.exp(-0.2), math.exp(0.2)),
    flip_p=0.0,
    translate=0.02,
    brightness=0.2,
    contrast=0.2,
    saturation=0.2,
    blur_p=0.3,
    rotate=5.0,
    overlay_p=0.3,
)


def copy_augment():
    """COPY_EDITS as an AugmentConfig (imported here: a server that imports this module loads no trainer
    parts)."""
    from training.augment import AugmentConfig

    return AugmentConfig(**COPY_EDITS)


def to_tensor(rgb: np.ndarray) -> torch.Tensor:
    """(n, S, S, 3) uint8 -> (n, 3, S, S) float on the project's normalised scale ((x - 0.5) / 0.5)."""
    from training.transforms import MEAN, STD

    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(0, 3, 1, 2).float() / 255.0
    return (x - MEAN) / STD


def build_tower(config):
    """The small ViT of `config` (DedupConfig's copy_* block), randomly initialised."""
    from training.encoder import Encoder, EncoderConfig

    torch.manual_seed(config.seed)
    return Encoder(
        EncoderConfig(
            width=config.copy_width,
            layers=config.copy_layers,
            heads=4,
            patch_size=config.copy_patch,
            image_size=config.copy_side,
            embed_dim=config.copy_dim,
        )
    )


def train_copy_encoder(rgb: np.ndarray, config, progress: bool = False):
    """Train the tower on (n, S, S, 3) uint8 pictures (S = config.copy_source), each its own class, for
    config.copy_steps steps of InfoNCE (temperature copy_temperature) plus copy_koleo x KoLeo on each view's
    batch; AdamW, cosine learning rate. Returns (encoder in eval mode, last loss)."""
    from tqdm.auto import tqdm

    from training.augment import random_augment
    from training.losses import InfoNCELoss
    from training.regularizers import koleo

    rng = np.random.default_rng(config.seed)
    encoder = build_tower(config)
    encoder.train()
    opt = torch.optim.AdamW(encoder.parameters(), lr=config.copy_lr, weight_decay=0.05)
    steps = config.copy_steps
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda t: min(1.0, (t + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps)),
    )
    loss_fn = InfoNCELoss()
    augment = copy_augment()
    n = len(rgb)
    batch = min(config.copy_batch, n)
    order, at = rng.permutation(n), 0
    last = float("nan")
    for _ in tqdm(range(steps), desc="training the copy encoder", disable=not progress, mininterval=1.0):
        if at + batch > n:
            order, at = rng.permutation(n), 0
        idx = order[at : at + batch]
        at += batch
        x = to_tensor(rgb[idx])
        za = encoder(random_augment(x, rng, augment, out_size=config.copy_side))
        zb = encoder(random_augment(x, rng, augment, out_size=config.copy_side))
        loss = loss_fn(za, zb, config.copy_temperature).loss
        if config.copy_koleo > 0:
            loss = loss + config.copy_koleo * 0.5 * (koleo(za) + koleo(zb))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        last = float(loss.detach())
    encoder.eval()
    return encoder, last


@torch.no_grad()
def embed_rgb(encoder, rgb: np.ndarray, side: int, batch: int = 512) -> np.ndarray:
    """(n, D) float32 unit embeddings of (n, S, S, 3) uint8 pictures, shrunk to `side` as training's views
    are (2 x 2 block means at S = 2 side)."""
    from training.transforms import resize_center_crop

    out = [
        encoder(resize_center_crop(to_tensor(rgb[s : s + batch]), side)).numpy()
        for s in range(0, len(rgb), batch)
    ]
    return (
        np.concatenate(out).astype(np.float32) if out else np.zeros((0, encoder.config.embed_dim), np.float32)
    )


def none_softmax(sims: np.ndarray, scale: float, none: float) -> np.ndarray:
    """(m, K + 1) probabilities of a softmax over each row's K candidates (logits scale * cosine; -inf or NaN
    cosines are no candidate) and a last "none" column (logit `none`)."""
    s = np.asarray(sims, np.float64)
    logits = np.where(np.isfinite(s), scale * np.nan_to_num(s, nan=0.0, neginf=0.0), -np.inf)
    logits = np.concatenate([logits, np.full((len(s), 1), float(none))], axis=1)
    top = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - top)
    return e / e.sum(axis=1, keepdims=True)


def fit_none_softmax(pos: np.ndarray, target: np.ndarray, neg: np.ndarray) -> tuple[float, float]:
    """(scale, none) maximising the likelihood of `pos` rows (m, K) answering their `target` column and of
    `neg` rows (m', K) answering "none"; scale > 0."""
    from scipy.optimize import minimize

    pos = np.asarray(pos, np.float64)
    neg = np.asarray(neg, np.float64)
    target = np.asarray(target, np.int64)

    def nll(theta):
        scale, none = math.exp(theta[0]), theta[1]
        lp = np.log(np.maximum(none_softmax(pos, scale, none)[np.arange(len(pos)), target], 1e-300))
        ln = np.log(np.maximum(none_softmax(neg, scale, none)[:, -1], 1e-300))
        return -(lp.sum() + ln.sum()) / (len(pos) + len(neg))

    best = min(
        (
            minimize(nll, np.array([math.log(s0), s0 * 0.8]), method="Nelder-Mead")
            for s0 in (10.0, 30.0, 80.0)
        ),
        key=lambda r: r.fun,
    )
    return float(math.exp(best.x[0])), float(best.x[1])


def shift_prior(none: float, prior_from: float, prior_to: float) -> float:
    """The none logit after the share of queries that have a copy changes from prior_from to prior_to
    (Bayes: every candidate's odds against "none" scale by (prior_to / (1 - prior_to)) / (prior_from /
    (1 - prior_from)))."""
    odds = lambda p: math.log(p / (1.0 - p))  # noqa: E731
    return float(none - odds(prior_to) + odds(prior_from))


def em_prior(sims: np.ndarray, scale: float, none: float, prior0: float, iters: int = 100) -> float:
    """The share of queries (rows of `sims`) that have a copy among their candidates, by EM on the
    posteriors of the softmax fitted at prior0 (Saerens, Latinne and Decaestecker 2002); clipped to
    [1e-3, 0.999]."""
    pi = prior0
    for _ in range(iters):
        p = none_softmax(sims, scale, shift_prior(none, prior0, pi))
        new = float(np.clip(1.0 - p[:, -1].mean(), 1e-3, 0.999))
        if abs(new - pi) < 1e-6:
            return new
        pi = new
    return pi


@dataclass
class CopyModel:
    """The fitted readout: `scale`, the none logit at the collection's estimated share `prior` of items
    that have a copy (`none`), and what the held-apart copies measured."""

    scale: float
    none: float
    prior: float
    k: int
    copy_top1: float  # share of held-apart copies whose original is their nearest item
    train_loss: float
    seconds: dict
    copy_recall: float = float("nan")  # held-apart copies at p >= the threshold, their original a candidate
    encoder: object = None  # the trained tower (not serialised)

    def pair_probability(self, z, a, b, rows, cos, readout: str = "softmax") -> np.ndarray:
        """Probability that each pair (a, b) is one picture edited. "softmax": the larger of a's softmax
        answering b and b's answering a, each over the row's k candidates (`rows`, `cos`, from `neighbours`)
        with b (or a) added when it is not among them, and "none"; "pair": the softmax over that one
        candidate and "none", sigmoid(scale * cos - none)."""
        s = np.einsum("ij,ij->i", z[a], z[b]).astype(np.float64)
        if readout == "pair":
            return 1.0 / (1.0 + np.exp(-(self.scale * s - self.none)))
        out = np.zeros(len(a))
        for q, c in ((a, b), (b, a)):
            logits = np.where(np.isfinite(cos[q]), self.scale * np.nan_to_num(cos[q], neginf=0.0), -np.inf)
            missing = ~(rows[q] == c[:, None]).any(axis=1)
            extra = np.where(missing, self.scale * s, -np.inf)
            all_ = np.concatenate([logits, extra[:, None], np.full((len(q), 1), self.none)], axis=1)
            top = all_.max(axis=1)
            lse = top + np.log(np.exp(all_ - top[:, None]).sum(axis=1))
            out = np.maximum(out, np.exp(self.scale * s - lse))
        return out

    def to_json(self) -> dict:
        return {
            "scale": self.scale,
            "none": self.none,
            "prior": self.prior,
            "k": self.k,
            "copy_top1": self.copy_top1,
            "copy_recall": self.copy_recall,
            "train_loss": self.train_loss,
        }


def neighbours(z: np.ndarray, k: int, ok: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows (n, k), cosines (n, k)) of each row's k nearest other `ok` rows (exact inner product; -1 / -inf
    where there are fewer)."""
    import faiss

    n = len(z)
    ok = np.ones(n, bool) if ok is None else ok
    good = np.flatnonzero(ok)
    rows = np.full((n, k), -1, np.int64)
    cos = np.full((n, k), -np.inf, np.float32)
    if good.size < 2:
        return rows, cos
    index = faiss.IndexFlatIP(z.shape[1])
    index.add(np.ascontiguousarray(z[good]))
    kk = min(k + 1, good.size)
    d, f = index.search(np.ascontiguousarray(z[good]), kk)
    for qi, r in enumerate(good):
        keep = [(good[j], s) for j, s in zip(f[qi], d[qi]) if j >= 0 and good[j] != r][:k]
        for c, (j, s) in enumerate(keep):
            rows[r, c], cos[r, c] = j, s
    return rows, cos


def fit_copy_model(z: np.ndarray, zc: np.ndarray, originals: np.ndarray, ok: np.ndarray, k: int):
    """(scale, none at the 1/2 prior of the fit, top-1 share, the rows with the original first) from
    held-apart copies' embeddings `zc` of `originals` rows against the collection `z` (`ok` rows): each
    copy is a query with its original among its k candidates (answer: the original) and one without it
    (answer: none)."""
    zz = np.where(ok[:, None], z, 0.0)
    s = zc @ zz.T  # (m, n)
    s[:, ~ok] = -np.inf
    m = len(zc)
    pos, tgt, neg, top1 = [], [], [], 0
    for q in range(m):
        o = int(originals[q])
        row = s[q].copy()
        own = row[o]
        row[o] = -np.inf
        order = np.argsort(-row)[:k]
        others = row[order]
        top1 += int(own > others[0])
        neg.append(others)
        # with the original: the original and the k - 1 best others
        pos.append(np.r_[own, others[: k - 1]])
        tgt.append(0)
    scale, none = fit_none_softmax(np.asarray(pos), np.asarray(tgt), np.asarray(neg))
    return scale, none, top1 / max(m, 1), np.asarray(pos)


def train_and_embed(rgb: np.ndarray, ok: np.ndarray, config, progress: bool = False):
    """(encoder, last loss, (n, copy_dim) embeddings, zero on rows not `ok`, seconds): the tower trained on
    the `ok` rows of `rgb`, then each of them embedded."""
    t0 = time.perf_counter()
    encoder, loss = train_copy_encoder(rgb[ok], config, progress)
    z = np.zeros((len(rgb), config.copy_dim), np.float32)
    z[ok] = embed_rgb(encoder, rgb[ok], config.copy_side)
    return encoder, loss, z, time.perf_counter() - t0


def held_apart_copies(read, sample: np.ndarray, config) -> list:
    """[(row, copy_source-pixel colour thumbnail)] of one edited copy (edits.py) of each `sample` row,
    decoded again through `read` (never seen in training)."""
    from PIL import Image

    from search.duplicates.descriptors import thumbnail
    from search.duplicates.edits import edited_copy
    from training.images import load_rgb

    rng = np.random.default_rng(config.seed + 1)
    out = []
    for r in sample:
        try:
            im = Image.fromarray(load_rgb(read(int(r)), min_side=320))
            im.thumbnail((320, 320))
            data, _ = edited_copy(im, rng)
            out.append((int(r), thumbnail(data, 4, colour_side=config.copy_source)[1]))
        except (OSError, ValueError, KeyError) as err:
            logger.warning("no held-apart copy of row %d: %s", r, err)
    return out


def fit_readout(encoder, z: np.ndarray, copies: list, ok: np.ndarray, config, loss: float, seconds: dict):
    """The CopyModel of a trained tower: (scale, none) fitted on the held-apart `copies` (fit_copy_model),
    the share of items with a copy by EM over every `ok` row's candidates, none moved to that share."""
    rows = np.array([r for r, _ in copies], np.int64)
    zc = embed_rgb(encoder, np.stack([c for _, c in copies]), config.copy_side)
    scale, none, top1, pos = fit_copy_model(z, zc, rows, ok, config.copy_k)
    _, cos = neighbours(z, config.copy_k, ok)
    prior = em_prior(cos[ok], scale, none, 0.5)
    none = shift_prior(none, 0.5, prior)
    recall = float((none_softmax(pos, scale, none)[:, 0] >= config.threshold).mean())
    return CopyModel(scale, none, prior, config.copy_k, top1, loss, seconds, recall, encoder)


def copy_candidates(z: np.ndarray, ok: np.ndarray, model: CopyModel, config, table):
    """(a, b, p): each `ok` row's copy_k nearest by the tower (`table`, from `neighbours`), as unique pairs
    a < b, and their probabilities."""
    rows, cos = table
    a = np.repeat(np.arange(len(z)), rows.shape[1])
    b = rows.reshape(-1)
    keep = (b >= 0) & ok[a]
    pr = np.unique(np.sort(np.column_stack([a[keep], b[keep]]), axis=1), axis=0)
    a, b = pr[:, 0], pr[:, 1]
    return a, b, model.pair_probability(z, a, b, rows, cos, config.copy_readout)
