"""`softsearch train` with a `[text]` table: image and text towers trained together, CLIP style.

One step: a batch of N images whose captions are all different (so no caption is a false negative
of another), their captions tokenised, both towers embedded, and the symmetric CLIP objective

    L = 1/2N [ sum_i loss(row i of S) + sum_i loss(row i of S^T) ],   S = z_image z_text^T  (N, N),

where each row's positive is the diagonal entry and `loss` is any registered contrastive loss
(InfoNCE, WEINCE; the temperature schedule gives annealed InfoNCE), applied to the (2N, N) stack
of image->text and text->image rows with no self column to mask.

Captions: the synthetic dataset's binned latent words (training/captions.py, template drawn per
item and step, exact ideal), or a folder's `captions.jsonl` / sidecar `.txt` files (items without
a caption are not trained on). The checkpoint holds both towers (training/checkpoint.py).

`[text]` keys: the `TextConfig` fields (width, layers, heads, context_length, mlp_ratio) plus
`bins` (synthetic caption bins, default [8, 6, 8]), `image_checkpoint` (start the image tower from a
trained checkpoint) and `lock_image` (keep that tower fixed and train the text tower alone against
its embeddings, computed once: locked-image tuning, "LiT", Zhai et al. 2022). One process;
`--resume` is not supported.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from training.captions import TEMPLATES, CaptionScheme, read_captions
from training.checkpoint import config_hash, load_checkpoint, save_checkpoint
from training.config import TrainConfig
from training.encoder import create_encoder
from training.losses import LossOutput, create_loss
from training.text import TextEncoder, text_config_from_dict

logger = logging.getLogger(__name__)

__all__ = ["train_text", "TEXT_RUN_KEYS", "CaptionData", "caption_data", "clip_step", "unique_caption_batch"]

#: `[text]` keys that are not TextConfig fields
TEXT_RUN_KEYS = ("bins", "image_checkpoint", "lock_image")
_TEXT_TAG = 0x7E47


class CaptionData:
    """The captions of a dataset's items: `texts(indices, rng)` and `keys` (equal key = equal caption)."""

    def __init__(
        self,
        items: np.ndarray,
        keys: np.ndarray,
        describe: dict,
        scheme: CaptionScheme | None = None,
        fixed: list[str] | None = None,
    ):
        self.items, self.keys, self.describe, self.scheme, self.fixed = items, keys, describe, scheme, fixed

    def texts(self, dataset, indices: np.ndarray, rng: np.random.Generator) -> list[str]:
        if self.scheme is not None:  # synthetic: the cell's words in a randomly drawn template
            templates = rng.integers(0, len(TEMPLATES), size=len(indices))
            return self.scheme.captions(dataset.latents[indices], templates)
        return [self.fixed[int(i)] for i in indices]


def caption_data(dataset, options: dict) -> CaptionData:
    """Captions for training on `dataset`: synthetic binned words, or the folder's stored captions."""
    if getattr(dataset, "latents", None) is not None and dataset.name == "synthetic":
        scheme = CaptionScheme(tuple(options.get("bins", CaptionScheme().bins)))
        cells = scheme.cells(dataset.latents)
        return CaptionData(
            np.arange(len(dataset)),
            cells,
            {"captions": "synthetic", "bins": list(scheme.bins), "exact": True},
            scheme=scheme,
        )
    if "bins" in options:
        raise ValueError("text.bins applies to the synthetic dataset only")
    root = getattr(dataset, "root", None)
    if not root:
        raise ValueError(
            f"dataset {dataset.name!r} has no captions: use the synthetic dataset or a folder with "
            "captions.jsonl or sidecar .txt files"
        )
    ids = dataset.item_ids()
    caps = read_captions(root, ids)
    items = np.flatnonzero([c is not None for c in caps])
    if items.size < 2:
        raise ValueError(
            f"{root}: {items.size} captioned image(s); image-text training needs captions.jsonl "
            '({"file", "text"} per line) or sidecar NAME.txt files for at least 2 images'
        )
    _, keys = np.unique(
        np.array([caps[i] or "" for i in range(len(caps))], dtype=object).astype(str), return_inverse=True
    )
    logger.info(
        "%s: %d of %d images have captions (%d distinct)",
        root,
        items.size,
        len(ids),
        np.unique(keys[items]).size,
    )
    return CaptionData(
        items, keys, {"captions": "files", "captioned": int(items.size), "exact": False}, fixed=caps
    )


