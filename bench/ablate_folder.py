"""Ablation of the folder recipe: label precision@10 on held-out queries, trained vs raw pixels.

Each run: a class-folder collection split into train/ + test/ (a seeded 20 % of every class held
out, symlinks), laid out twice: with the class folders and flat (the same files, no subfolders, so
training cannot read the classes). One config of the grid is trained on one layout with
``training.trainer.train`` (configs/folder.toml plus the grid's changes), then the train images are
embedded (the index) and the held-out test images searched exactly; label precision@10 is compared,
paired over queries, with the 32x32 grey centred-cosine pixel search and with the step-0 tower.
Both are the tower alone; the pixel anchor (encoder.pixel_weight) is scored from the same checkpoint at a
few weights (anchored-w columns), since training does not depend on it.

Resumable: each run writes bench/results/ablate_folder/<run>.json when it finishes and is skipped
when that file exists, so the script can be killed and restarted (run it under nohup with a log).
``--summary`` prints the table of finished runs and writes bench/results/ablate_folder.json.

    python bench/ablate_folder.py --collections stamps,oxygen --configs neighbour,instance --seeds 0
    python bench/ablate_folder.py --summary
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import row, write_results  # noqa: E402

CONFIG = REPO / "configs" / "folder.toml"
OUT = REPO / "bench" / "results" / "ablate_folder"
WORK = Path(os.environ.get("ABLATE_WORK", "/tmp/softsearch-ablate"))
THREADS = int(os.environ.get("ABLATE_THREADS", "1"))  # one thread per run: run two workers side by side
IMAGE_EXT = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"}

# collection name -> (root of class folders, glob of a class folder's files, minimum class size)
COLLECTIONS = {
    "stamps": ("/usr/share/tuxpaint/stamps", "**/*", 10),  # Tux Paint clip art, 16 categories
    "oxygen": ("/usr/share/icons/oxygen/base/64x64", "*", 10),  # Oxygen icons by context folder
    "wesnoth": (
        "/usr/share/games/wesnoth/1.16/data/core/images/units",
        "**/*",
        10,
    ),  # unit sprites by faction
    # MATE 48x48 icons by context folder: real files, identical files once (a folder of symlinks that
    # bench/ablate_folder.py's caller builds; see docs/results.md, "Quality without labels, round three")
    "mate": (os.environ.get("ABLATE_MATE", "/tmp/softsearch-ablate/mate-src"), "*", 15),
    # elementary-xfce 48 px icons by context folder, built the same way (docs/results.md, round four)
    "elementary": (os.environ.get("ABLATE_ELEMENTARY", "/tmp/softsearch-ablate/elementary-src"), "*", 15),
}

# config name -> (layout, changes to configs/folder.toml). "flat": no class folders; "classes": with them.
# Keys with a dot set inside a table (generator_options.crop_scale); None deletes the key.
PIXELS = {"generator_options.space": None, "generator_options.refresh_every": None}  # pixel neighbours
INSTANCE = {"generator_options.k": None, **PIXELS}  # no neighbours at all
SIMCLR_AUGMENT = {  # SimCLR-style views: strong crops, colour, grey, blur, rotation
    "generator_options.crop_scale": [0.3, 1.0],
    "generator_options.brightness": 0.4,
    "generator_options.contrast": 0.4,
    "generator_options.saturation": 0.4,
    "generator_options.grey_p": 0.2,
    "generator_options.blur_p": 0.3,
    "generator_options.rotate": 10.0,
}
CONFIGS: dict[str, tuple[str, dict]] = {
    "shipped": ("flat", {}),
    "shipped-classes": ("classes", {}),
    "neighbour": ("flat", {"generator": "neighbour", **PIXELS}),
    "instance": ("flat", {"generator": "instance", **INSTANCE}),
    "instance-crop02": (
        "flat",
        {"generator": "instance", **INSTANCE, "generator_options.crop_scale": [0.2, 1.0]},
    ),
    "instance-strong": (
        "flat",
        {
            "generator": "instance",
            **INSTANCE,
            "generator_options.crop_scale": [0.2, 1.0],
            "generator_options.brightness": 0.4,
            "generator_options.contrast": 0.4,
        },
    ),
    "neighbour-k1": ("flat", {"generator": "neighbour", **PIXELS, "generator_options.k": 1}),
    "neighbour-k20": ("flat", {"generator": "neighbour", **PIXELS, "generator_options.k": 20}),
    "instance-tau01": ("flat", {"generator": "instance", **INSTANCE, "schedule_options.tau": 0.1}),
    "instance-tau05": ("flat", {"generator": "instance", **INSTANCE, "schedule_options.tau": 0.5}),
    "instance-64px": ("flat", {"generator": "instance", **INSTANCE, "encoder.image_size": 64}),
    "instance-vit": (
        "flat",
        {
            "generator": "instance",
            **INSTANCE,
            "encoder.layers": 4,
            "encoder.width": 64,
            "encoder.patch_size": 4,
        },
    ),
    "instance-wide": ("flat", {"generator": "instance", **INSTANCE, "encoder.width": 64}),
    "instance-200steps": ("flat", {"generator": "instance", **INSTANCE, "steps": 200, "warmup_steps": 20}),
    "instance-800steps": ("flat", {"generator": "instance", **INSTANCE, "steps": 800, "warmup_steps": 80}),
    "encnb": (
        "flat",
        {
            "generator": "neighbour",
            "generator_options.space": "encoder",
            "generator_options.refresh_every": 50,
        },
    ),
    "neighbour-mild": (
        "flat",
        {
            "generator": "neighbour",
            **PIXELS,
            "generator_options.crop_scale": [0.8, 1.0],
            "generator_options.translate": 0.05,
        },
    ),
    "encnb-mild": (
        "flat",
        {
            "generator": "neighbour",
            "generator_options.space": "encoder",
            "generator_options.refresh_every": 50,
            "generator_options.crop_scale": [0.8, 1.0],
            "generator_options.translate": 0.05,
        },
    ),
    # round four: the tower at the icons' own size, views that keep the layout
    "encnb-64px-mild": (
        "flat",
        {
            "generator": "neighbour",
            "generator_options.space": "encoder",
            "generator_options.refresh_every": 50,
            "generator_options.crop_scale": [0.8, 1.0],
            "generator_options.translate": 0.05,
            "encoder.image_size": 64,
        },
    ),
    "bothnb": (
        "flat",
        {"generator": "neighbour", "generator_options.space": "both", "generator_options.refresh_every": 50},
    ),
    "encnb0": ("flat", {"generator": "neighbour", "generator_options.space": "encoder"}),
    "simclr": (
        "flat",
        {
            "generator": "instance",
            **INSTANCE,
            **SIMCLR_AUGMENT,
        },
    ),
    "encnb-simclr": (
        "flat",
        {
            "generator": "neighbour",
            "generator_options.space": "encoder",
            "generator_options.refresh_every": 50,
            **SIMCLR_AUGMENT,
        },
    ),
    "label": ("classes", {"generator": "auto"}),
    # the loss sees the anchored (served) embedding: the tower learns what the grey pixels miss
    "encnb-aloss": (
        "flat",
        {
            "generator": "neighbour",
            "generator_options.space": "encoder",
            "generator_options.refresh_every": 50,
            "encoder.pixel_weight": 0.5,
            "loss_sees_anchor": True,
        },
    ),
    # ... and the neighbours come from the anchored embedding as it trains (pixel neighbours at step 0)
    "servednb-aloss": (
        "flat",
        {
            "generator": "neighbour",
            "generator_options.space": "served",
            "generator_options.refresh_every": 50,
            "encoder.pixel_weight": 0.5,
            "loss_sees_anchor": True,
        },
    ),
    "label-aloss": ("classes", {"generator": "auto", "encoder.pixel_weight": 0.5, "loss_sees_anchor": True}),
    "label-simclr": (  # the label generator with the SimCLR-style augmentations (no neighbour options)
        "classes",
        {
            "generator": "label",
            "generator_options.k": None,
            **PIXELS,
            **SIMCLR_AUGMENT,
        },
    ),
    "label-64px": ("classes", {"generator": "auto", "encoder.image_size": 64}),
    "label-tau01": ("classes", {"generator": "auto", "schedule_options.tau": 0.1}),
}


SCREEN = {"steps": 150, "batch_size": 64, "warmup_steps": 15}


def _set(data: dict, key: str, value) -> None:
    *path, last = key.split(".")
    for part in path:
        data = data.setdefault(part, {})
    if value is None:
        data.pop(last, None)
    else:
        data[last] = value


def split_collection(name: str, seed: int) -> tuple[Path, Path]:
    """(classes root, flat root) of a seeded train/test split of a collection: symlinks under WORK."""
    src, pattern, min_size = COLLECTIONS[name]
    base = WORK / "splits" / f"{name}-s{seed}"
    classes, flat = base / "classes", base / "flat"
    if (base / "done").exists():
        return classes, flat
    rng = random.Random(seed)
    for cdir in sorted(p for p in Path(src).iterdir() if p.is_dir()):
        files = sorted(p for p in cdir.glob(pattern) if p.suffix.lower() in IMAGE_EXT and p.is_file())
        if len(files) < min_size:
            continue
        rng.shuffle(files)
        n_test = max(1, round(0.2 * len(files)))
        for i, f in enumerate(files):
            split = "test" if i < n_test else "train"
            name_ = f.relative_to(cdir).as_posix().replace("/", "__")
            for link in (classes / split / cdir.name / name_, flat / split / f"{cdir.name}__{name_}"):
                link.parent.mkdir(parents=True, exist_ok=True)
                if not link.exists():
                    link.symlink_to(f.resolve())
    (base / "done").write_text("")
    return classes, flat


def _embed(encoder, ds, batch: int = 256, anchored: bool = True) -> np.ndarray:
    import torch

    out = []
    with torch.inference_mode():
        for start in range(0, len(ds), batch):
            x = ds.tensors(np.arange(start, min(start + batch, len(ds))))
            out.append((encoder(x) if anchored else encoder.tower_embed(x)).float().numpy())
    return np.concatenate(out)


ANCHOR_WEIGHTS = (0.3, 0.5, 0.7)  # pixel anchor weights scored after the fact from the tower's embeddings


def anchored(z: np.ndarray, pixels: np.ndarray, w: float) -> np.ndarray:
    """[sqrt(1 - w) z, sqrt(w) p] of unit rows: the encoder's pixel anchor (training/encoder.py), whose
    cosine is (1 - w) tower cosine + w pixel cosine; the pixels centred on the indexed images' mean."""
    return np.hstack([np.sqrt(1 - w) * z, np.sqrt(w) * pixels]).astype(np.float32)


