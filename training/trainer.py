"""`softsearch train`: contrastive training of the encoder, single process or DDP under torchrun.

One step: draw the global batch of N pairs (a deterministic function of seed and step), embed
this rank's 2n views, gather all 2N embeddings, compute the loss of the local anchors against
every candidate, AdamW with warmup + cosine learning rate, optional Langevin noise.

Determinism: batch indices come from a per-epoch permutation seeded by (seed, epoch); the
positives of pair chunk c (`sample_chunk` pairs each) use an RNG seeded by (seed, step, c).
So the data of a step never depends on the world size or on how the run was resumed, and rank
r's half of a 2-process batch is exactly the matching half of the single-process batch.

Output directory: `init.safetensors` (step-0 weights), `checkpoint.safetensors`,
`train_state.safetensors` (optimizer, schedule and RNG state for `--resume`), `metrics.jsonl`
(one JSON line per step), `config.json`, and `skipped.json` when a folder dataset skipped files
(each with its reason; one log line counts them).
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from training.checkpoint import (
    config_hash,
    load_train_state,
    read_checkpoint_metadata,
    save_checkpoint,
    save_train_state,
)
from training.config import TrainConfig, config_from_dict, load_train_config
from training.distributed import (
    DistInfo,
    all_reduce_mean,
    average_gradients,
    barrier,
    distributed_session,
    gather_detached,
    gather_embeddings,
    torchrun_env,
)
from training.encoder import Encoder, create_encoder
from training.losses import ContrastiveLoss, LossOutput, contrastive_similarities, create_loss
from training.regularizers import gaussian_regularizer, koleo, vanishing_weight
from training.train_args import build_parser

logger = logging.getLogger(__name__)

__all__ = [
    "TrainConfig",
    "load_train_config",
    "train",
    "main",
    "lr_at",
    "batch_indices",
    "sample_views",
    "contrastive_step",
]

CHECKPOINT_NAME = "checkpoint.safetensors"
INIT_NAME = "init.safetensors"
STATE_NAME = "train_state.safetensors"
METRICS_NAME = "metrics.jsonl"
CONFIG_NAME = "config.json"
SKIPPED_NAME = "skipped.json"

_DATA_TAG = 0x5EED  # separates the data RNG streams from other uses of the seed
_NOISE_TAG = 0x1A6E


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to lr over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step.

    warmup: lr (step + 1) / warmup_steps; after: lr [r + (1 - r)(1 + cos(pi p)) / 2],
    p = (step - warmup) / max(1, steps - warmup - 1) in [0, 1], r = min_lr_ratio.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps - 1))
    r = config.min_lr_ratio
    return config.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress)))


class _EpochSampler:
    """Global batch indices for a step: consecutive slices of a per-epoch random permutation."""

    def __init__(self, n_items: int, batch_size: int, seed: int):
        if n_items < batch_size:
            raise ValueError(f"batch_size={batch_size} exceeds the dataset size {n_items}")
        self.n_items, self.batch_size, self.seed = n_items, batch_size, seed
        self.steps_per_epoch = n_items // batch_size  # the last partial batch of an epoch is dropped
        self._cache: tuple[int, np.ndarray] | None = None
        self._lock = threading.Lock()  # prefetch threads share the cache

    def __call__(self, step: int) -> np.ndarray:
        epoch, pos = divmod(step, self.steps_per_epoch)
        with self._lock:
            if self._cache is None or self._cache[0] != epoch:
                perm = np.random.default_rng([self.seed, _DATA_TAG, epoch]).permutation(self.n_items)
                self._cache = (epoch, perm)
            perm = self._cache[1]
        return perm[pos * self.batch_size : (pos + 1) * self.batch_size]  # (N,)


def batch_indices(step: int, n_items: int, batch_size: int, seed: int) -> np.ndarray:
    """The (N,) dataset indices of the global batch at `step` (no repeats within an epoch)."""
    return _EpochSampler(n_items, batch_size, seed)(step)


def sample_views(
    generator, dataset, indices: np.ndarray, *, seed: int, step: int, offset: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (n, 3, S, S) x 2 for global batch positions [offset, offset + n).

    Pair chunk c (positions [c chunk, (c + 1) chunk)) draws its positives from an RNG seeded by
    (seed, step, c), so any split of the batch into chunk-aligned parts gives identical views.
    """
    if offset % chunk:
        raise ValueError(f"batch offset {offset} is not a multiple of sample_chunk={chunk}")
    parts_a, parts_b = [], []
    for start in range(0, len(indices), chunk):
        rng = np.random.default_rng([seed, _DATA_TAG, step, (offset + start) // chunk])
        a, b = generator.sample_pairs(dataset, indices[start : start + chunk], rng)
        parts_a.append(a)
        parts_b.append(b)
    return torch.cat(parts_a), torch.cat(parts_b)


def _tower_only(model: nn.Module, sees_anchor: bool = False) -> dict:
    """`anchored=False` for an encoder with a pixel anchor (the loss sees the tower alone) unless
    `sees_anchor`, else nothing: any module mapping images to unit rows can still be trained."""
    has = getattr(getattr(model, "module", model), "has_anchor", False)
    return {"anchored": False} if has and not sees_anchor else {}


def contrastive_step(
    model: nn.Module,
    loss_fn: ContrastiveLoss,
    view_a: torch.Tensor,
    view_b: torch.Tensor,
    temperature: float | torch.Tensor,
    info: DistInfo,
    reg_weight: float = 0.0,
    sees_anchor: bool = False,
    koleo_weight: float = 0.0,
) -> LossOutput:
    """Forward pass + loss for this rank's n pairs (the full batch when single-process).

    The loss averages over the 2n local anchors; with DDP's gradient averaging this gives the
    single-process gradient of the global batch (derivation in training/distributed.py).
    `reg_weight` > 0 adds alpha_t * (E|h|^2 - log det Cov h) on this rank's pre-normalisation
    features (training/regularizers.py); under DDP that is the mean of per-rank regularisers.
    """
    n = view_a.shape[0]
    images = torch.cat([view_a, view_b])
    tower = _tower_only(model, sees_anchor)  # (2n, D): the tower, or the served embedding
    if reg_weight > 0:
        z_local, h_local = model(images, return_features=True, **tower)  # (2n, D) each
    else:
        z_local = model(images, **tower)  # (2n, D) = cat(view_a_local, view_b_local): the tower
    z_all = gather_embeddings(z_local, info)  # (2N, D) = cat(view_a_global, view_b_global)
    sim, pos_index, self_index = contrastive_similarities(z_local, z_all, info.rank * n)  # (2n, 2N)
    out = loss_fn.loss_from_similarities(
        sim, pos_index, self_index, temperature, gather=partial(gather_detached, info=info)
    )
    if reg_weight > 0:
        reg = gaussian_regularizer(h_local)
        out = LossOutput(
            out.loss + reg_weight * reg.to(out.loss.dtype),
            {**out.stats, "gaussian_reg": float(reg.detach()), "gaussian_reg_weight": reg_weight},
        )
    if koleo_weight > 0:  # on this rank's rows of each view
        spread = 0.5 * (koleo(z_local[:n]) + koleo(z_local[n:]))
        out = LossOutput(out.loss + koleo_weight * spread, {**out.stats, "koleo": float(spread.detach())})
    return out


@dataclass
class _Run:
    """Everything the loop needs, built once by `_setup`."""

    config: TrainConfig
    info: DistInfo
    out: Path
    dataset: object
    generator: object
    encoder: Encoder
    model: nn.Module  # encoder or DDP(encoder)
    loss_fn: ContrastiveLoss
    schedule: nn.Module
    noise: object | None
    noise_gen: torch.Generator | None
    optimizer: torch.optim.Optimizer
    sampler: _EpochSampler
    lineage: dict


#: `generator = "auto"`: the label generator when the dataset has classes, else the pixel-neighbour one.
AUTO_GENERATOR = "auto"


def build_data(config: TrainConfig):
    from training.datasets import create_dataset, dataset_is_file_backed
    from training.generators import create_generator

    options = dict(config.dataset_options)
    if config.kappa is not None and config.dataset == "synthetic":
        options.setdefault("kappa", config.kappa)
    options.setdefault("image_size", config.encoder.image_size)
    if options["image_size"] != config.encoder.image_size:
        raise ValueError(
            f"dataset_options.image_size={options['image_size']} differs from "
            f"encoder.image_size={config.encoder.image_size}"
        )
    if dataset_is_file_backed({"name": config.dataset}):  # runtime options, not part of the spec
        options.update(
            cache_dir=config.cache_dir, cache_workers=config.cache_workers, progress=config.progress
        )
    dataset = create_dataset(
        config.dataset,
        split=config.split,
        root=config.data_root,
        size=config.dataset_size,
        seed=config.dataset_seed,
        **options,
    )
    if config.generator is None and not config.generator_options:
        generator = dataset.default_generator()
    else:
        name = config.generator or dataset.default_generator().name
        gen_options = dict(config.generator_options)
        if name == AUTO_GENERATOR:
            # Class folders, when present, are the positives (the held-out test/ split keeps the evaluation
            # honest); otherwise an image and one of its nearest grey-pixel neighbours, with these options.
            name, gen_options = ("label", {}) if dataset.labels is not None else ("neighbour", gen_options)
            logger.info(
                "generator auto -> %s (%s)", name, "class folders found" if name == "label" else "no classes"
            )
        if name == "latent" and config.kappa is not None:
            gen_options.setdefault("kappa", config.kappa)
        generator = create_generator(name, **gen_options)
    return dataset, generator


def _report_skipped(dataset, out: Path, info: DistInfo) -> None:
    """One log line for the files a file-backed dataset skipped; rank 0 lists them in out/skipped.json."""
    skipped = getattr(dataset, "skipped", None) or []
    path = out / SKIPPED_NAME
    if info.is_main:
        path.unlink(missing_ok=True)
    if not skipped:
        return
    from training.image_cache import summarise_skipped

    if info.is_main:
        path.write_text(json.dumps(skipped, indent=1) + "\n")
        logger.warning(
            "training on %d images of %s/%s; %d file(s) skipped (%s), listed in %s",
            len(dataset),
            dataset.name,
            dataset.split,
            len(skipped),
            summarise_skipped(skipped),
            path,
        )


def optimizer_groups(encoder: Encoder, schedule: nn.Module, weight_decay: float) -> list[dict]:
    # Decay matrices only; biases, norms, class/position embeddings and the temperature are not decayed.
    decay = [p for p in encoder.parameters() if p.ndim >= 2 and p.requires_grad]
    no_decay = [p for p in encoder.parameters() if p.ndim < 2 and p.requires_grad]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    sched_params = [p for p in schedule.parameters() if p.requires_grad]
    if sched_params:
        groups.append({"params": sched_params, "weight_decay": 0.0})
    return groups


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _setup(config: TrainConfig, info: DistInfo, out: Path) -> _Run:
    from training.schedules import create_schedule

    seed_everything(config.seed)
    dataset, generator = build_data(config)
    if config.anchor_with_classes and generator.name == "label":  # "auto" found class folders
        config = replace(config, encoder=replace(config.encoder, **config.anchor_with_classes))
        logger.info("class folders: anchor weights %s", config.anchor_with_classes)
    _report_skipped(dataset, out, info)
    if config.batch_size % info.world_size:
        raise ValueError(
            f"batch_size={config.batch_size} must be divisible by the world size {info.world_size}"
        )
    local = config.batch_size // info.world_size
    if info.enabled and local % config.sample_chunk:
        raise ValueError(
            f"per-rank batch {local} must be a multiple of sample_chunk={config.sample_chunk} "
            "so every rank draws the same positives as a single process would"
        )
    encoder = create_encoder(config.encoder).to(info.device)
    if encoder.has_anchor:  # the anchor's centres: the training images' means
        n = len(dataset)
        encoder.set_pixel_mean(
            dataset.tensors(np.arange(s, min(s + 1024, n))).to(info.device) for s in range(0, n, 1024)
        )
    schedule = create_schedule(config.schedule, **config.schedule_options).to(info.device)
    loss_fn = create_loss(config.loss, **config.loss_options).to(info.device)
    noise = noise_gen = None
    if config.noise_schedule is not None:
        from training.langevin import LangevinNoise

        # Same noise seed on every rank: the parameters must stay identical across replicas.
        noise_gen = torch.Generator(device=info.device).manual_seed(config.seed + _NOISE_TAG)
        # A floor ends annealing, so decaying noise schedules (log, exp) default to none: T_t -> 0.
        noise_options = (
            {"tau_min": 0.0} if config.noise_schedule in ("log", "exp") else {}
        ) | config.noise_options
        noise = LangevinNoise(create_schedule(config.noise_schedule, **noise_options), generator=noise_gen)
    optimizer = torch.optim.AdamW(optimizer_groups(encoder, schedule, config.weight_decay), lr=config.lr)
    model: nn.Module = encoder
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            encoder, device_ids=[info.device] if info.device.type == "cuda" else None
        )
    describe = getattr(schedule, "describe", None)
    lineage = {
        "objective": config.loss,
        "objective_options": config.loss_options,
        "temperature_schedule": config.schedule,
        "temperature_schedule_options": describe() if describe else config.schedule_options,
        "noise_schedule": config.noise_schedule,
        "noise_options": config.noise_options,
        "train_config_hash": config_hash(config.lineage_dict()),
        "dataset": dataset.spec(),
        "dataset_fingerprint": dataset.fingerprint(),
        "generator": {"name": generator.name, "options": generator.options(), "exact": bool(generator.exact)},
        "world_size": info.world_size,
    }
    sampler = _EpochSampler(len(dataset), config.batch_size, config.seed)
    return _Run(
        config,
        info,
        out,
        dataset,
        generator,
        encoder,
        model,
        loss_fn,
        schedule,
        noise,
        noise_gen,
        optimizer,
        sampler,
        lineage,
    )


def _rng_snapshot(run: _Run) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and run.info.device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(run.info.device)
    if run.noise_gen is not None:
        tensors["langevin"] = run.noise_gen.get_state()
    np_state = np.random.get_state()
    py_state = random.getstate()
    extra = {
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    return tensors, extra


def _rng_restore(run: _Run, rng: dict[str, torch.Tensor], extra: dict) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and run.info.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], run.info.device)
    if run.noise_gen is not None and "langevin" in rng:
        run.noise_gen.set_state(rng["langevin"].to(run.noise_gen.get_state().device))
    if "numpy" in extra:
        name, keys, pos, has_gauss, cached = extra["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "python" in extra:
        version, internal, gauss = extra["python"]
        random.setstate((version, tuple(internal), gauss))


def _save(
    run: _Run, step: int, metrics: dict, path_name: str = CHECKPOINT_NAME, with_state: bool = True
) -> Path:
    """Rank 0 writes the checkpoint (+ resume state); every rank waits at the barrier."""
    path = run.out / path_name
    if run.info.is_main:
        save_checkpoint(
            path,
            run.encoder,
            step=step,
            train_config=run.config.to_dict(),
            lineage=run.lineage,
            metrics=metrics,
        )
        if with_state:
            rng_tensors, rng_json = _rng_snapshot(run)
            save_train_state(
                run.out / STATE_NAME,
                step=step,
                optimizer=run.optimizer,
                schedule_state=run.schedule.state_dict(),
                loss_state=run.loss_fn.state_dict(),
                rng_tensors=rng_tensors,
                extra_json={
                    **rng_json,
                    "train_config_hash": run.lineage["train_config_hash"],
                    "checkpoint": path_name,
                },
            )
    barrier(run.info)
    return path


def _check_resume_config(config: TrainConfig, out: Path) -> None:
    """Refuse to resume a run whose weights-relevant config differs (steps may grow)."""
    path = out / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"cannot resume: {path} not found")
    old = config_from_dict(json.loads(path.read_text())).lineage_dict()
    new = config.lineage_dict()
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "steps")
    if diff:
        raise ValueError(f"cannot resume {out}: config differs from the saved run in {diff}")
    if old.get("steps") != new.get("steps"):
        logger.warning(
            "resuming with steps=%s (was %s): the cosine lr schedule changes", new["steps"], old["steps"]
        )


