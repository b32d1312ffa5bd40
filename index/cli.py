"""`softsearch index build|rebuild|add|sync|delete|list|activate|rollback|verify|prune|gc|export|import`.

Exit codes: 0 done; 1 activation refused by the activation rule (quality gate, or the index's
recall@10 below --target-recall; `--force` overrides) or a corrupt version; 2 a user mistake (bad
value, missing file: one `error: ...` line); 3 the store's `current` moved but the server given to
`--notify` did not confirm it serves the new version; 4 the filesystem failed (disk full, I/O error,
permission, read-only: one `error: ...` line naming the path and, for a full disk, the free and the
needed space; what the command staged is removed and `current` is unchanged). `--notify URL --token T` POSTs
`{URL}/v1/admin/reload` after an activation, retrying on 429 / 5xx / connection errors
(Retry-After, else exponential backoff) for up to --notify-timeout seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from index.defaults import DEFAULT_MARGIN, KINDS
from index.disk import describe as describe_os_error
from index.manifest import GateRecord, IndexCorruptError, Manifest, RecallRecord
from index.models import parse_encoder_spec, save_pretrained_checkpoint
from training.cli_parser import CommandParser

if TYPE_CHECKING:
    from index.store import IndexStore
# FAISS- and torch-backed modules (index.store, index.gate, index.build, index.embed, index.sync,
# index.transfer) are imported once the arguments are parsed, so `softsearch index ... --help` and a
# mistyped flag load neither FAISS nor torch.

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "runs/index"
DEFAULT_NOTIFY_TIMEOUT_S = 30.0
#: Exit code when the server given to --notify did not confirm the new version.
NOTIFY_FAILED = 3
#: Exit code when the filesystem failed under a command (disk full, I/O error, permission, read-only).
STORAGE_FAILED = 4
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'512M', '8G', '1000000' -> bytes."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise ValueError(f"bad memory size {text!r}; use e.g. 512M or 8G") from None
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def parse_params(items: list[str]) -> dict:
    """['nlist=256', 'M=16'] -> {'nlist': 256, 'M': 16} (integers only: every FAISS knob here is one)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --param {item!r}; expected KEY=VALUE")
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"bad --param {item!r}; the value must be an integer") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="softsearch index", description="Build and manage versioned search indexes.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument(
            "--root", default=DEFAULT_ROOT, help=f"index store directory (default {DEFAULT_ROOT})"
        )
        sp.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")

    def notify(sp):
        sp.add_argument(
            "--notify",
            metavar="URL",
            help="server base URL to POST /v1/admin/reload after activation; exit 3 unless the server "
            "then reports the new version",
        )
        sp.add_argument("--token", default=None, help="the server's admin bearer token for --notify")
        sp.add_argument(
            "--notify-timeout",
            type=float,
            default=DEFAULT_NOTIFY_TIMEOUT_S,
            metavar="S",
            help="retry 429 / 5xx / connection errors for up to S seconds "
            f"(default {DEFAULT_NOTIFY_TIMEOUT_S:g})",
        )

    def dataset(sp, required: bool):
        sp.add_argument("--dataset", required=required, help="synthetic | fashion-mnist | folder")
        sp.add_argument("--split", default="train")
        sp.add_argument(
            "--data-root", default=None, help="dataset directory (fashion-mnist IDX files, image folder)"
        )
        sp.add_argument("--size", type=int, default=None, help="keep the first N items")
        sp.add_argument("--seed", type=int, default=0)

    def activation(sp, tuned: bool = True):
        if tuned:
            sp.add_argument(
                "--target-recall",
                type=float,
                default=0.95,
                help="recall@10 against exact search that the index must reach (the search knob is "
                "tuned to it; below it the version is not activated, exit 1)",
            )
        sp.add_argument(
            "--keep", type=int, default=None, help="retain only the newest N versions (never current)"
        )
        sp.add_argument(
            "--force",
            action="store_true",
            help="activate even if the activation rule refuses (recorded as forced in history.json)",
        )
        sp.add_argument(
            "--margin",
            type=float,
            default=DEFAULT_MARGIN,
            help=f"quality-gate tolerance in score units (default {DEFAULT_MARGIN})",
        )
        sp.add_argument("--no-activate", action="store_true", help="commit the version without activating it")

    def embedding(sp):
        sp.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
        sp.add_argument("--num-workers", type=int, default=0, help="DataLoader decode workers (default 0)")
        sp.add_argument(
            "--shard-size",
            type=int,
            default=8192,
            help="items per resumable embedding shard (default 8192); under torchrun shard s is "
            "embedded by rank s %% WORLD_SIZE",
        )
        sp.add_argument("--device", default=None, help="torch device (default: cuda if available)")
        sp.add_argument(
            "--metadata",
            default=None,
            metavar="FILE",
            help='per-item user fields to filter on: JSON Lines ({"id": ..., "field": value} per line) '
            "or CSV with an 'id' column; stored in the version beside the built-in fields",
        )
        activation(sp)
        sp.add_argument("--no-progress", action="store_true", help="hide progress bars")

    def kind(sp, default):
        sp.add_argument(
            "--kind",
            default=default,
            choices=[*KINDS, "auto"],
            help="index kind (auto: choose from count, dim and --memory-budget)",
        )
        sp.add_argument(
            "--param",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="index parameter, e.g. nlist=256, nprobe=16, m=16, M=32, efSearch=64",
        )
        sp.add_argument(
            "--memory-budget", default=None, help="bytes for --kind auto, e.g. 2G (default: RAM / 4)"
        )

    sp = sub.add_parser("build", help="embed a dataset (or take your own vectors) and build a new version")
    common(sp)
    notify(sp)
    dataset(sp, False)
    embedding(sp)
    kind(sp, "flat")
    sp.add_argument(
        "--embeddings",
        default=None,
        metavar="FILE",
        help="index vectors computed elsewhere instead of a dataset: a .npy (N, D) float16/32/64 file or a "
        "directory of .npy shards (name order); rows are normalised to unit length; the version has "
        "no encoder (vector search only)",
    )
    sp.add_argument(
        "--ids",
        default=None,
        metavar="FILE",
        help="with --embeddings: one item id per line, one per row (default: the row number)",
    )
    sp.add_argument("--checkpoint", default=None, help="a softsearch checkpoint (from 'softsearch train')")
    sp.add_argument(
        "--encoder",
        default=None,
        metavar="open_clip:NAME",
        help="index with a named open_clip model and --pretrained weights instead of a checkpoint",
    )
    sp.add_argument(
        "--pretrained",
        default=None,
        metavar="FILE",
        help="local open_clip weights for --encoder (.safetensors, .bin, .pt; never downloaded)",
    )
    sp.add_argument(
        "--image-size", type=int, default=None, help="--encoder input size (default: the model's own)"
    )
    sp.add_argument(
        "--image-mean",
        default=None,
        metavar="R,G,B",
        help="--encoder input mean (default: the model's own preprocessing)",
    )
    sp.add_argument(
        "--image-std", default=None, metavar="R,G,B", help="--encoder input std (default: the model's own)"
    )
    sp.add_argument(
        "--search-temperature",
        type=float,
        default=None,
        help="calibrated softmax temperature to record (default: the training temperature)",
    )
    sp.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="N",
        help="split the items into N shards, each with its own FAISS index, embeddings and metadata, "
        "in one version (served by fanning out: `serve`, or `serve --engine ray`)",
    )
    sp.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="ray: with --shards N, each shard embedded (Ray Data over an actor pool) and built as a Ray "
        "task on a Ray cluster (extra [ray]; every node reads the store at the same path)",
    )
    sp.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="with --engine ray: the cluster to join (e.g. auto, HEAD:6379; default: start a local Ray)",
    )
    sp.add_argument(
        "--ray-actors",
        type=int,
        default=1,
        metavar="N",
        help="with --engine ray: embedding actors per shard (default 1)",
    )
    sp.add_argument(
        "--ray-actor-cpus",
        type=float,
        default=1.0,
        metavar="C",
        help="with --engine ray: CPUs each embedding actor reserves (default 1)",
    )

    sp = sub.add_parser("rebuild", help="re-embed the current version's corpus with a new checkpoint")
    common(sp)
    notify(sp)
    embedding(sp)
    kind(sp, None)
    sp.add_argument("--checkpoint", required=True)
    sp.add_argument("--search-temperature", type=float, default=None)

    sp = sub.add_parser("add", help="append new items to a new version without re-embedding old ones")
    common(sp)
    notify(sp)
    dataset(sp, False)
    embedding(sp)
    sp.add_argument(
        "--folder", default=None, help="shortcut for --dataset folder --split all --data-root DIR"
    )
    sp.add_argument("--checkpoint", default=None, help="defaults to the base version's checkpoint")
    sp.add_argument("--base", default=None, help="version to extend (default: current)")
    sp.add_argument(
        "--embeddings",
        default=None,
        metavar="FILE",
        help="append your own vectors (.npy or a directory of .npy shards) to a version built from "
        "vectors (index build --embeddings)",
    )
    sp.add_argument(
        "--ids",
        default=None,
        metavar="FILE",
        help="with --embeddings: one id per new row (default: the row numbers continue)",
    )

    sp = sub.add_parser(
        "sync", help="new version equal to an image folder's current files (only changes re-embedded)"
    )
    common(sp)
    notify(sp)
    embedding(sp)
    sp.add_argument(
        "--data-root", default=None, help="the folder (default: the one the base version was built from)"
    )
    sp.add_argument("--base", default=None, help="version to start from (default: current)")

    sp = sub.add_parser("delete", help="new version without the items listed in a file (one id per line)")
    common(sp)
    notify(sp)
    sp.add_argument("--ids-file", required=True, help="text file with one item id per line")
    sp.add_argument("--base", default=None, help="version to delete from (default: current)")
    sp.add_argument("--ignore-missing", action="store_true", help="skip ids that are not in the version")
    activation(sp)

    sp = sub.add_parser("list", help="list versions")
    common(sp)
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")

    force_help = (
        "activate even if the activation rule refuses (failed quality gate or recall below target); "
        "recorded as forced in history.json"
    )
    sp = sub.add_parser(
        "activate", help="make a version current (through the activation rule; exit 1 if refused)"
    )
    common(sp)
    notify(sp)
    sp.add_argument("version")
    sp.add_argument("--force", action="store_true", help=force_help)

    sp = sub.add_parser(
        "rollback", help="re-activate the previously active version (through the activation rule)"
    )
    common(sp)
    notify(sp)
    sp.add_argument("--force", action="store_true", help=force_help)

    sp = sub.add_parser("verify", help="check every file of a version against its manifest checksums")
    common(sp)
    sp.add_argument("version", nargs="?", default=None, help="default: current")
    sp.add_argument("--all", action="store_true", help="verify every version")

    sp = sub.add_parser("prune", help="delete old versions, keeping the newest N and the current one")
    common(sp)
    sp.add_argument("--keep", type=int, required=True)

    sp = sub.add_parser(
        "gc",
        help="remove staging directories left by killed builds (older than --max-age-s)",
        description="Remove staging directories left by killed builds (a build that fails removes "
        "its own), .trash-<version>/ left by a killed prune, .current.*.tmp left by a "
        "kill during a pointer write and models/.incoming-* left by a kill while "
        "storing an encoder model; resumable embedding caches (staging/embed-*) "
        "are kept.",
    )
    common(sp)
    sp.add_argument(
        "--max-age-s",
        type=float,
        default=3600.0,
        help="only directories untouched this long (default 3600: a build may still be running)",
    )

    sp = sub.add_parser("reshard", help="new version with an existing version's items split into N shards")
    common(sp)
    notify(sp)
    activation(sp)
    sp.add_argument("--shards", type=int, required=True, metavar="N", help="number of shards (1..items)")
    sp.add_argument("--version", default=None, help="version to reshard (default: current)")

    sp = sub.add_parser("export", help="write one version and its encoder model into a single archive")
    common(sp)
    sp.add_argument("--version", default=None, help="version to export (default: current)")
    sp.add_argument("--out", required=True, help="archive path (.tar, or .tar.gz / .tgz for gzip)")

    sp = sub.add_parser(
        "import", help="import an exported archive; it becomes current through the quality gate"
    )
    common(sp)
    notify(sp)
    sp.add_argument("archive")
    sp.add_argument(
        "--max-bytes",
        default="64G",
        metavar="SIZE",
        help="refuse an archive that states more than SIZE bytes in all (e.g. 500M, 200G; default 64G); "
        "it is also refused when its stated size exceeds the free space",
    )
    sp.add_argument(
        "--max-ratio",
        type=float,
        default=20.0,
        metavar="R",
        help="refuse an archive that states more than R bytes per byte of the archive file, a "
        "compression bomb (default 20; exports measure about 1.2; 0: no limit)",
    )
    activation(sp, tuned=False)  # --force also activates when the gate cannot run here
    return p