def evaluate(ckpts: dict[str, Path], classes_root: Path, image_size: int, cache_dir: Path) -> dict:
    """Label precision@10/@1 of each checkpoint and of raw pixels on the held-out test/ queries."""
    from search.evaluation.baselines import (
        centred_unit,
        paired_difference,
        per_query_precision,
        raw_pixel_features,
    )
    from training.checkpoint import load_checkpoint
    from training.datasets import create_dataset

    kw = dict(root=str(classes_root), image_size=image_size, cache_dir=str(cache_dir), progress=False)
    db, q = create_dataset("folder", "train", **kw), create_dataset("folder", "test", **kw)
    db_img = db.tensors(np.arange(len(db)))
    q_img = q.tensors(np.arange(len(q)))
    pdb, pq = centred_unit(raw_pixel_features(db_img), raw_pixel_features(q_img))
    per = {"pixels": {k: per_query_precision(pq, pdb, q.labels, db.labels, k) for k in (10, 1)}}
    for name, path in ckpts.items():
        enc, _ = load_checkpoint(path)
        enc.eval()
        zdb, zq = _embed(enc, db), _embed(enc, q)
        per[name] = {k: per_query_precision(zq, zdb, q.labels, db.labels, k) for k in (10, 1)}
        if name == "trained":  # the same tower with a pixel anchor of weight w, scored without retraining
            tdb, tq = _embed(enc, db, anchored=False), _embed(enc, q, anchored=False)
            for w in ANCHOR_WEIGHTS:
                adb, aq = anchored(tdb, pdb, w), anchored(tq, pq, w)
                per[f"anchored-{w}"] = {
                    k: per_query_precision(aq, adb, q.labels, db.labels, k) for k in (10, 1)
                }
    res = {
        "n_db": len(db),
        "n_queries": len(q),
        "n_classes": int(len(set(db.labels.tolist()))),
        "precision": {n: {f"p@{k}": float(v[k].mean()) for k in v} for n, v in per.items()},
    }
    res["trained_vs_pixels"] = paired_difference(per["trained"][10], per["pixels"][10])
    res["trained_vs_init"] = paired_difference(per["trained"][10], per["init"][10])
    res["init_vs_pixels"] = paired_difference(per["init"][10], per["pixels"][10])
    for w in ANCHOR_WEIGHTS:
        res[f"anchored-{w}_vs_pixels"] = paired_difference(per[f"anchored-{w}"][10], per["pixels"][10])
    res["per_query_p10"] = {n: v[10].round(4).tolist() for n, v in per.items()}
    return res


