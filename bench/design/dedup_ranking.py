"""Design listing, not a benchmark (issue 29, docs/results.md §12): every duplicate group bench/dedup.py's flow (B)
finds at p >= 0.5 on the Tux Paint stamps with planted copies, most confident first, with whether all its pairs are
true and how many pairs it holds -- where the look-alikes rank among the copies, so which thresholds could meet a
precision / recall pair at all. ~3 min.

    PYTHONPATH=. .venv/bin/python bench/design/dedup_ranking.py CHECKPOINT SEED
"""
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dedup import closure, group_pairs, identical_pairs, one_colour_pairs, plant  # noqa: E402
from index.build import BuildOptions, build_index  # noqa: E402
from search.duplicates.job import calibrate_snapshot, find_duplicates, scores_cache  # noqa: E402
from search.serving.searcher import Searcher  # noqa: E402
from training.checkpoint import read_checkpoint_metadata  # noqa: E402
from training.datasets import create_dataset  # noqa: E402

STAMPS = Path("/usr/share/tuxpaint/stamps")


def main(checkpoint: str, seed: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="dedup-ranking-"))
    try:
        folder = work / "photos"
        planted = plant(STAMPS, folder, 0.1, seed)
        size = int(read_checkpoint_metadata(checkpoint)["encoder"]["image_size"])
        build_index(checkpoint, create_dataset("folder", split="all", root=str(folder), image_size=size),
                    work / "index", BuildOptions(progress=False))
        searcher = Searcher(work / "index")
        searcher.load()
        snap = searcher.snapshot()
        ids = snap.index.ids
        planted = {t for t in planted if t <= set(ids)}
        truth = closure(planted | identical_pairs(folder, ids) | one_colour_pairs(folder, ids))
        # flow (B): calibrated on the folder before the copies were added
        build_index(checkpoint, create_dataset("folder", split="all", root=str(STAMPS), image_size=size),
                    work / "before", BuildOptions(progress=False))
        before = Searcher(work / "before")
        before.load()
        calib = calibrate_snapshot(before.snapshot(), "verified", 300, 0.99, seed + 1, progress=False)
        found = find_duplicates(snap, calib, threshold=0.5, progress=False, cache=scores_cache(snap, calib))
        listed = sorted(((g["confidence"], group_pairs({"groups": [g]})) for g in found["groups"]),
                        key=lambda r: -r[0])
        for rank, (confidence, pairs) in enumerate(listed):
            names = sorted({i.split("/")[-1] for pair in pairs for i in pair})
            print(f"{rank:3d} {confidence:.4f} {'ok ' if pairs <= truth else 'BAD'} {len(pairs)} {','.join(names)}")
        print(f"true pairs {len(truth)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
