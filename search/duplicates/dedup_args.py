"""`softsearch dedup`'s command line, apart from the job so that `--help` and a mistyped flag load no torch,
FAISS or PIL (search/duplicates/job.py runs the parsed command)."""
from __future__ import annotations

import argparse

from training.cli_parser import CommandParser

# the least sure a group kept by default may be: the expected-precision rule alone went down to p 0.69 and took a
# pair of look-alike originals (two dreidels one letter apart) as its last group at design seed 9; every calibration
# sample of the design seeds put those pairs at 0.54-0.84 (docs/results.md §12, "A floor under the default")
MIN_PROBABILITY = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="softsearch dedup", description="near-duplicate groups of an index version at "
                      "a calibrated probability", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--index", required=True, help="index store root")
    p.add_argument("--version", default=None, help="version to scan (default: the current one)")
    p.add_argument("--threshold", type=float, default=None,
                   help="probability P a duplicate set must reach (default: from --precision on the calibration)")
    p.add_argument("--precision", type=float, default=0.99,
                   help="target pair precision that picks the default P: the lowest group confidence at which "
                        "the groups kept have a mean calibrated confidence that reaches it")
    p.add_argument("--min-probability", type=float, default=MIN_PROBABILITY,
                   help="the default P is never below this: every group kept at least this sure (0: the "
                        "expected-precision rule alone)")
    p.add_argument("--calibration-items", type=int, default=300,
                   help="items copied with random edits (and as many left without a copy) to fit the temperature")
    p.add_argument("--stage", choices=("verified", "encoder"), default="verified",
                   help="verified: each item's nearest items re-scored pixel for pixel (verify.py); encoder: embedding "
                        "cosine only (the pipeline before verification)")
    p.add_argument("--prior", choices=("calibration", "collection"), default=None,
                   help="the share of items with a duplicate the probabilities assume: this collection's, estimated "
                        "from the scan by EM (the default at the verified stage: fewer duplicates than half makes "
                        "every p lower), or the calibration's (about half: as many copies as 'none' queries; the "
                        "default, and the only one, at the encoder stage). Both shares are reported")
    p.add_argument("--k", type=int, default=32, help="neighbours per item from the ANN index")
    p.add_argument("--max-group", type=int, default=8, help="largest candidate set an item may have")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p