def _resume(run: _Run) -> int:
    """Load weights, optimizer, schedule and RNG state; returns the step to continue from."""
    _check_resume_config(run.config, run.out)
    state_path = run.out / STATE_NAME
    state = load_train_state(state_path)
    ckpt = run.out / state["extra"].get("checkpoint", CHECKPOINT_NAME)
    meta = read_checkpoint_metadata(ckpt)
    if meta["step"] != state["step"]:
        raise ValueError(f"{ckpt} is at step {meta['step']} but {state_path} at step {state['step']}")
    run.encoder.load_state_dict(load_file(str(ckpt), device=str(run.info.device)), strict=True)
    run.optimizer.load_state_dict(state["optimizer"])
    if state["schedule"]:
        run.schedule.load_state_dict({k: v.to(run.info.device) for k, v in state["schedule"].items()})
    if state["loss"]:
        run.loss_fn.load_state_dict({k: v.to(run.info.device) for k, v in state["loss"].items()})
    _rng_restore(run, state["rng"], state["extra"])
    # Drop metric lines from steps after the checkpoint (a crash can leave some behind).
    metrics_path = run.out / METRICS_NAME
    if run.info.is_main and metrics_path.is_file():
        keep = [
            line
            for line in metrics_path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < state["step"]
        ]
        metrics_path.write_text("".join(line + "\n" for line in keep))
    logger.info("resumed %s at step %d", run.out, state["step"])
    return int(state["step"])