def _notify(args, version: str | None) -> int:
    """Tell the --notify server about `version` -> the command's exit code (0, or NOTIFY_FAILED).
    The HTTP client is api.notify.notify_server, injected by the caller as `args.notifier`."""
    if not getattr(args, "notify", None) or version is None:
        return 0
    ok, message = args.notifier(args.notify, args.token, version, wait_s=args.notify_timeout)
    if ok:
        print(f"notified: {message}")
        return 0
    print(
        f"error: the server did not confirm version {version} ({message}); the store's current is {version}",
        file=sys.stderr,
    )
    return NOTIFY_FAILED


def _dataset(args, image_size: int | None):
    """The dataset the arguments name, rendered / resized at the encoder's input size."""
    from training.datasets import create_dataset

    name, split, root = args.dataset, args.split, args.data_root
    if getattr(args, "folder", None):
        name, split, root = "folder", "all", args.folder
    if not name:
        raise ValueError("name the items to add: --dataset NAME [--split S --data-root R] or --folder DIR")
    options = {} if image_size is None else {"image_size": int(image_size)}
    return create_dataset(name, split=split, root=root, size=args.size, seed=args.seed, **options)


def _checkpoint_image_size(checkpoint) -> int:
    from training.checkpoint import read_checkpoint_metadata

    return int(read_checkpoint_metadata(checkpoint)["encoder"]["image_size"])


