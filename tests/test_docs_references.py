"""The project's files reference only what a clone has: no path into the workspace outside the repository
(the notes the project was built from are not shipped), and every `docs/theory.md §N` names a real section."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# spelled in pieces so this file does not match itself
OUTSIDE = ("../" + "shared", "papers" + ".md", "seed-" + "abstracts")


def tracked_text_files() -> list[Path]:
    """The files git tracks (the clone's contents); without git, every file outside build output."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / n for n in names.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", "build"}
        paths = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    out = []
    for p in paths:
        try:
            out.append((p, p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files, and files deleted but not yet staged
    return out


def test_no_file_points_outside_the_clone() -> None:
    files = tracked_text_files()
    assert any(p.name == "README.md" for p, _ in files)
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p, text in files
        for n, line in enumerate(text.splitlines(), 1)
        if any(s in line for s in OUTSIDE)
    ]
    assert not hits, "references to files a clone does not have:\n" + "\n".join(hits)


def test_every_theory_section_cited_exists() -> None:
    theory = (ROOT / "docs" / "theory.md").read_text()
    sections = set(re.findall(r"^## §(\d+) ", theory, flags=re.M))
    assert {"1", "2", "3", "4", "5", "6"} <= sections
    cited = {}
    for p, text in tracked_text_files():
        for m in re.finditer(r"docs/theory\.md(?:\)| \(\"[^\"]*\"\))?((?: ?(?:§\d+|, §\d+))*)", text):
            for n in re.findall(r"§(\d+)", m.group(1)):
                cited.setdefault(n, str(p.relative_to(ROOT)))
    assert cited, "nothing cites docs/theory.md"
    missing = {n: where for n, where in cited.items() if n not in sections}
    assert not missing, f"docs/theory.md has no section for these citations: {missing}"
    assert "docs/theory.md" in (ROOT / "README.md").read_text()