class _Prefetcher:
    """Prepares the local views of upcoming steps on `workers` threads (0 -> inline)."""

    def __init__(self, fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]], workers: int, stop: int):
        self.fn, self.stop = fn, stop
        self.pool = ThreadPoolExecutor(workers) if workers > 0 else None
        self.ahead = max(1, 2 * workers)
        self.pending: dict[int, Future] = {}

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pool is None:
            return self.fn(step)
        for s in range(step, min(step + self.ahead, self.stop)):
            if s not in self.pending:
                self.pending[s] = self.pool.submit(self.fn, s)
        return self.pending.pop(step).result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def to_float(value) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def train(config: TrainConfig, resume: bool = False) -> Path:
    """Train per `config`; returns the final checkpoint path (out_dir/checkpoint.safetensors)."""
    config.validate()
    with distributed_session(config.device) as info:
        if config.text:  # a [text] table: image and text towers, CLIP objective
            from training.text_trainer import train_text

            return train_text(config, info, resume)
        return _train(config, info, resume)


def _train(config: TrainConfig, info: DistInfo, resume: bool) -> Path:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    out = Path(config.out_dir)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    barrier(info)
    run = _setup(config, info, out)
    start = 0
    if resume:
        if not (out / STATE_NAME).is_file():
            raise FileNotFoundError(f"cannot resume: {out / STATE_NAME} not found")
        start = _resume(run)
    else:
        if info.is_main:
            # A fresh run in an old directory: drop the old resume state so --resume cannot mix runs.
            (out / STATE_NAME).unlink(missing_ok=True)
            (out / METRICS_NAME).write_text("")
            (out / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
        _save(run, 0, {}, INIT_NAME, with_state=False)

    n_local = config.batch_size // info.world_size
    offset = info.rank * n_local

    def views(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = run.sampler(step)[offset : offset + n_local]  # this rank's pairs, (n,)
        return sample_views(
            run.generator,
            run.dataset,
            idx,
            seed=config.seed,
            step=step,
            offset=offset,
            chunk=config.sample_chunk,
        )

    stop = config.steps if config.stop_after is None else min(config.steps, config.stop_after)
    if start >= stop:
        logger.info("%s is already at step %d (>= %d); nothing to do", out, start, stop)
        return out / CHECKPOINT_NAME
    refresh = getattr(run.generator, "refresh", None)  # encoder-space neighbours follow the encoder
    if refresh is not None:
        refresh(run.encoder, run.dataset, start)
    prefetch = _Prefetcher(views, config.num_workers, stop)
    train_params = [p for group in run.optimizer.param_groups for p in group["params"]]
    encoder_params = [p for p in run.encoder.parameters() if p.requires_grad]
    metrics_file = (out / METRICS_NAME).open("a") if info.is_main else None
    last: dict = {}
    run.model.train()
    bar = tqdm(
        range(start, stop),
        initial=start,
        total=config.steps,
        desc="train",
        disable=not (config.progress and info.is_main),
        dynamic_ncols=True,
    )
    try:
        for step in bar:
            t0 = time.perf_counter()
            if refresh is not None and step > start:
                refresh(run.encoder, run.dataset, step)  # views already prefetched keep the old table
            view_a, view_b = prefetch.get(step)
            view_a = view_a.to(info.device, non_blocking=True)
            view_b = view_b.to(info.device, non_blocking=True)
            tau = run.schedule.temperature(step)
            reg_weight = (
                vanishing_weight(step, config.gaussian_reg, config.gaussian_reg_decay)
                if config.gaussian_reg > 0
                else 0.0
            )
            out_loss = contrastive_step(
                run.model,
                run.loss_fn,
                view_a,
                view_b,
                tau,
                info,
                reg_weight,
                config.loss_sees_anchor,
                config.koleo,
            )
            if not torch.isfinite(out_loss.loss):
                raise FloatingPointError(f"loss became {float(out_loss.loss)} at step {step}")
            run.optimizer.zero_grad(set_to_none=True)
            out_loss.loss.backward()
            average_gradients(run.schedule.parameters(), info)  # DDP averages only the encoder
            grad_norm = None
            if config.grad_clip is not None:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(train_params, config.grad_clip))
            lr = lr_at(step, config)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            run.optimizer.step()
            noise_t = run.noise.apply(encoder_params, lr, step) if run.noise is not None else None
            loss_value = float(all_reduce_mean(out_loss.loss, info))
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            dt = time.perf_counter() - t0
            last = {
                "step": step,
                "loss": loss_value,
                "temperature": to_float(tau),
                "lr": lr,
                "images_per_s": 2 * config.batch_size / dt,
                **out_loss.stats,
            }
            if noise_t is not None:
                last["noise_temperature"] = noise_t
            if grad_norm is not None:
                last["grad_norm"] = grad_norm
            if metrics_file is not None:
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
                if step % config.log_every == 0 or step == config.steps - 1:
                    bar.set_postfix(
                        loss=f"{loss_value:.4f}", tau=f"{last['temperature']:.3g}", lr=f"{lr:.2e}"
                    )
                    logger.debug(
                        "step %d loss %.4f tau %.4g lr %.3g", step, loss_value, last["temperature"], lr
                    )
            done = step + 1
            if done % config.checkpoint_every == 0 and done < stop:
                _save(run, done, last)
    finally:
        prefetch.close()
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    final = _save(run, max(stop, start), last)
    if info.is_main:
        logger.info(
            "trained to step %d of %d; final loss %s; checkpoint %s",
            max(stop, start),
            config.steps,
            last.get("loss"),
            final,
        )
    return final


def main(argv: list[str] | None = None) -> int:
    """CLI entry: `softsearch train --config C [--set k=v ...] [--resume] [--out DIR]`."""
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.out:
        overrides.append(f"out_dir={json.dumps(args.out)}")
    config = load_train_config(args.config, overrides)
    path = train(config, resume=args.resume)
    if torchrun_env()[0] == 0:
        print(path)
    return 0


if __name__ == "__main__":  # `python -m training.trainer ...` == `softsearch train ...`
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
