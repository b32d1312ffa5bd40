"""Every `softsearch` command parses its arguments before loading anything heavy: `--help` and a mistyped
flag are answered without torch, FAISS, open_clip (or numpy, PIL, scipy, FastAPI), and a mistyped flag is one
`error:` line with exit 2. The test checks what the parser imports (sys.modules), not a clock."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = (
    "torch",
    "faiss",
    "open_clip",
    "torchvision",
    "scipy",
    "onnxruntime",
    "numpy",
    "PIL",
    "matplotlib",
    "fastapi",
    "uvicorn",
    "training.trainer",
)

# One child process runs every case in turn and reports, per case, its exit code, its stderr and the heavy
# modules present after it: a case that loads one is named (the later ones then show it too).
CHILD = r"""
import contextlib, io, json, sys
from api.cli import COMMANDS, EXPERIMENTS, main
from index.cli import build_parser

heavy = json.loads(sys.argv[1])
index_subs = sorted(next(a for a in build_parser()._actions if a.dest == "command").choices)
commands = []
for name in COMMANDS:
    if name == "index":
        commands += [["index"]] + [["index", s] for s in index_subs]
    elif name == "experiment":
        commands += [["experiment", e] for e in EXPERIMENTS]
    else:
        commands.append([name])
rows = []
for cmd in commands:
    for flag in ("--help", "--no-such-flag"):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(cmd + [flag])
            except SystemExit as exc:
                rc = exc.code
        rows.append({"argv": cmd + [flag], "rc": rc, "out": out.getvalue(), "err": err.getvalue(),
                     "loaded": [m for m in heavy if m in sys.modules]})
print(json.dumps(rows))
"""


def _run_every_command() -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(HEAVY)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_command_parses_before_loading_torch_or_faiss() -> None:
    rows = _run_every_command()
    argvs = [" ".join(r["argv"]) for r in rows]
    # every command and index sub-command is covered (the list is read from the parsers, so a new one joins)
    for needed in (
        "train --help",
        "eval --help",
        "dedup --help",
        "serve --help",
        "experiment anneal --help",
        "index build --help",
        "index import --help",
        "index gc --help",
        "train --no-such-flag",
        "index build --no-such-flag",
        "eval --no-such-flag",
        "dedup --no-such-flag",
    ):
        assert needed in argvs, needed
    first_heavy = next((r for r in rows if r["loaded"]), None)
    assert first_heavy is None, f"`softsearch {' '.join(first_heavy['argv'])}` loaded {first_heavy['loaded']}"
    for r in rows:
        name = "softsearch " + " ".join(r["argv"])
        if r["argv"][-1] == "--help":
            assert r["rc"] == 0 and "usage: softsearch" in r["out"], (name, r)
            assert "--help" in r["out"], name
        else:
            lines = r["err"].splitlines()
            assert r["rc"] == 2, (name, r)
            assert len(lines) == 1 and lines[0].startswith("error: "), (name, r["err"])
            assert "usage:" not in r["err"], name


def test_a_mistyped_flag_names_the_flag_and_where_help_is() -> None:
    import contextlib
    import io

    from api.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(["train", "--confg", "configs/synthetic.toml"])
        except SystemExit as exc:
            rc = exc.code
    assert rc == 2
    assert err.getvalue() == (
        "error: softsearch train: unrecognized arguments: --confg configs/synthetic.toml "
        "(`softsearch train --help` lists the options)\n"
    )


def test_train_help_lists_the_registered_schedules_with_their_defaults() -> None:
    """train --help prints the schedule table without torch; it must equal what the registry describes."""
    from training.schedules import describe_schedules
    from training.train_args import SCHEDULE_HELP, build_parser

    assert SCHEDULE_HELP == describe_schedules()
    assert SCHEDULE_HELP in build_parser().format_help()


def test_training_names_still_resolve_lazily() -> None:
    """training/__init__ exports its public names on first use (the package import itself loads no torch)."""
    import training
    from training.trainer import train
    from training.weince import WEINCELoss

    assert training.train is train and training.WEINCELoss is WEINCELoss
    for name in training.__all__:
        assert getattr(training, name) is not None, name
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, training; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip() == "False", proc.stderr
