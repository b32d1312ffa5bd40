"""`softsearch dedup`'s command line, apart from the job so that `--help` and a mistyped flag load no torch,
FAISS or PIL (search/duplicates/job.py runs the parsed command)."""

from __future__ import annotations

import argparse

from search.duplicates.config import VERIFIERS, DedupConfig
from training.cli_parser import CommandParser


def build_parser() -> argparse.ArgumentParser:
    d = DedupConfig()
    p = CommandParser(
        prog="softsearch dedup",
        description="near-duplicate groups of an index version at "
        "a probability fitted on the collection itself",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--index", required=True, help="index store root")
    p.add_argument("--version", default=None, help="version to scan (default: the current one)")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help=f"pair probability to keep a pair (default {d.threshold}: more likely a duplicate than not)",
    )
    p.add_argument(
        "--precision",
        type=float,
        default=None,
        help="instead of a threshold: the lowest found p whose kept pairs are expected to reach this "
        "pair precision",
    )
    p.add_argument("--flips", action="store_true", help="count a horizontal mirror as a duplicate")
    p.add_argument(
        "--calibration-items",
        type=int,
        default=d.calibration_items,
        help="items given a synthetic edited copy to fit the classifier on",
    )
    p.add_argument(
        "--verifier",
        choices=VERIFIERS,
        default=d.verifier,
        help="what decides a pair: pixels (alignment and a fit on the collection), encoder (a copy "
        "detector trained on the collection, a softmax with a 'none' option), both (one fit on both)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p
