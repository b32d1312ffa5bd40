"""The `softsearch` command: one entry point dispatching to each package's `main(argv)`.

Each sub-command lives with the package that owns it (training, index, search, api); this
module only routes and turns user mistakes into a one-line message with exit code 2. Every command's
arguments are parsed by a parser that imports nothing heavy (training.cli_parser.CommandParser, one
`error:` line for a mistyped flag) before torch, FAISS or open_clip are loaded.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

USAGE = """usage: softsearch <command> [options]

commands:
  train               train an encoder (InfoNCE / WEINCE / annealed InfoNCE) from a TOML config
  index SUBCOMMAND    build | rebuild | add | sync | delete | list | activate | rollback | verify |
                      prune | export | import
  eval                evaluate an index or checkpoint: retrieval metrics, cross-entropy gap, report
  dedup               near-duplicate groups of an index version at a calibrated probability
  search --text WORDS search a local index by text, with calibrated probabilities
  serve               serve the HTTP API and web page
  experiment anneal   Langevin temperature-annealing experiment on free unit embeddings

`softsearch <command> --help` describes each command.
"""


def _train(argv: list[str]) -> int:
    from training.train_args import build_parser

    build_parser().parse_args(argv)  # --help and mistakes answered before torch loads
    from training.trainer import main as train_main

    return train_main(argv)


def gate_evaluator(*args, **kwargs):
    """The index quality gate's evaluator, imported when a command first gates a version (not for --help)."""
    from search.evaluation.quality import evaluate_version

    return evaluate_version(*args, **kwargs)


def gate_calibrator(candidate, *args, **kwargs):
    """The index build's search-temperature calibrator (and a text tower's), imported on first use."""
    from search.evaluation.quality import calibrate_version
    from search.evaluation.text_eval import store_text_calibration

    store_text_calibration(candidate)  # a text tower: its temperature on held-out captions, into the manifest
    return calibrate_version(candidate, *args, **kwargs)


def _report_duplicates(root, base: str | None, version: str) -> None:
    """After `index add | sync`: which new items duplicate indexed ones (needs an earlier
    `softsearch dedup`)."""
    from search.duplicates.job import report_new_duplicates

    report_new_duplicates(root, base, version)


def _index(argv: list[str]) -> int:
    from api.notify import notify_server
    from index.cli import main as index_main

    return index_main(
        argv,
        evaluator=gate_evaluator,
        calibrator=gate_calibrator,
        on_new_items=_report_duplicates,
        notifier=notify_server,
    )


def _eval(argv: list[str]) -> int:
    if "--text" in argv:  # caption queries: text-to-image gap and recall (search/evaluation/text_eval.py)
        from search.evaluation.eval_args import build_text_parser

        build_text_parser().parse_args(argv)
        from search.evaluation.text_eval import main as text_eval_main

        return text_eval_main(argv)
    from search.evaluation.eval_args import build_parser

    build_parser().parse_args(argv)  # --help and mistakes answered before torch, FAISS or scipy load
    from search.evaluation.evaluate import main as eval_main

    return eval_main(argv)


def _search(argv: list[str]) -> int:
    from search.serving.text_args import build_parser

    build_parser().parse_args(argv)  # --help and mistakes answered before torch or FAISS load
    from search.serving.text import main as search_main

    return search_main(argv)


def _dedup(argv: list[str]) -> int:
    from search.duplicates.dedup_args import build_parser

    build_parser().parse_args(argv)  # --help and mistakes answered before torch, FAISS or PIL load
    from search.duplicates.job import main as dedup_main

    return dedup_main(argv)


def _serve(argv: list[str]) -> int:
    from api.server import main as serve_main

    return serve_main(argv)


EXPERIMENTS = {
    "anneal": (
        "Langevin temperature annealing on a planted InfoNCE landscape (log vs exp vs cosine schedules)"
    ),
}
EXPERIMENT_USAGE = (
    "usage: softsearch experiment NAME [options]\n\nexperiments:\n"
    + "".join(f"  {k:<10} {v}\n" for k, v in EXPERIMENTS.items())
    + "\n`softsearch experiment NAME --help` lists each experiment's options.\n"
)


def _experiment(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(EXPERIMENT_USAGE, end="")
        return 0 if argv else 2
    if argv[0] not in EXPERIMENTS:
        raise ValueError(
            f"unknown experiment {argv[0]!r}; available: {', '.join(EXPERIMENTS)} "
            "(softsearch experiment --help)"
        )
    from training.anneal_args import build_parser

    build_parser().parse_args(argv[1:])  # --help and mistakes answered before torch loads
    from training.anneal_experiment import main as anneal_main

    return anneal_main(argv[1:])


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train,
    "index": _index,
    "eval": _eval,
    "dedup": _dedup,
    "search": _search,
    "serve": _serve,
    "experiment": _experiment,
}


# what to install when a command's heavy dependency is missing (exit code 3)
INSTALL_HINTS = {
    "faiss": "pip install faiss-cpu (or, on a GPU machine, the gpu extra: README 'Install size and GPUs')",
    "torch": "pip install -e . (torch is a core dependency)",
    "torchvision": "pip install -e . (torchvision is a core dependency)",
    "open_clip": "pip install -e . (open_clip_torch is a core dependency)",
    "onnxruntime": "pip install -e . (onnxruntime is a core dependency)",
    "ray": "pip install -e '.[ray]' (the ray extra: Ray Serve and Ray Data, README 'Past one machine')",
}


def main(argv: list[str] | None = None) -> int:
    """Run `softsearch ARGV`; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    try:
        return int(COMMANDS[command](rest) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        # User mistakes (bad paths, bad values) get one line, never a traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        # A missing heavy dependency (a venv without FAISS, say) is an install problem: say which and how.
        if (exc.name or "").split(".")[0] not in INSTALL_HINTS:
            raise
        print(f"error: {exc.name} is not installed; {INSTALL_HINTS[exc.name.split('.')[0]]}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