def _triple(text: str | None, flag: str) -> tuple[float, float, float] | None:
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise ValueError(f"{flag} must be three comma-separated numbers (R,G,B), got {text!r}")
    return values


@contextlib.contextmanager
def _build_checkpoint(args, store: IndexStore):
    """The checkpoint `index build` embeds with: --checkpoint, or --encoder + --pretrained saved as one
    (in staging; the build copies it into the store's models/ like any checkpoint)."""
    if (args.checkpoint is None) == (args.encoder is None):
        raise ValueError("give --checkpoint C, or --encoder open_clip:NAME --pretrained FILE (one of them)")
    if args.checkpoint is not None:
        if args.pretrained or args.image_size or args.image_mean or args.image_std:
            raise ValueError(
                "--pretrained / --image-size / --image-mean / --image-std go with --encoder, "
                "not --checkpoint (a checkpoint already fixes them)"
            )
        checkpoint = Path(args.checkpoint)
        if not checkpoint.is_file():
            raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
        yield checkpoint
        return
    model_name = parse_encoder_spec(args.encoder)
    if args.pretrained is None:
        raise ValueError(f"--encoder {args.encoder} needs --pretrained FILE: weights are never downloaded")
    store.ensure()
    checkpoint = save_pretrained_checkpoint(
        store.staging_dir,
        model_name,
        args.pretrained,
        image_size=args.image_size,
        image_mean=_triple(args.image_mean, "--image-mean"),
        image_std=_triple(args.image_std, "--image-std"),
    )
    try:
        yield checkpoint
    finally:
        checkpoint.unlink(missing_ok=True)


