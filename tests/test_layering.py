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


def test_search_serving_and_evaluation_never_import_each_other() -> None:
    """search.serving is what a server loads and search.evaluation is offline measurement: neither
    imports the other, so a server process never loads the evaluation stack."""
    bad = []
    for half, other in (("serving", "evaluation"), ("evaluation", "serving")):
        files = sorted((ROOT / "search" / half).rglob("*.py"))
        assert files, half
        for path in files:
            for node in ast.walk(ast.parse(path.read_text())):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                bad += [f"{path.relative_to(ROOT)} imports {m}" for m in mods if m.startswith(f"search.{other}")]
    assert not bad, "\n".join(bad)


def test_a_serving_process_loads_no_evaluation_module() -> None:
    """What `softsearch serve` imports (the app, its CLI, the swapper) pulls in no search.evaluation module."""
    import subprocess
    import sys

    code = ("import sys, api.app, api.cli, api.swap, api.batching; "
            "print(sorted(m for m in sys.modules if m.startswith('search.evaluation')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
