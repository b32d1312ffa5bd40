"""`softsearch train`'s command line, apart from the trainer so that `--help` and a mistyped flag load
no torch (training/trainer.py runs the parsed command)."""

from __future__ import annotations

import argparse

from training.cli_parser import CommandParser

# The built-in schedules and their defaults, as training.schedules.describe_schedules() prints them (that
# needs torch); tests/test_cli_startup.py checks the two agree, so a changed default cannot leave this behind.
SCHEDULE_HELP = """\
  cosine     tau_min = 0.1, tau_max = 1.0, period = 400.0, steps_per_epoch = 1
  exp        tau_0 = 1.0, gamma = 0.999, tau_min = 0.01, tau_max = inf, steps_per_epoch = 1
  fixed      tau = 0.1, steps_per_epoch = 1
  learnable  tau = 0.07, tau_min = 0.01, tau_max = 1.0, steps_per_epoch = 1
  log        tau_0 = unset, t_0 = 2.0, c = 1.0, tau_min = 0.0, tau_max = inf, steps_per_epoch = 1"""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="softsearch train",
        description="Train a contrastive image encoder from a TOML config. Runs unchanged under "
        "`torchrun --nproc-per-node N` (batch_size is the global batch).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="temperature schedules (schedule = NAME, options in [schedule_options]; the same for\n"
        "noise_schedule / [noise_options]), with their defaults:\n"
        + SCHEDULE_HELP
        + "\n\nswitching schedule replaces the options table whole, e.g.\n"
        "  --set schedule='\"cosine\"' "
        "--set 'schedule_options={tau_min = 0.1, tau_max = 1.0, period = 400.0}'",
    )
    parser.add_argument(
        "--config", help="TOML config file (configs/synthetic.toml, ...); defaults if omitted"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, dotted for tables: --set encoder.width=32 (repeatable)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in out_dir from its train_state"
    )
    parser.add_argument("--out", help="output directory (overrides out_dir)")
    return parser