def _refuse_image_flags(args, verb: str, flags: tuple[str, ...]) -> None:
    """One line naming the image flags given beside --embeddings (no images are embedded then)."""
    given = [flag for flag in flags if getattr(args, flag.removeprefix("--").replace("-", "_"))]
    if given:
        raise ValueError(
            f"--embeddings {verb} your own vectors; drop {', '.join(given)} (no images are embedded)"
        )


def _build_from_vectors(args, options) -> str:
    """`index build --embeddings FILE [--ids FILE] [--metadata FILE]`: a version without an encoder."""
    from index.build import build_from_vectors

    _refuse_image_flags(args, "indexes", ("--dataset", "--checkpoint", "--encoder", "--pretrained"))
    return build_from_vectors(
        args.embeddings, args.root, dataclasses.replace(options, calibrator=None), ids=args.ids
    )


def _change_sharded(
    args, store: IndexStore, base: str, evaluator, calibrator, on_new_items, t0: float
) -> int:
    """`index add | sync | delete` on a sharded version: the change applied to an unsharded copy of it (never
    activated), the result resharded into as many shards, gated against what serves and activated; both
    intermediates removed. Rows are split contiguously again, so items may move between shards; the version
    answers what the unsharded one would, probabilities exact (search/serving/sharded.py)."""
    import argparse
    import contextlib
    import io

    from index.shards import remove_unserved, reshard, unshard

    shards = len(store.manifest(base).shards)
    before = set(store.versions())
    whole = unshard(store, base, target_recall=args.target_recall)
    changed = None
    try:
        inner = argparse.Namespace(
            **{**vars(args), "base": whole, "no_activate": True, "keep": None, "notify": None}
        )
        with contextlib.redirect_stdout(io.StringIO()):
            _run(inner, None, calibrator)  # the quality gate runs once, on the resharded result
        made = [v for v in store.versions() if v not in before and v != whole]
        if not made:  # sync: the folder is in step with the base
            print(f"index sync: {base} is already in step with its folder (nothing to re-embed)")
            return 0
        changed = made[-1]
        version = reshard(
            args.root,
            shards,
            source=changed,
            commit=_commit_options(args, evaluator),
            path=f"index {args.command}",
        )
    finally:
        for v in (whole, changed):
            if v is not None:
                remove_unserved(store, v)
    m = store.manifest(version)
    print(
        _summary(args.command, store, version, time.perf_counter() - t0, not args.no_activate)
        + f", {shards} shards ({m.count} items; {store.manifest(base).count} in {base})"
    )
    if on_new_items is not None and args.command in ("add", "sync"):
        on_new_items(args.root, base, version)
    return 0 if args.no_activate else _notify(args, version)


