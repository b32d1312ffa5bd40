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


def test_experiment_help_lists_experiments(capsys) -> None:
    from api.cli import EXPERIMENTS

    assert main(["experiment", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXPERIMENTS) and "anneal" in out
    assert main(["experiment"]) == 2 and "usage: softsearch experiment" in capsys.readouterr().out


def test_help_shows_defaults(capsys) -> None:
    """index build states its shard size; train lists every schedule's options with their defaults."""
    for argv in (["index", "build", "--help"], ["train", "--help"]):
        try:
            rc = main(argv)
        except SystemExit as exit_:  # argparse's --help
            rc = exit_.code
        assert rc in (0, None)
    out = capsys.readouterr().out
    assert "(default 8192)" in out
    assert "cosine     tau_min = 0.1, tau_max = 1.0, period = 400.0" in out
    assert "schedule_options={tau_min" in out


def test_switching_schedule_hints_at_replacing_its_options(capsys) -> None:
    """configs/tiny.toml sets schedule_options = {tau = 0.2}; cosine does not take tau."""
    assert (
        main(
            [
                "train",
                "--config",
                "configs/tiny.toml",
                "--set",
                'schedule="cosine"',
                "--set",
                "steps=1",
                "--set",
                'out_dir="/nonexistent/never-written"',
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'cosine' takes tau_min, tau_max, period" in err
    assert "--set 'schedule_options={tau_min = 0.1, tau_max = 1.0, period = 400.0}'" in err


def test_console_script_missing_config_exits_2_without_traceback(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "api.cli", "train", "--config", str(tmp_path / "nope.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "nope.toml" in proc.stderr


def test_serve_refuses_a_missing_index_and_a_busy_port_before_loading_anything(tmp_path, capsys) -> None:
    """Both fail at once with one line and exit 2: no model is loaded, no server keeps running unready."""
    import socket

    assert main(["serve", "--index", str(tmp_path / "typo"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --index") and "does not exist" in err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--index", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in err


def test_store_commands_on_a_typo_or_a_file_are_one_line(tmp_path) -> None:
    """`index list|verify --root <typo>` and `eval --index <a file>` exit 2 with one `error:` line."""
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    for argv in (
        ["index", "list", "--root", str(tmp_path / "typo")],
        ["index", "verify", "--root", str(afile)],
        ["eval", "--index", str(afile), "--out", str(tmp_path / "e")],
    ):
        out = subprocess.run([sys.executable, "-m", "api.cli", *argv], capture_output=True, text=True)
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
        assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, (argv, out.stderr)
        assert "index root" in lines[0]
    assert not (tmp_path / "typo").exists()  # a typo creates nothing


def test_help_of_eval_serve_and_every_index_command_loads_no_torch() -> None:
    """--help builds only the parser: no torch, open_clip or scipy (measured 0.1-0.3 s vs ~2 s with them)."""
    import json

    subs = [
        "build",
        "rebuild",
        "add",
        "sync",
        "delete",
        "list",
        "activate",
        "rollback",
        "verify",
        "prune",
        "gc",
        "export",
        "import",
    ]
    cases = [["eval", "--help"], ["serve", "--help"]] + [["index", s, "--help"] for s in subs]
    code = (
        "import json, sys\nfrom api.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
        "    try:\n        main(argv)\n"
        "    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
        "print('LOADED', sorted(m for m in ('torch', 'open_clip', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "LOADED []"


def test_a_missing_faiss_is_one_line_naming_the_package(tmp_path) -> None:
    """A venv without FAISS (None in sys.modules makes `import faiss` fail as if absent): exit 3, one line."""
    code = (
        "import sys; sys.modules['faiss'] = None\n"
        "from api.cli import main\n"
        f"sys.exit(main(['index', 'list', '--root', {str(tmp_path / 'store')!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    err = proc.stderr.strip()
    assert proc.returncode == 3, proc.stderr
    assert err.startswith("error: faiss is not installed; pip install faiss-cpu") and "\n" not in err
    assert "Traceback" not in proc.stderr
