"""Disk full under a store command, on a real small filesystem (a tmpfs mount: needs root).

Each command that cannot fit must end in one `error:` line naming the path, the free space left on
that filesystem (checked against shutil.disk_usage) and the space needed, exit 4 (index/cli.py
STORAGE_FAILED), remove what it staged and leave `current` and every version loadable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from api.cli import main
from index.build import BuildOptions, build_index
from index.cli import STORAGE_FAILED
from index.disk import format_bytes
from index.store import IndexStore
from index.transfer import export_version
from training.datasets import create_dataset


def _mount_tmpfs(path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("a disk-full test needs a small real filesystem: mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the container lacks CAP_SYS_ADMIN")


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs mounted at tmp_path/mnt (unmounted after the test)."""
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "4m")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory, tiny_checkpoint):
    """{root, versions}: a store on the ordinary disk with two activated versions (40 then 60 items)."""
    root = tmp_path_factory.mktemp("disk_full") / "store"
    versions = [
        build_index(
            tiny_checkpoint,
            create_dataset("synthetic", split="train", size=n, seed=0),
            root,
            BuildOptions(progress=False),
        )
        for n in (40, 60)
    ]
    return {"root": root, "versions": versions}


def _fill(mnt, leave: int):
    """Take all but `leave` bytes of the filesystem with a filler file; returns its path."""
    filler = mnt / "filler"
    with open(filler, "ab") as fh:
        fh.write(b"\0" * max(0, shutil.disk_usage(mnt).free - leave))
    return filler


def _run(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["index", *argv])
    return code, capsys.readouterr().err


def _assert_disk_full_line(err: str, mnt) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and len(lines) == 1, err
    line = errors[0]
    assert line.startswith(f"error: no space left on device writing {mnt}/"), line
    free = re.search(r": (\S+ \S+) free on that filesystem", line)
    assert free and free.group(1) == format_bytes(shutil.disk_usage(mnt).free), (line, shutil.disk_usage(mnt))
    return line


def _assert_store_intact(root, capsys, current: str, versions: list[str]) -> None:
    store = IndexStore(root)
    assert store.current_version() == current
    assert store.versions() == versions
    for v in versions:
        assert len(store.load(v, verify=True, gpu=False)) > 0
    assert _run(capsys, "verify", "--all", "--root", str(root))[0] == 0
    leftovers = [p.name for p in (root / "staging").iterdir()]
    assert leftovers == [], f"staging holds {leftovers}"
    tmp = [str(p) for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".incoming-")]
    assert tmp == []


@pytest.mark.parametrize("leave_kib", [0, 40, 80])
def test_build_that_cannot_fit(small_fs, two_versions, tiny_checkpoint, capsys, leave_kib):
    # 0 KiB: fails at the first embedding-cache write; 40: writing index.faiss; 80: writing embeddings.npy
    root = small_fs / "store"
    shutil.copytree(two_versions["root"], root)
    versions = two_versions["versions"]
    filler = _fill(small_fs, leave_kib * 1024)
    argv = [
        "build",
        "--root",
        str(root),
        "--checkpoint",
        str(tiny_checkpoint),
        "--dataset",
        "synthetic",
        "--size",
        "400",
        "--no-progress",
    ]
    code, err = _run(capsys, *argv)
    assert code == STORAGE_FAILED == 4
    line = _assert_disk_full_line(err, small_fs)
    _assert_store_intact(root, capsys, versions[-1], versions)
    # the space it says it needs is enough: free that much and rerun
    needed = re.search(r"about (\S+) (\S+) needed", line)
    assert needed, line
    value, unit = float(needed.group(1)), needed.group(2)
    need = int(value * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}[unit])
    free = shutil.disk_usage(small_fs).free
    os.truncate(filler, max(0, filler.stat().st_size - max(0, need - free)))
    code, err = _run(capsys, *argv)
    assert code == 0, err
    assert len(IndexStore(root).versions()) == 3


def test_import_that_cannot_fit(small_fs, two_versions, tiny_checkpoint, tmp_path, capsys):
    other = tmp_path / "other"
    build_index(
        tiny_checkpoint,
        create_dataset("synthetic", split="test", size=300, seed=1),
        other,
        BuildOptions(progress=False),
    )
    archive = export_version(other, tmp_path / "v.tar")
    root = small_fs / "store"
    shutil.copytree(two_versions["root"], root)
    versions = two_versions["versions"]
    _fill(small_fs, 16 * 1024)
    code, err = _run(capsys, "import", str(archive), "--root", str(root))
    assert code == STORAGE_FAILED
    line = _assert_disk_full_line(err, small_fs)
    assert f"{root}/staging/import-" in line  # the member being written when the disk filled
    assert "needed" in line
    _assert_store_intact(root, capsys, versions[-1], versions)