def _build_on_ray(args, store: IndexStore, options, t0: float) -> int:
    """`index build --engine ray --shards N` (index/ray_build.py)."""
    if not args.shards:
        raise ValueError("--engine ray builds a sharded version: give --shards N")
    if args.embeddings is not None or not args.dataset:
        raise ValueError(
            "--engine ray embeds a dataset: give --dataset NAME with --checkpoint or --encoder "
            "(for your own vectors use --embeddings without --engine ray)"
        )
    if args.ids is not None:
        raise ValueError("--ids goes with --embeddings (a dataset names its own items)")
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError as err:  # Ray, or Ray Data's pandas / pyarrow: the ray extra installs them
        raise ModuleNotFoundError(f"Ray Data is not installed ({err})", name="ray") from None
    from index.ray_build import build_on_ray

    with _build_checkpoint(args, store) as checkpoint:
        version = build_on_ray(
            checkpoint,
            _dataset(args, _checkpoint_image_size(checkpoint)),
            args.root,
            args.shards,
            options,
            address=args.ray_address,
            actors=args.ray_actors,
            actor_cpus=args.ray_actor_cpus,
        )
    print(
        _summary("build", store, version, time.perf_counter() - t0, not args.no_activate)
        + f", {args.shards} shards built on Ray"
    )
    return _notify(args, version) if not args.no_activate else 0


def _add_vectors(args, store: IndexStore, evaluator, t0: float) -> int:
    """`index add --embeddings FILE [--ids FILE] [--metadata FILE]` onto a version built from vectors."""
    from index.build import add_vectors

    _refuse_image_flags(args, "adds", ("--dataset", "--folder", "--checkpoint"))
    version = add_vectors(
        args.root,
        args.embeddings,
        ids=args.ids,
        base=args.base,
        metadata=_user_metadata(args),
        progress=not args.no_progress,
        commit=_commit_options(args, evaluator),
    )
    print(_summary("add", store, version, time.perf_counter() - t0, not args.no_activate))
    return 0 if args.no_activate else _notify(args, version)


def _embed_options(args):
    """The embedding knobs of build, rebuild, add and sync."""
    from index.options import EmbedOptions

    return EmbedOptions(
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        shard_size=args.shard_size,
        device=args.device,
        progress=not args.no_progress,
    )


def _commit_options(args, evaluator, calibrator=None):
    """The commit knobs (tuning target, quality gate, activation, pruning) of every command that makes a
    version."""
    from index.options import CommitOptions

    return CommitOptions(
        target_recall=args.target_recall,
        evaluator=evaluator,
        calibrator=calibrator,
        margin=args.margin,
        force=args.force,
        activate=not args.no_activate,
        keep=args.keep,
    )


def _user_metadata(args):
    """The --metadata file's fields (read once per command), or None."""
    if not getattr(args, "metadata", None):
        return None
    from index.metadata import load_user_metadata

    return load_user_metadata(args.metadata)


def _figures(m: Manifest) -> dict:
    """What `index list` and the summaries show of one manifest: the index's recall@10 against exact
    search and its target (the activation rule's recall check), the gate's retrieval recall@10 by
    exact search and through the served index, and the gate result."""
    gate = m.quality_gate or GateRecord()
    recall = gate.recall
    tuned = m.recall or RecallRecord()
    exact = gate.exact_recall_at_10.candidate if gate.exact_recall_at_10 is not None else None
    served = gate.recall_at_10.candidate if exact is not None and gate.recall_at_10 is not None else None
    return {
        "index_recall": recall.served if "served" in recall.key_order else tuned.recall,
        "target": recall.target if "target" in recall.key_order else tuned.target,
        "recall_exact": exact,
        "recall_served": served,
        "gate": gate.passed,
        "metric": gate.metric,
        "candidate": gate.candidate,
        "serving": gate.serving,
    }


