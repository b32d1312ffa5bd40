"""The top-level `softsearch` dispatcher: help, unknown commands and user errors are one line, exit 2."""
from __future__ import annotations

import subprocess
import sys

from api.cli import COMMANDS, main


def test_help_lists_every_command(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


def test_no_arguments_is_a_usage_error(capsys) -> None:
    assert main([]) == 2
    assert "usage: softsearch" in capsys.readouterr().out


def test_unknown_command_is_one_line(capsys) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown command 'frobnicate'") and "\n" not in err


def test_unknown_experiment_is_one_line(capsys) -> None:
    assert main(["experiment", "melt"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown experiment")


def test_console_script_missing_config_exits_2_without_traceback(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "api.cli", "train", "--config", str(tmp_path / "nope.toml")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "nope.toml" in proc.stderr
