"""`index sync` against the baseline a user would otherwise run: a from-scratch `index build` of the
changed folder (same encoder, same kind), interleaved in one process so machine load cancels in the
ratio. Also: `index export` / `import` of the synced version.

Corpus: the real tuxpaint stamps (Debian tuxpaint-stamps-default, ~800 PNG in category folders),
copied into a temporary folder; then 10 % of the files are added, 10 % removed and 5 % modified
(colours inverted). Neither side runs the quality gate or calibration (both would add the same).

    python bench/sync.py [--repeats 3] [--image-size 32] [--limit 800]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._common import row, write_results  # noqa: E402

STAMPS = Path("/usr/share/tuxpaint/stamps")


def _corpus(dest: Path, limit: int, rng) -> tuple[list[Path], list[Path]]:
    """Copy up to `limit` stamps into dest/<category>/ (as RGB PNG); returns (in the folder, held back)."""
    paths = sorted(STAMPS.rglob("*.png"))
    if len(paths) < 50:
        raise SystemExit(f"need the tuxpaint stamps under {STAMPS} (apt-get install tuxpaint-stamps-default)")
    paths = [paths[i] for i in np.sort(rng.choice(len(paths), size=min(limit, len(paths)), replace=False))]
    held = dest.parent / "held"
    out = []
    for i, path in enumerate(paths):
        category = path.relative_to(STAMPS).parts[0]
        target = (dest if i % 10 else held) / category / f"{i:04d}-{path.stem}.png"  # every 10th held back
        target.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(path) as im:
            im.convert("RGBA").convert("RGB").save(target)  # via RGBA: palette transparency
        out.append(target)
    return [p for p in out if dest in p.parents], [p for p in out if held in p.parents]


def _change(folder: Path, held: list[Path], rng) -> dict:
    files = sorted(folder.rglob("*.png"))
    order = rng.permutation(len(files))
    n10, n5 = len(files) // 10, len(files) // 20
    for i in order[:n10]:
        files[i].unlink()
    for i in order[n10 : n10 + n5]:
        with Image.open(files[i]) as im:
            ImageOps.invert(im.convert("RGB")).save(files[i])
    for path in held[:n10]:
        target = folder / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return {"files": len(files), "removed": n10, "modified": n5, "added": min(n10, len(held))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=900, help="stamps to use (10 %% are held back to be added)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from index.build import BuildOptions, build_index
    from index.options import CommitOptions, EmbedOptions
    from index.store import IndexStore
    from index.sync import sync_index
    from index.transfer import export_version, import_version
    from training.checkpoint import save_checkpoint
    from training.datasets import create_dataset
    from training.encoder import EncoderConfig, create_encoder

    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="softsearch-bench-sync-"))
    try:
        folder = work / "photos"
        _, held = _corpus(folder, args.limit, rng)
        torch.manual_seed(0)
        ck = save_checkpoint(
            work / "encoder.safetensors",
            create_encoder(EncoderConfig(image_size=args.image_size)),
            step=0,
            train_config={},
            lineage={},
        )

        def dataset():
            return create_dataset("folder", split="all", root=str(folder), image_size=args.image_size)

        root = work / "index"
        base = build_index(ck, dataset(), root, BuildOptions(progress=False))
        change = _change(folder, held, rng)
        sync_s, build_s, counts = [], [], {}
        for r in range(args.repeats):  # interleaved: sync, then the from-scratch build
            t0 = time.perf_counter()
            version, counts = sync_index(
                root, base=base, embed=EmbedOptions(progress=False), commit=CommitOptions(activate=False)
            )
            sync_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            build_index(ck, dataset(), work / f"scratch{r}", BuildOptions(progress=False))
            build_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        archive = export_version(root, work / "v.tar", version)
        export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        import_version(work / "imported", archive)
        import_s = time.perf_counter() - t0
        count = IndexStore(root).manifest(version).count
        mb = archive.stat().st_size / 1e6
        sync_med, build_med = float(np.median(sync_s)), float(np.median(build_s))
        rows = [
            row(
                f"sync {count} files (+{counts['added']} -{counts['removed']} ~{counts['modified']}, "
                f"{counts['embedded']} embedded) vs full build",
                sync_med,
                "s",
                build_med,
            ),
            row(
                "sync: images embedded per changed file",
                counts["embedded"] / max(1, change["added"] + change["modified"]),
                "ratio",
                None,
            ),
            row(f"export version ({mb:.1f} MB tar)", export_s, "s", None),
            row("import version (checksums, gate-free)", import_s, "s", None),
        ]
        write_results("sync", rows)
        print(
            f"sync runs {['%.2f' % s for s in sync_s]} s, full builds {['%.2f' % s for s in build_s]} s "
            f"(median of {args.repeats}; machine shared with other jobs, interleaved)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
