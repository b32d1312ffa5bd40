"""Do a collection's stored copies, as in-batch negatives, undo the copy encoder (docs/results.md,
"Near-duplicates: a trained copy detector")? The scan's tower is trained on a folder with planted copies
(bench/dedup.py's planting) with and without the true duplicate groups masked out of each other's
negatives (an oracle no scan has); reported: how often a stored copy's nearest item outside its group is
farther than its original, and the median cosines.

    .venv/bin/python bench/copy_negatives.py FOLDER STEPS MAX_ITEMS
"""

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import row, write_results
from dedup import plant, readable_sample

from search.duplicates.config import DedupConfig
from search.duplicates.copy_encoder import build_tower, copy_augment, embed_rgb, to_tensor
from search.duplicates.descriptors import thumbnails_digest_rgb
from training.augment import random_augment
from training.regularizers import koleo

torch.set_num_threads(1)
folder, steps, max_items = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
readable = readable_sample(folder, max_items, rng)
sources, edits, planted = plant(readable, 0.2, rng)
n = len(sources)
rgb = np.stack([thumbnails_digest_rgb(s, 64, rgb_side=32)[3] for s in sources])
group = np.arange(n)
for a, b in planted:  # union: copies of one original share its group
    group[b] = group[a]
cfg = DedupConfig(verifier="both")


def train(mask: bool):
    r = np.random.default_rng(cfg.seed)
    enc = build_tower(cfg)
    enc.train()
    opt = torch.optim.AdamW(enc.parameters(), lr=cfg.copy_lr, weight_decay=0.05)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: min(1.0, (t + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(t, steps) / steps))
    )
    aug = copy_augment()
    batch = min(cfg.copy_batch, n)
    order, at = r.permutation(n), 0
    for _ in range(steps):
        if at + batch > n:
            order, at = r.permutation(n), 0
        idx = order[at : at + batch]
        at += batch
        x = to_tensor(rgb[idx])
        za = enc(random_augment(x, r, aug, out_size=32))
        zb = enc(random_augment(x, r, aug, out_size=32))
        z = torch.cat([za, zb])
        logits = z @ z.T / cfg.copy_temperature
        g = torch.as_tensor(np.r_[group[idx], group[idx]])
        pos = torch.cat([torch.arange(batch) + batch, torch.arange(batch)])
        drop = torch.eye(2 * batch, dtype=torch.bool)
        if mask:  # other items of the same duplicate group are not negatives
            drop |= g[:, None] == g[None, :]
            drop[torch.arange(2 * batch), pos] = False
        logits = logits.masked_fill(drop, float("-inf"))
        loss = torch.nn.functional.cross_entropy(logits, pos) + cfg.copy_koleo * 0.5 * (koleo(za) + koleo(zb))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    enc.eval()
    return embed_rgb(enc, rgb, 32), float(loss)


rows = []
for mask in (False, True):
    t0 = time.time()
    z, loss = train(mask)
    s = z @ z.T
    np.fill_diagonal(s, -np.inf)
    top1, cos_true, cos_next = [], [], []
    for a, b in planted:
        sims = s[b].copy()
        own = sims[a]
        sims[group == group[b]] = -np.inf  # the nearest item outside the copy's group
        top1.append(own > sims.max())
        cos_true.append(own)
        cos_next.append(sims.max())
    how = "duplicates masked from the negatives" if mask else "plain (every other item a negative)"
    rows += [
        row(
            f"{how}: stored copies whose original is nearer than any other item",
            float(np.mean(top1)),
            "ratio",
            None,
        ),
        row(f"{how}: median cosine, stored copy to its original", float(np.median(cos_true)), "cos", None),
        row(
            f"{how}: median cosine, stored copy to its nearest other item",
            float(np.median(cos_next)),
            "cos",
            None,
        ),
        row(f"{how}: final loss", loss, "nats", None),
        row(f"{how}: seconds", time.time() - t0, "s", None),
    ]
write_results(f"copy_negatives_{Path(folder).name}_{steps}", rows)
