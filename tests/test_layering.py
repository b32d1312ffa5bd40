"""The import direction training <- index <- search <- api is enforced by walking every module's AST."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["training", "index", "search", "api"]


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages imported anywhere in a module (including inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in ORDER)
    return found


@pytest.mark.parametrize("package", ORDER)
def test_imports_flow_left_to_right(package: str) -> None:
    allowed = set(ORDER[: ORDER.index(package) + 1])
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no modules"
    violations = [
        f"{path.relative_to(ROOT)} imports {sorted(imported_packages(path) - allowed)}"
        for path in files
        if imported_packages(path) - allowed
    ]
    assert not violations, "imports must flow training <- index <- search <- api:\n" + "\n".join(violations)


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from api.app import create_app\n    import search.evaluation.gap\n")
    assert imported_packages(bad) == {"api", "search"}


#: Every package a server process imports (the app, its routes and CLI, the searcher, the duplicates routes).
SERVER_PACKAGES = ("api", "search.serving", "search.duplicates")
#: The training modules a server may load: the model and its input (image encoder, its checkpoint, the
#: preprocessing and image decoding, the text tower) and the argparse helper every CLI shares.
SERVER_TRAINING = {
    "training",
    "training.encoder",
    "training.checkpoint",
    "training.transforms",
    "training.images",
    "training.text",
    "training.cli_parser",
}


def test_search_serving_and_evaluation_never_import_each_other() -> None:
    """search.serving and search.duplicates are what a server loads and search.evaluation is offline
    measurement: evaluation imports neither, and neither imports it (plots: the neutral search.figures)."""
    bad = []
    for half, other in (
        ("serving", "evaluation"),
        ("duplicates", "evaluation"),
        ("evaluation", "serving"),
        ("evaluation", "duplicates"),
    ):
        files = sorted((ROOT / "search" / half).rglob("*.py"))
        assert files, half
        for path in files:
            for node in ast.walk(ast.parse(path.read_text())):
                mods = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                )
                bad += [
                    f"{path.relative_to(ROOT)} imports {m}" for m in mods if m.startswith(f"search.{other}")
                ]
    assert not bad, "\n".join(bad)


def test_a_serving_process_loads_no_evaluation_module() -> None:
    """What `softsearch serve` imports (the app, its CLI, the swapper) pulls in no search.evaluation
    module."""
    import subprocess
    import sys

    code = (
        "import sys, api.app, api.cli, api.swap, api.batching; "
        "print(sorted(m for m in sys.modules if m.startswith('search.evaluation')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_serving_process_loads_only_the_model_from_training() -> None:
    """Every module of every package a server imports, loaded in a fresh interpreter: the search packages it
    pulls in are SERVER_PACKAGES (so a new one must be added there, and is then covered), no search.evaluation
    module, and of training only SERVER_TRAINING (not the trainer, its losses, schedules or datasets)."""
    import subprocess
    import sys

    code = (
        "import importlib, json, pkgutil, sys\n"
        f"for name in {list(SERVER_PACKAGES)!r}:\n"
        "    pkg = importlib.import_module(name)\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, name + '.'):\n"
        "        try:\n"
        "            importlib.import_module(m.name)\n"
        "        except ModuleNotFoundError as err:\n"
        "            if err.name.split('.')[0] in ('training', 'index', 'search', 'api'):\n"
        "                raise\n"  # an optional third-party package (e.g. ray) may be absent
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('training', 'search'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(__import__("json").loads(out.stdout))
    assert "search.duplicates.page" in loaded and "search.serving.searcher" in loaded, sorted(
        loaded
    )  # it ran
    assert not {m for m in loaded if m.startswith("search.evaluation")}, sorted(loaded)
    search = {".".join(m.split(".")[:2]) for m in loaded if m.startswith("search.")}
    assert search <= {*SERVER_PACKAGES, "search.figures"}, f"add to SERVER_PACKAGES: {sorted(search)}"
    training = {m for m in loaded if m.split(".")[0] == "training"}
    assert training <= SERVER_TRAINING, (
        f"a server loads training modules beyond the model: {sorted(training - SERVER_TRAINING)}"
    )
