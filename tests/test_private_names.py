"""No module reaches into another module's private names: a leading underscore means "this module only".

Scans every module of the project packages and bench/ for `from x import _name` and `x._name` where x is
another project module, so a helper another module needs is made public (and named as such) instead. Tests
are held to the import form only: a test may reach a module's internals through the module object (to
count calls with monkeypatch, say), but never imports a private name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("training", "index", "search", "api", "bench")
SCANNED = (*PROJECT, "tests")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_uses(path: Path, own: str | None = None, attributes: bool = True) -> list[str]:
    """Every private name of another project module used in `path` (`own`: its module name, from its path
    when None; `attributes` False: imported names only, not `module._name`)."""
    own = own or _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}  # local name -> project module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in PROJECT or node.module == own:
                continue
            for alias in node.names:
                if (
                    _private(alias.name)
                    and not (ROOT / Path(*node.module.split("."), f"{alias.name}.py")).exists()
                ):
                    found.append(f"from {node.module} import {alias.name}")
                else:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree) if attributes else ():
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and aliases[node.value.id] != own
        ):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return sorted(set(found))


@pytest.mark.parametrize("package", SCANNED)
def test_no_private_name_crosses_a_module(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    bad = [
        f"{p.relative_to(ROOT)}: {use}"
        for p in files
        for use in private_uses(p, attributes=package != "tests")
    ]
    assert not bad, "private names used outside their module (make them public):\n" + "\n".join(bad)


def test_checker_catches_both_forms(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text(
        "from index.build import _hidden, public\nfrom index import faiss_index\n"
        "from index import _registry_probe\nimport index.gate as g\n"
        "def f():\n    return faiss_index._secret, g._other, public._attr_of_a_value\n"
    )
    assert private_uses(bad, own="index.probe") == [
        "from index import _registry_probe",
        "from index.build import _hidden",
        "index.build.public._attr_of_a_value",
        "index.faiss_index._secret",
        "index.gate._other",
    ]
    assert private_uses(bad, own="tests.probe", attributes=False) == [
        "from index import _registry_probe",
        "from index.build import _hidden",
    ]
    # a module's own private names are its business
    assert private_uses(bad, own="index.build") == [
        "from index import _registry_probe",
        "index.faiss_index._secret",
        "index.gate._other",
    ]
