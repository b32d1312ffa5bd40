"""kill -9 at random points of `softsearch index build | sync | import | activate | prune` (real
subprocesses), then a rerun: the store verifies, `current` is what the rerun says, and after
`index gc --max-age-s 0` nothing is left over.

"Random points" are the command's own filesystem writes under the store (opens for writing, renames,
removals, mkdirs: Python audit events): a dry run of the same command on a copy of the store counts
them, and the killed run sends itself SIGKILL at a seeded random one of them, so every kill lands in
the middle of the command's store work, never in its imports."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from chaos_hook import is_store_write

from api.cli import main as cli_main
from index.store import IndexStore

REPO = Path(__file__).resolve().parents[2]
VERSION_RE = re.compile(r"\d{8}T\d{9}Z-[0-9a-f]{8}")
SEED = 26
KILLS_PER_COMMAND = 2

#: the audit hook, counting writes under `root` when set (in-process dry runs); hooks cannot be removed
_COUNTING: dict = {}


def _count_hook(event: str, args: tuple) -> None:
    if _COUNTING and is_store_write(event, args, _COUNTING["root"]):
        _COUNTING["n"] += 1


sys.addaudithook(_count_hook)

# the killed run: api.cli's `index` command with the same hook, SIGKILL at the n-th store write
_KILLER = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO / "tests" / "index")!r})
root, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
from chaos_hook import is_store_write
seen = [0]
def hook(event, args):
    if is_store_write(event, args, root):
        seen[0] += 1
        if seen[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
from api.cli import main
sys.exit(main(argv))
"""


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _argv(command: list[str], root: Path) -> list[str]:
    return ["index", *command, "--root", str(root)]


def _count_writes(command: list[str], root: Path, scratch: Path, capsys) -> int:
    """Store writes of `command` in a dry run on a copy of the store at `root`."""
    copy = scratch / "dry"
    shutil.rmtree(copy, ignore_errors=True)
    if root.exists():
        shutil.copytree(root, copy, symlinks=True)
    _COUNTING.update(root=str(copy), n=0)
    try:
        code = cli_main(_argv(command, copy))
    finally:
        n = _COUNTING["n"]
        _COUNTING.clear()
    out = capsys.readouterr()
    assert code == 0, out.err
    shutil.rmtree(copy)
    return n


def _killed_run(command: list[str], root: Path, at: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(root), str(at), *_argv(command, root)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, (command, at, proc.returncode, proc.stderr[-2000:])


def _leftovers(root: Path) -> list[str]:
    """Paths under the store that no finished command leaves: staging entries, temporary files, trash."""
    staged = [p.name for p in (root / "staging").iterdir()] if (root / "staging").is_dir() else []
    junk = [
        str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name or p.name.startswith(".trash-")
    ]
    return staged + junk


@pytest.mark.slow
def test_kill_9_at_random_points_then_rerun(
    tmp_path, tiny_checkpoint, other_checkpoint, make_image_folder, capsys
):
    rng = random.Random(SEED)
    photos = make_image_folder(tmp_path / "photos", count=24, classes=3, size=32)
    root = tmp_path / "store"
    # the archive to import: a version of another encoder over another folder
    elsewhere = tmp_path / "elsewhere"
    assert (
        cli_main(
            [
                "index",
                "build",
                "--root",
                str(elsewhere),
                "--checkpoint",
                str(other_checkpoint),
                "--dataset",
                "folder",
                "--data-root",
                str(make_image_folder(tmp_path / "other", count=12, classes=2, size=32, seed=1)),
            ]
        )
        == 0
    )
    archive = tmp_path / "v.tar"
    assert cli_main(["index", "export", "--root", str(elsewhere), "--out", str(archive)]) == 0
    capsys.readouterr()
    store = IndexStore(root)
    build = ["build", "--checkpoint", str(tiny_checkpoint), "--dataset", "folder", "--data-root", str(photos)]

    def change_folder():
        for p in sorted(photos.rglob("*.png"))[:2]:
            p.unlink()
        make_image_folder(tmp_path / "more", count=3, classes=1, size=32, seed=7)
        for i, p in enumerate(sorted((tmp_path / "more").rglob("*.png"))):
            shutil.copy(p, photos / p.parent.name / f"new{i}.png")

    steps = [
        ("build", build, None),
        ("sync", ["sync", "--data-root", str(photos)], change_folder),
        ("import", ["import", str(archive), "--force"], None),
        ("activate", None, None),
        ("prune", ["prune", "--keep", "1"], None),
    ]
    kills, left_by_kills = [], 0
    for name, command, before in steps:
        if before is not None:
            before()
        if name == "activate":  # back to the first version this store built
            command = ["activate", store.versions()[0], "--force"]
        current_before = store.current_version() if root.exists() else None
        for _ in range(KILLS_PER_COMMAND):  # killed, then killed again on what the first kill left
            store_writes = _count_writes(command, root, tmp_path, capsys)
            assert store_writes > 3, (name, store_writes)
            at = rng.randint(1, store_writes)
            _killed_run(command, root, at)
            kills.append((name, at, store_writes))
        at = [k[1] for k in kills[-KILLS_PER_COMMAND:]]

        # the rerun finishes the job
        assert cli_main(_argv(command, root)) == 0, (name, at)
        out = capsys.readouterr().out
        named = VERSION_RE.findall(out)
        if name == "prune":
            assert store.current_version() == current_before, (name, at, out)
        else:
            assert named and store.current_version() == named[0], (name, at, out)
            assert "not activated" not in out, (name, at, out)
        assert cli_main(["index", "verify", "--all", "--root", str(root)]) == 0, (
            name,
            at,
            capsys.readouterr(),
        )
        left_by_kills += len(_leftovers(root))
        assert cli_main(["index", "gc", "--max-age-s", "0", "--root", str(root)]) == 0
        capsys.readouterr()
        assert _leftovers(root) == [], (name, at)
        store.load(verify=True, gpu=False)
    assert store.current_version() in store.versions()
    print("kills (command, at write, of writes):", kills, "; leftovers gc removed:", left_by_kills)