def unique_caption_batch(data: CaptionData, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `batch_size` random captioned items whose captions are all different (fewer when the data
    has fewer distinct captions)."""
    perm = data.items[rng.permutation(data.items.size)]
    _, first = np.unique(data.keys[perm], return_index=True)
    return perm[np.sort(first)][:batch_size]


def clip_step(
    encoder,
    text: TextEncoder,
    loss_fn,
    images: torch.Tensor | None,
    tokens: torch.Tensor,
    temperature,
    image_embeddings: torch.Tensor | None = None,
) -> LossOutput:
    """Symmetric CLIP loss of N (image, caption) pairs: image->text and text->image rows together.
    `image_embeddings` (N, D) stand in for `encoder(images)` when the image tower is locked."""
    zi = encoder(images) if image_embeddings is None else image_embeddings  # (N, D)
    zt = text(tokens)  # (N, D)
    sim = zi @ zt.T  # (N, N) s(image i, caption j)
    n = sim.shape[0]
    rows = torch.cat([sim, sim.T])  # (2N, N): image anchors, then caption anchors
    pos = torch.arange(n, device=sim.device).repeat(2)
    out = loss_fn.loss_from_similarities(rows, pos, None, temperature)
    return out


def train_text(config: TrainConfig, info, resume: bool = False) -> Path:
    """Train image and text towers per `config` (its `text` table set); returns the checkpoint path."""
    from training.schedules import create_schedule
    from training.trainer import (
        CHECKPOINT_NAME,
        CONFIG_NAME,
        METRICS_NAME,
        STATE_NAME,
        build_data,
        lr_at,
        optimizer_groups,
        seed_everything,
        to_float,
    )

    if resume:
        raise ValueError(
            "--resume is not supported for image-text training (a [text] table); start a fresh run"
        )
    if info.enabled:
        raise ValueError("image-text training runs in one process; start it without torchrun")
    options = dict(config.text)
    text_config = text_config_from_dict({k: v for k, v in options.items() if k not in TEXT_RUN_KEYS})
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / STATE_NAME).unlink(missing_ok=True)
    (out / METRICS_NAME).write_text("")
    (out / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    seed_everything(config.seed)
    dataset, _ = build_data(config)
    data = caption_data(dataset, options)
    device = info.device
    if options.get("image_checkpoint"):
        encoder, meta = load_checkpoint(options["image_checkpoint"], device=device)
        if encoder.image_size != config.encoder.image_size:
            raise ValueError(
                f"text.image_checkpoint {options['image_checkpoint']} takes {encoder.image_size}px images, "
                f"encoder.image_size is {config.encoder.image_size}"
            )
        encoder.train()
    else:
        if options.get("lock_image"):
            raise ValueError(
                "text.lock_image needs text.image_checkpoint (a trained image tower to keep fixed)"
            )
        encoder = create_encoder(config.encoder).to(device)
    locked = None
    if options.get("lock_image"):  # LiT: the image tower stays as trained; its embeddings are computed once
        from training.encoder import embed

        encoder.eval().requires_grad_(False)
        locked = torch.from_numpy(embed(encoder, dataset.tensors(np.arange(len(dataset))), progress=False))
    text = TextEncoder(text_config, encoder.embed_dim).to(device)
    schedule = create_schedule(config.schedule, **config.schedule_options).to(device)
    loss_fn = create_loss(config.loss, **config.loss_options).to(device)
    both = torch.nn.ModuleDict({"image": encoder, "text": text})
    optimizer = torch.optim.AdamW(optimizer_groups(both, schedule, config.weight_decay), lr=config.lr)
    describe = getattr(schedule, "describe", None)
    lineage = {
        "objective": f"clip-symmetric {config.loss}",
        "objective_options": config.loss_options,
        "temperature_schedule": config.schedule,
        "temperature_schedule_options": describe() if describe else config.schedule_options,
        "noise_schedule": None,
        "train_config_hash": config_hash(config.lineage_dict()),
        "dataset": dataset.spec(),
        "dataset_fingerprint": dataset.fingerprint(),
        "generator": {
            "name": dataset.default_generator().name,
            "options": dataset.default_generator().options(),
            "exact": bool(dataset.default_generator().exact),
        },
        "text": {
            **data.describe,
            "tower": asdict(text.config),
            **(
                {"image_checkpoint": str(options["image_checkpoint"])}
                if options.get("image_checkpoint")
                else {}
            ),
            "image_tower": "locked (LiT)" if locked is not None else "trained",
        },
        "world_size": 1,
    }
    stop = config.steps if config.stop_after is None else min(config.steps, config.stop_after)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    last: dict = {}
    both.train()
    if locked is not None:
        encoder.eval()
    bar = tqdm(
        range(stop),
        total=config.steps,
        desc="train image+text",
        disable=not config.progress,
        dynamic_ncols=True,
    )
    with (out / METRICS_NAME).open("a") as metrics_file:
        for step in bar:
            t0 = time.perf_counter()
            rng = np.random.default_rng([config.seed, _TEXT_TAG, step])
            idx = unique_caption_batch(data, config.batch_size, rng)
            images = dataset.tensors(idx).to(device) if locked is None else None
            tokens = text.tokenize(data.texts(dataset, idx, rng)).to(device)
            tau = schedule.temperature(step)
            result = clip_step(
                encoder,
                text,
                loss_fn,
                images,
                tokens,
                tau,
                None if locked is None else locked[idx].to(device),
            )
            if not torch.isfinite(result.loss):
                raise FloatingPointError(f"loss became {float(result.loss)} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            if config.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            dt = time.perf_counter() - t0
            last = {
                "step": step,
                "loss": float(result.loss.detach()),
                "temperature": to_float(tau),
                "lr": lr,
                "pairs": int(len(idx)),
                "pairs_per_s": len(idx) / dt,
                **result.stats,
            }
            metrics_file.write(json.dumps(last) + "\n")
            if step % config.log_every == 0:
                metrics_file.flush()
                bar.set_postfix(loss=f"{last['loss']:.4f}", tau=f"{last['temperature']:.3g}")
            if (
                step + 1
            ) % config.checkpoint_every == 0 and step + 1 < stop:  # weights so far (no resume state)
                save_checkpoint(
                    out / CHECKPOINT_NAME,
                    encoder,
                    step=step + 1,
                    train_config=config.to_dict(),
                    lineage=lineage,
                    metrics=last,
                    text_encoder=text,
                )
    bar.close()
    path = save_checkpoint(
        out / CHECKPOINT_NAME,
        encoder,
        step=stop,
        train_config=config.to_dict(),
        lineage=lineage,
        metrics=last,
        text_encoder=text,
    )
    logger.info(
        "trained image and text towers to step %d; final loss %s; checkpoint %s", stop, last.get("loss"), path
    )
    return path