def _summary(command: str, store: IndexStore, version: str, seconds: float, activated: bool) -> str:
    m = store.manifest(version)
    f = _figures(m)
    state = "activated" if activated else "not activated"
    recall_s = ""
    if isinstance(f["index_recall"], (int, float)):
        recall_s = f", index recall@10 {f['index_recall']:.3f}"
        if isinstance(f["target"], (int, float)):
            recall_s += f" (target {f['target']:.2f})"
    if isinstance(f["recall_exact"], (int, float)) and isinstance(f["recall_served"], (int, float)):
        recall_s += f", retrieval recall@10 exact {f['recall_exact']:.3f} / served {f['recall_served']:.3f}"
    if isinstance(f["candidate"], (int, float)) and isinstance(f["serving"], (int, float)):
        recall_s += (
            f", gate {'pass' if f['gate'] else 'FAIL'} ({f['metric']} {f['candidate']:.4g} vs serving "
            f"{f['serving']:.4g})"
        )
    return (
        f"index {command}: version {version} ({state}), {m.count} items, kind {m.kind}, "
        f"{m.skipped_count or 0} skipped{recall_s}, {seconds:.1f} s"
    )


def _list(store: IndexStore, as_json: bool) -> None:
    current = store.current_version()
    rows = []
    for v in store.versions():
        try:
            m = store.manifest(v)
            last = store.last_activation(v) or {}
            rows.append(
                {
                    "version": v,
                    "current": v == current,
                    "count": m.count,
                    "kind": m.kind,
                    "created": m.created,
                    "checkpoint": (m.checkpoint_record.sha256 or "")[:12],
                    "recall": m.recall.recall if m.recall is not None else None,
                    "shards": len(m.shards) if m.shards else None,
                    **_figures(m),
                    "forced": bool(last.get("forced")),
                    "status": "ok",
                }
            )
        except IndexCorruptError as err:
            rows.append({"version": v, "current": v == current, "status": f"corrupt: {err}"})
    if as_json:
        print(json.dumps({"root": str(store.root), "current": current, "versions": rows}, indent=2))
        return
    if not rows:
        print(f"no versions under {store.root}")
        return

    def num(x, fmt=".3f"):
        return "-" if not isinstance(x, (int, float)) else format(x, fmt)

    print(
        f"{'':1} {'version':<30} {'count':>9} {'kind':<8} {'index@10':>8} {'target':>6} {'exact':>6} "
        f"{'served':>6} {'gate':<6} {'checkpoint':<12} created"
    )
    for r in rows:
        if r["status"] != "ok":
            print(f"{'*' if r['current'] else ' '} {r['version']:<30} {r['status']}")
            continue
        gate = "-" if r["gate"] is None else ("pass" if r["gate"] else "FAIL")
        gate += "!" if r["forced"] else ""
        print(
            f"{'*' if r['current'] else ' '} {r['version']:<30} {r['count']:>9} {r['kind']:<8} "
            f"{num(r['index_recall']):>8} {num(r['target'], '.2f'):>6} {num(r['recall_exact']):>6} "
            f"{num(r['recall_served']):>6} {gate:<6} {r['checkpoint']:<12} {r['created']}"
        )
    print(
        "index@10: recall@10 of the version's FAISS index against exact search (the gate needs >= target); "
        "exact / served: the gate's retrieval recall@10 by exact search and through the index; "
        "gate '!': activated by --force"
    )


# Commands that create a store when its root is missing; every other one needs an existing store.
CREATES_STORE = ("build", "import")