def _needed(line: str) -> int:
    """The bytes an `error:` line says the operation needed."""
    needed = re.search(r"about (\S+) (\S+) needed", line)
    assert needed, line
    return int(float(needed.group(1)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}[needed.group(2)])


def _free_up_to(mnt, filler, need: int) -> None:
    """Shrink the filler until `need` bytes are free (what the error line told the user to do)."""
    free = shutil.disk_usage(mnt).free
    os.truncate(filler, max(0, filler.stat().st_size - max(0, need - free)))


def test_activate_and_rollback_on_a_full_disk(small_fs, two_versions, capsys):
    """Each says what it needs and what it left: the version not activated / the rollback not made,
    the previous version still serving -- not "staged files removed" (they stage nothing); freeing the
    space it names is enough for the rerun."""
    root = small_fs / "store"
    shutil.copytree(two_versions["root"], root)
    old, new = two_versions["versions"]
    filler = _fill(small_fs, 0)
    for argv in (["activate", old], ["rollback"]):
        code, err = _run(capsys, *argv, "--root", str(root))
        assert code == STORAGE_FAILED, err
        line = _assert_disk_full_line(err, small_fs)
        assert f"{root}/" in err and "staged" not in line
        assert _needed(line) >= 2 * 4096  # the pointer and history.json
        assert line.endswith(
            f"`current` still points at {new}, which keeps serving; free some space and "
            + (
                f"run 'softsearch index activate {old} --root {root}'"
                if argv[0] == "activate"
                else f"rerun 'softsearch index rollback --root {root}'"
            )
        ), line
        assert (
            f"index version {old} was not activated: "
            if argv[0] == "activate"
            else f"the rollback to {old} was not made: "
        ) in line
        _assert_store_intact(root, capsys, new, [old, new])
        assert IndexStore(root).serving_check(new).failed == ()
    _free_up_to(small_fs, filler, _needed(line))
    assert _run(capsys, "rollback", "--root", str(root))[0] == 0
    assert IndexStore(root).current_version() == old
    _fill(small_fs, 0)
    code, err = _run(capsys, "activate", new, "--root", str(root))
    assert code == STORAGE_FAILED and f"`current` still points at {old}, which keeps serving" in err
    filler.unlink()
    assert _run(capsys, "activate", new, "--root", str(root))[0] == 0


def test_a_disk_that_fills_between_the_pointer_and_the_history_puts_the_pointer_back(
    small_fs, two_versions, monkeypatch, capsys
):
    """`current` and history.json are written one after the other: when the disk fills after the free-space
    check (another writer), so that the pointer fits and the longer history does not, the pointer is put
    back -- `current` and its history never disagree."""
    import index.store as store_module

    root = small_fs / "store"
    shutil.copytree(two_versions["root"], root)
    old, new = two_versions["versions"]
    store = IndexStore(root)
    for _ in range(10):  # a history.json of a store in use: longer than one block
        store.rollback(verify=False)
        store.activate(new, verify=False)
    history = (root / "history.json").read_bytes()
    assert len(history) > 4096 and store.current_version() == new
    real = store_module.free_bytes

    def filled_meanwhile(path):
        free = real(path)
        _fill(small_fs, 4096)  # one block left: the pointer's temp file fits, history.json's does not
        return free

    monkeypatch.setattr(store_module, "free_bytes", filled_meanwhile)
    code, err = _run(capsys, "activate", old, "--root", str(root), "--force")
    assert code == STORAGE_FAILED
    line = _assert_disk_full_line(err, small_fs)
    assert line.startswith(
        f"error: no space left on device writing {root}/history.json"
    )  # the pointer got through
    assert f"index version {old} was not activated: `current` still points at {new}" in line
    assert store.current_version() == new and (root / "history.json").read_bytes() == history
    monkeypatch.undo()
    _assert_store_intact(root, capsys, new, [old, new])


def test_gate_records_on_a_full_disk_say_what_they_left(
    small_fs, two_versions, tiny_checkpoint, tmp_path, capsys
):
    """The quality gate result is written into a manifest: at a version's first activation (a committed
    version without one) and in an import's staging before its commit. A full disk there says so, with the
    bytes needed; nothing is activated and the serving version keeps serving."""
    from index.cli import main as index_main
    from index.manifest import read_manifest_json, write_manifest

    root = small_fs / "store"
    shutil.copytree(two_versions["root"], root)
    old, new = two_versions["versions"]
    store = IndexStore(root)
    manifest = read_manifest_json(store.path(old))
    del manifest["quality_gate"]  # as a store written before the gate existed
    write_manifest(store.path(old), manifest)
    fillers = []

    def fills_the_disk(candidate, serving):  # the gate scores, then the disk is full
        fillers.append(_fill(small_fs, 0))
        return {"metric": "score", "candidate": 0.5, "serving": 0.5}

    capsys.readouterr()
    assert index_main(["activate", old, "--root", str(root)], evaluator=fills_the_disk) == STORAGE_FAILED
    line = _assert_disk_full_line(capsys.readouterr().err, small_fs)
    assert line.startswith(f"error: no space left on device writing {store.path(old)}/manifest.json")
    assert line.endswith(
        f"the quality gate result of {old} was not recorded and it was not activated: `current` "
        f"still points at {new}, which keeps serving; free some space and rerun"
    ), line
    assert _needed(line) > len(json.dumps(manifest)) and "staged" not in line
    assert store.manifest(old).quality_gate is None
    _assert_store_intact(root, capsys, new, [old, new])
    fillers.pop().unlink()

    other = tmp_path / "other"
    imported = build_index(
        tiny_checkpoint,
        create_dataset("synthetic", split="test", size=30, seed=1),
        other,
        BuildOptions(progress=False),
    )
    archive = export_version(other, tmp_path / "v.tar")
    capsys.readouterr()
    assert (
        index_main(["import", str(archive), "--root", str(root)], evaluator=fills_the_disk) == STORAGE_FAILED
    )
    line = _assert_disk_full_line(capsys.readouterr().err, small_fs)
    assert line.startswith(f"error: no space left on device writing {root}/staging/import-")
    assert line.endswith(
        f"the import of {imported} stopped before its commit: nothing of it is in versions/ and "
        f"`current` still points at {new}, which keeps serving; free some space and rerun the "
        "import"
    ), line
    assert _needed(line) >= 3 * 4096 and "staged files were removed" not in line
    _assert_store_intact(root, capsys, new, [old, new])
    fillers.pop().unlink()
    assert (
        index_main(
            ["import", str(archive), "--root", str(root)],
            evaluator=lambda c, s: {"metric": "score", "candidate": 0.5, "serving": 0.5},
        )
        == 0
    )
    assert store.current_version() == imported


def test_other_os_errors_name_the_path(tmp_path, two_versions, capsys):
    """Not only a full disk: a store on a read-only filesystem gives one line with the path and exit 4."""
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "4m")
    try:
        shutil.copytree(two_versions["root"], ro / "store")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        old, new = two_versions["versions"]
        code, err = _run(capsys, "activate", old, "--root", str(ro / "store"))
        assert code == STORAGE_FAILED and "Traceback" not in err
        lines = err.strip().splitlines()
        assert (
            len(lines) == 1
            and lines[0].startswith("error: Read-only file system [EROFS]: ")
            and str(ro / "store") in lines[0]
        ), err
        assert IndexStore(ro / "store").current_version() == new
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_each_writer_reports_a_full_disk_as_DiskFull(small_fs):
    """The libraries under the store each report a full disk their own way (ENOSPC, numpy's short write
    without an errno, FAISS's RuntimeError, safetensors' SafetensorError); `writing` names the path
    and the space needed for every one of them, and leaves other errors alone."""
    import faiss
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from index.disk import DiskFull, writing

    _fill(small_fs, 0)
    big = np.ones((20000, 16), np.float32)  # 1.2 MiB: cannot fit

    def plain(path):
        with open(path, "wb") as fh:
            fh.write(big.tobytes())

    def numpy_save(path):
        with open(path, "wb") as fh:
            np.save(fh, big)

    def faiss_write(path):
        index = faiss.IndexFlatIP(16)
        index.add(big)
        faiss.write_index(index, str(path))

    def safetensors_save(path):
        save_file({"w": torch.from_numpy(big)}, str(path))

    for write in (plain, numpy_save, faiss_write, safetensors_save):
        path = small_fs / f"{write.__name__}.bin"
        with pytest.raises(DiskFull) as info, writing(path, needed=big.nbytes):
            write(path)
        assert info.value.filename == str(path) and info.value.needed == big.nbytes, write.__name__
        path.unlink(missing_ok=True)
    with pytest.raises(ValueError, match="not a disk problem"), writing(small_fs / "x"):
        raise ValueError("not a disk problem")
