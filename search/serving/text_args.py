"""`softsearch search`'s command line, apart from the search so `--help` and a mistyped flag load no torch or
FAISS."""

from __future__ import annotations

import argparse

from training.cli_parser import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="softsearch search",
        description="Search a local index by text (the version's text tower), with the "
        "exact probabilities the API gives.",
    )
    parser.add_argument("--index", required=True, help="index store root (softsearch index build --root)")
    parser.add_argument(
        "--text",
        required=True,
        action="append",
        help="words describing the images wanted (repeat for several queries)",
    )
    parser.add_argument("--version", help="index version (default: the current one)")
    parser.add_argument("-k", "--k", type=int, default=10, help="results per query (default 10)")
    parser.add_argument(
        "--temperature", type=float, help="softmax temperature (default: the calibrated text one)"
    )
    parser.add_argument("--filter", help="metadata filter as JSON, as the API takes it")
    parser.add_argument("--min-probability", type=float, help="keep hits with at least this probability")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser
