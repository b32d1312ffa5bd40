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
    bad.write_text("def f():\n    from api.app import create_app\n    import search.gap\n")
    assert imported_packages(bad) == {"api", "search"}
