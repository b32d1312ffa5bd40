"""The `softsearch eval` command line, apart from the evaluation code so `--help` imports nothing heavy.

Database: an index version (`--index ROOT [--version V]`) or a checkpoint plus a dataset
(`--checkpoint C --dataset NAME --split S`). Queries: a held-out split, subsampled to `--max-queries`.
Writes OUT/report.json and one self-contained OUT/report.html (search/evaluation/evaluate.py).
"""

from __future__ import annotations

import argparse

from training.cli_parser import CommandParser

DESCRIPTION = (
    "softsearch eval: retrieval metrics, the cross-entropy gap, calibration, the 1/k law, diagnostics."
)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="softsearch eval",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_argument_group("database")
    src.add_argument("--index", help="index root: evaluate its current (or --version) version")
    src.add_argument("--version", help="index version (default: the current one)")
    src.add_argument("--checkpoint", help="encoder checkpoint (with --dataset) instead of --index")
    src.add_argument("--dataset", help="database dataset name (with --checkpoint)")
    src.add_argument("--split", default="train")
    src.add_argument("--data-root", help="dataset root directory")
    src.add_argument("--size", type=int, help="database size (default: the split's)")
    src.add_argument("--dataset-seed", type=int, default=0, help="dataset seed (synthetic rendering)")
    q = p.add_argument_group("queries")
    q.add_argument("--queries-dataset", help="held-out query dataset (default: the database's)")
    q.add_argument("--queries-split", default="test")
    q.add_argument("--queries-root")
    q.add_argument("--queries-size", type=int)
    q.add_argument("--max-queries", type=int, default=1000)
    p.add_argument("--generator", choices=["latent", "label", "instance"], help="default: the dataset's")
    p.add_argument("--kappa", type=float, help="von Mises concentration of the latent generator")
    p.add_argument("--temperature", type=float, help="search tau (default: manifest's, else training tau)")
    p.add_argument("--out", default="eval_report", help="output directory for report.json / report.html")
    p.add_argument("--no-k-law", dest="k_law", action="store_false", help="skip the 1/k law (faster)")
    p.add_argument("--k-law-samples", type=int, default=2000, help="Monte-Carlo draws per k")
    p.add_argument("--compare", help="second checkpoint (e.g. the initial one) for a before/after table")
    p.add_argument(
        "--n-boot", type=int, default=1000, help="bootstrap resamples for the metric CIs (tail: at most 200)"
    )
    p.add_argument("--n-projections", type=int, default=64, help="random projections tested for normality")
    p.add_argument(
        "--mardia-null",
        type=int,
        default=199,
        help="simulated Gaussian samples for Mardia's p-values (0: closed forms only)",
    )
    p.add_argument("--tail-queries", type=int, default=256, help="queries in the tail statistics")
    p.add_argument("--seed", type=int, default=0, help="query subsampling, bootstrap and Monte-Carlo seed")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", help="torch device (default: cuda if available)")
    return p


def build_text_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="softsearch eval --text",
        description="Text-to-image gap and recall of held-out synthetic captions.",
    )
    parser.add_argument("--text", action="store_true", help="evaluate caption queries (this command)")
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint with a text tower (softsearch train [text])"
    )
    parser.add_argument(
        "--size", type=int, default=None, help="held-out images (default: the test split, 512)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None, help="fixed tau (default: calibrated)")
    parser.add_argument("--out", help="write the JSON result here as well")
    return parser