def run_one(
    collection: str, config_name: str, seed: int, keep: bool = False, scale: dict | None = None, tag: str = ""
) -> Path | None:
    """Train, embed and score one run; `scale` (e.g. fewer steps for a screen) applies over the config,
    `tag` names that scale in the run's name."""
    from training.config import config_from_dict
    from training.trainer import train

    name = f"{collection}--{config_name}--s{seed}" + (f"--{tag}" if tag else "")
    out_json = OUT / f"{name}.json"
    if out_json.exists():
        return None
    layout, changes = CONFIGS[config_name]
    classes, flat = split_collection(collection, seed)
    data = tomllib.loads(CONFIG.read_text())
    # the tower alone ("trained", "init"): the anchor (grey pixels, colour) is scored after the fact
    # (anchored-w columns here, bench/ablate_colour.py for the colour part;
    # training does not depend on it, tests/training/test_trainer.py)
    tower_alone = {
        "encoder.pixel_weight": None,
        "encoder.colour_weight": None,
        "encoder.colour_bins": None,
        "encoder.gradient_weight": None,
        "anchor_with_classes": None,
    }
    for k, v in {**tower_alone, **changes, **(scale or {})}.items():
        _set(data, k, v)
    run_dir = WORK / "runs" / name
    cache_dir = WORK / "cache"
    data.update(
        data_root=str(classes if layout == "classes" else flat),
        out_dir=str(run_dir),
        seed=seed,
        progress=False,
        cache_dir=str(cache_dir),
        torch_threads=THREADS,
    )
    cfg = config_from_dict(data)
    t0, c0 = time.perf_counter(), time.process_time()
    train(cfg)
    train_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    res = evaluate(
        {"trained": run_dir / "checkpoint.safetensors", "init": run_dir / "init.safetensors"},
        classes,
        cfg.encoder.image_size,
        cache_dir,
    )
    info = json.loads((run_dir / "config.json").read_text())
    res.update(
        run=name,
        collection=collection,
        config=config_name,
        layout=layout,
        seed=seed,
        changes=changes,
        scale=scale or {},
        tag=tag,
        steps=cfg.steps,
        batch_size=cfg.batch_size,
        image_size=cfg.encoder.image_size,
        train_wall_s=train_s,
        train_cpu_s=cpu_s,
        load_avg=os.getloadavg()[0],
        generator=info.get("generator"),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = out_json.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.rename(out_json)
    if not keep:
        for f in ("train_state.safetensors",):
            (run_dir / f).unlink(missing_ok=True)
    p = res["precision"]
    print(
        f"{name}: pixels {p['pixels']['p@10']:.3f} init {p['init']['p@10']:.3f} "
        f"trained {p['trained']['p@10']:.3f} "
        f"(vs pixels {res['trained_vs_pixels']['mean']:+.3f} [{res['trained_vs_pixels']['low']:+.3f}, "
        f"{res['trained_vs_pixels']['high']:+.3f}]) {train_s:.0f} s wall, {cpu_s:.0f} s cpu",
        flush=True,
    )
    return out_json


TOWERS = {  # untrained towers: what the architecture's pooling alone buys over pixels
    "resnet-w32-32px": dict(image_size=32, embed_dim=128, width=32, layers=(1, 1, 1, 1), heads=4),
    "resnet-w64-32px": dict(image_size=32, embed_dim=128, width=64, layers=(1, 1, 1, 1), heads=4),
    "resnet-w32-64px": dict(image_size=64, embed_dim=128, width=32, layers=(1, 1, 1, 1), heads=4),
    "resnet-w32-d2-32px": dict(image_size=32, embed_dim=128, width=32, layers=(2, 2, 2, 2), heads=4),
    "vit-w64-d4-p4-32px": dict(image_size=32, embed_dim=128, width=64, layers=4, heads=4, patch_size=4),
    "vit-w64-d2-p8-64px": dict(image_size=64, embed_dim=128, width=64, layers=2, heads=4, patch_size=8),
}


def towers(collections: list[str], split_seed: int = 0, init_seeds=(0, 1)) -> int:
    """Untrained towers vs pixels on the seed-0 split (no training):
    bench/results/ablate_folder_towers.json."""
    import torch

    from training.checkpoint import save_checkpoint
    from training.encoder import EncoderConfig, create_encoder

    torch.set_num_threads(THREADS)
    rows = []
    for coll in collections:
        classes, _ = split_collection(coll, split_seed)
        for name, kw in TOWERS.items():
            for seed in init_seeds:
                torch.manual_seed(seed)
                path = WORK / "towers" / f"{name}-{seed}.safetensors"
                path.parent.mkdir(parents=True, exist_ok=True)
                save_checkpoint(
                    path, create_encoder(EncoderConfig(**kw)), step=0, train_config={}, lineage={}, metrics={}
                )
                r = evaluate({"trained": path, "init": path}, classes, kw["image_size"], WORK / "cache")
                d = r["trained_vs_pixels"]
                rows.append(
                    row(
                        f"{coll} {name} init seed {seed} p@10 (tower - pixels {d['mean']:+.3f} "
                        f"[{d['low']:+.3f}, {d['high']:+.3f}])",
                        r["precision"]["trained"]["p@10"],
                        "p@10",
                        r["precision"]["pixels"]["p@10"],
                    )
                )
    write_results("ablate_folder_towers", rows)
    return 0


def summary() -> int:
    """Table of finished runs (mean over seeds per collection x config) and the results JSON."""
    runs = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault(
            (r["collection"], r["config"] + (f" [{r['tag']}]" if r.get("tag") else "")), []
        ).append(r)
    rows = []
    for (coll, cfg), rs in sorted(groups.items()):
        tr = np.mean([r["precision"]["trained"]["p@10"] for r in rs])
        px = np.mean([r["precision"]["pixels"]["p@10"] for r in rs])
        ini = np.mean([r["precision"]["init"]["p@10"] for r in rs])
        d = [r["trained_vs_pixels"] for r in rs]
        ci = " ".join(
            f"s{r['seed']}:{x['mean']:+.3f}[{x['low']:+.3f},{x['high']:+.3f}]" for r, x in zip(rs, d)
        )
        print(
            f"{coll:8s} {cfg:18s} n={len(rs)} pixels {px:.3f} init {ini:.3f} trained {tr:.3f} "
            f"d {tr - px:+.3f}  {ci}  {np.mean([r['train_wall_s'] for r in rs]):.0f}s"
        )
        rows.append(
            row(f"{coll} {cfg} p@10 ({len(rs)} seeds; baseline pixels)", float(tr), "p@10", float(px))
        )
    if rows:
        write_results("ablate_folder", rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collections", default="stamps,oxygen")
    p.add_argument("--configs", default="neighbour,instance")
    p.add_argument("--seeds", default="0")
    p.add_argument("--summary", action="store_true")
    p.add_argument("--towers", action="store_true", help="untrained towers vs pixels only (no training)")
    p.add_argument(
        "--screen-steps",
        type=int,
        default=0,
        help="with --screen: this many steps instead of 150 (runs tagged 'screen<N>'), a longer budget",
    )
    p.add_argument("--keep", action="store_true", help="keep the resume state of each run")
    p.add_argument(
        "--screen",
        action="store_true",
        help="the cheap scale: 150 steps of batch 64 (runs tagged 'screen'), to rank configs",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.summary:
        return summary()
    if args.towers:
        return towers(args.collections.split(","))
    for seed in [int(s) for s in args.seeds.split(",")]:
        for cfg in args.configs.split(","):
            for coll in args.collections.split(","):
                if cfg not in CONFIGS or coll not in COLLECTIONS:
                    raise SystemExit(f"error: unknown config {cfg!r} or collection {coll!r}")
                scale, tag = (SCREEN, "screen") if args.screen else (None, "")
                if args.screen and args.screen_steps:
                    n = args.screen_steps
                    scale, tag = {**SCREEN, "steps": n, "warmup_steps": n // 10}, f"screen{n}"
                run_one(coll, cfg, seed, args.keep, scale, tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