def _run(args, evaluator, calibrator, on_new_items=None) -> int:
    from index.gate import gate_for
    from index.store import IndexStore, require_store

    if args.command not in CREATES_STORE:
        require_store(args.root)
    store = IndexStore(args.root)
    t0 = time.perf_counter()
    from index.build import BuildOptions, add_items, build_index, rebuild_index
    from index.embed import dist_env
    from index.sync import delete_items, read_ids_file, sync_index
    from index.transfer import export_version, import_version

    rank = dist_env()[0]
    if args.command in ("add", "sync", "delete"):
        base = args.base or store.current_version()
        if base and store.manifest(base).shards:
            return _change_sharded(args, store, base, evaluator, calibrator, on_new_items, t0)
    if args.command == "reshard":
        from index.shards import reshard

        version = reshard(
            args.root, args.shards, source=args.version, commit=_commit_options(args, evaluator)
        )
        print(
            _summary("reshard", store, version, time.perf_counter() - t0, not args.no_activate)
            + f", {args.shards} shards"
        )
        return _notify(args, version) if not args.no_activate else 0
    if args.command in ("build", "rebuild"):
        shards = getattr(args, "shards", None)
        if shards is not None and shards < 1:
            raise ValueError(f"--shards must be a positive integer, got {shards}")
        fields = {}
        if args.search_temperature is not None:
            if args.search_temperature <= 0:
                raise ValueError(f"--search-temperature must be positive, got {args.search_temperature}")
            fields = {
                "search_temperature": args.search_temperature,
                "search_temperature_source": "command line",
            }
        commit = _commit_options(args, evaluator, calibrator)
        if getattr(args, "engine", "local") == "ray":
            return _build_on_ray(
                args,
                store,
                BuildOptions.combine(
                    _embed_options(args),
                    commit,
                    kind=args.kind,
                    params=parse_params(args.param),
                    fields=fields,
                    metadata=_user_metadata(args),
                ),
                t0,
            )
        if shards:  # built whole first (not activated), then split into the one version that is gated
            commit = dataclasses.replace(commit, activate=False, keep=None)
        options = BuildOptions.combine(
            _embed_options(args),
            commit,
            kind=args.kind,
            params=parse_params(args.param),
            fields=fields,
            metadata=_user_metadata(args),
            memory_budget=parse_bytes(args.memory_budget) if args.memory_budget else None,
        )
        if args.command == "build" and args.embeddings is not None:
            version = _build_from_vectors(args, options)
        elif args.command == "build":
            if args.ids is not None:
                raise ValueError("--ids goes with --embeddings (a dataset names its own items)")
            if not args.dataset:
                raise ValueError(
                    "name what to index: --dataset NAME (with --checkpoint or --encoder) or "
                    "--embeddings FILE (your own vectors)"
                )
            with _build_checkpoint(args, store) as checkpoint:
                version = build_index(
                    checkpoint, _dataset(args, _checkpoint_image_size(checkpoint)), args.root, options
                )
        else:
            version = rebuild_index(args.root, args.checkpoint, options)
        if shards and rank == 0:
            from index.shards import remove_unserved, reshard

            whole = version
            version = reshard(
                args.root, shards, source=whole, commit=_commit_options(args, evaluator), path="index build"
            )
            remove_unserved(store, whole)
        if rank == 0:
            print(_summary(args.command, store, version, time.perf_counter() - t0, not args.no_activate))
            if not args.no_activate:
                return _notify(args, version)
        return 0
    if args.command == "add":
        if args.embeddings is not None:
            return _add_vectors(args, store, evaluator, t0)
        if args.ids is not None:
            raise ValueError("--ids goes with --embeddings (a dataset names its own items)")
        base = (
            store.manifest(args.base or store.current_version())
            if (args.base or store.current_version())
            else None
        )
        if base is None:
            raise FileNotFoundError(f"no current index version under {args.root} to add to")
        image_size = (base.encoder or {}).get("image_size")
        base_version = args.base or store.current_version()
        version = add_items(
            args.root,
            _dataset(args, image_size),
            checkpoint=args.checkpoint,
            base=args.base,
            metadata=_user_metadata(args),
            embed=_embed_options(args),
            commit=_commit_options(args, evaluator),
        )
        print(_summary("add", store, version, time.perf_counter() - t0, not args.no_activate))
        if on_new_items is not None:
            on_new_items(args.root, base_version, version)
        return 0 if args.no_activate else _notify(args, version)
    if args.command == "sync":
        version, counts = sync_index(
            args.root,
            args.data_root,
            base=args.base,
            metadata=_user_metadata(args),
            embed=_embed_options(args),
            commit=_commit_options(args, evaluator, calibrator),
        )
        if version == counts["base"]:
            print(
                f"index sync: {version} is already in step with {counts['data_root']} "
                f"({counts['unchanged']} unchanged, {counts['touched']} touched, nothing to re-embed)"
            )
            return 0
        print(
            _summary("sync", store, version, time.perf_counter() - t0, not args.no_activate)
            + "; "
            + ", ".join(
                f"{counts[k]} {k}"
                for k in ("added", "removed", "modified", "retried", "touched", "unchanged", "embedded")
            )
        )
        if on_new_items is not None:
            on_new_items(args.root, counts["base"], version)
        return 0 if args.no_activate else _notify(args, version)
    if args.command == "delete":
        version, counts = delete_items(
            args.root,
            read_ids_file(args.ids_file),
            base=args.base,
            ignore_missing=args.ignore_missing,
            commit=_commit_options(args, evaluator),
        )
        print(
            _summary("delete", store, version, time.perf_counter() - t0, not args.no_activate)
            + f"; {counts['deleted']} deleted"
            + (f", {counts['missing']} ids not found" if counts["missing"] else "")
        )
        return 0 if args.no_activate else _notify(args, version)
    if args.command == "list":
        _list(store, args.json)
        return 0
    if args.command == "activate":
        entry = store.activate(
            args.version, force=args.force, path="index activate", gate=gate_for(store, evaluator)
        )
        print(
            f"activated {args.version}"
            + (" (forced: " + "; ".join(entry["overridden"]) + ")" if entry.get("forced") else "")
        )
        return _notify(args, args.version)
    if args.command == "rollback":
        version = store.rollback(force=args.force, path="index rollback", gate=gate_for(store, evaluator))
        entry = store.last_activation(version) or {}
        print(
            f"rolled back to {version}"
            + (" (forced: " + "; ".join(entry["overridden"]) + ")" if entry.get("forced") else "")
        )
        return _notify(args, version)
    if args.command == "verify":
        targets = store.versions() if args.all else [args.version or store.current_version()]
        if targets == [None]:
            raise FileNotFoundError(f"no current index version under {args.root}")
        bad = 0
        for v in targets:
            try:
                loaded = store.load(v, verify=True, gpu=False)
                record = loaded.manifest.checkpoint_record
                if not record.sha256 and not record.path:  # built from vectors: no model
                    print(
                        f"ok {v}: {len(loaded)} items, {len(loaded.manifest.files)} files match their sha256 "
                        "(built from vectors: no encoder model)"
                    )
                    continue
                store.models.resolve(record, v)  # the encoder weights too (migrates an old store)
                print(
                    f"ok {v}: {len(loaded)} items, {len(loaded.manifest.files)} files and encoder model "
                    f"{record.sha256[:12]} match their sha256"
                )
            except IndexCorruptError as err:
                bad += 1
                print(f"CORRUPT {v}: {err}")
        return 1 if bad else 0
    if args.command == "prune":
        removed = store.prune(args.keep)
        print(f"pruned {len(removed)} version(s)" + (": " + ", ".join(removed) if removed else ""))
        return 0
    if args.command == "gc":
        if not args.max_age_s >= 0:
            raise ValueError(f"--max-age-s must be >= 0, got {args.max_age_s}")
        removed = store.clean_staging(args.max_age_s)
        print(
            f"removed {len(removed)} stale staging entr{'y' if len(removed) == 1 else 'ies'}"
            + (": " + ", ".join(removed) if removed else "")
        )
        return 0
    if args.command == "export":
        out = export_version(args.root, args.out, args.version)
        print(f"exported {args.version or store.current_version()} to {out} ({out.stat().st_size} bytes)")
        return 0
    if args.command == "import":
        from index.options import CommitOptions

        version, existed = import_version(
            args.root,
            args.archive,
            max_bytes=parse_bytes(args.max_bytes),
            max_ratio=args.max_ratio,
            commit=CommitOptions(
                evaluator=evaluator,
                margin=args.margin,
                force=args.force,
                activate=not args.no_activate,
                keep=args.keep,
            ),
        )
        state = "activated" if store.current_version() == version else "not activated"
        print(f"imported {version} into {args.root}{' (already present)' if existed else ''}, {state}")
        return _notify(args, version) if state == "activated" else 0
    raise AssertionError(f"unhandled command {args.command}")


def main(
    argv: list[str] | None = None, evaluator=None, calibrator=None, on_new_items=None, notifier=None
) -> int:
    """Entry point of `softsearch index ...`; `evaluator` is the quality gate and `calibrator` the
    search-temperature calibration (see index.build), both injected by the caller, as are
    `on_new_items(root, base, version)`, told after `add` / `sync` wrote a version (duplicate report),
    and `notifier` (api.notify.notify_server) for --notify."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage / the error
        return int(exc.code or 0)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.notifier = notifier
    if getattr(args, "notify", None) and notifier is None:
        print("error: --notify needs the softsearch command (it brings the HTTP client)", file=sys.stderr)
        return 2
    from index.gate import ActivationRefused

    try:
        return _run(args, evaluator, calibrator, on_new_items)
    except ActivationRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (NotADirectoryError, IsADirectoryError):
        raise  # a path the user named is wrong: the caller's user-mistake line (exit 2)
    except OSError as err:  # the disk, not the user: no traceback, its own exit code
        print(f"error: {describe_os_error(err, args.root)}", file=sys.stderr)
        return STORAGE_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
