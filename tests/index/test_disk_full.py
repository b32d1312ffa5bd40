"""Disk full under a store command, on a real small filesystem (a tmpfs mount: needs root).

Each command that cannot fit must end in one `error:` line naming the path, the free space left on
that filesystem (checked against shutil.disk_usage) and the space needed, exit 4 (index/cli.py
STORAGE_FAILED), remove what it staged and leave `current` and every version loadable.
"""
from __future__ import annotations

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
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
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
    versions = [build_index(tiny_checkpoint, create_dataset("synthetic", split="train", size=n, seed=0), root,
                            BuildOptions(progress=False)) for n in (40, 60)]
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
    argv = ["build", "--root", str(root), "--checkpoint", str(tiny_checkpoint), "--dataset", "synthetic",
            "--size", "400", "--no-progress"]
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
    build_index(tiny_checkpoint, create_dataset("synthetic", split="test", size=300, seed=1), other,
                BuildOptions(progress=False))
    archive = export_version(other, tmp_path / "v.tar")
    root = small_fs / "store"
    shutil.copytree(two_versions["root"], root)
    versions = two_versions["versions"]
    _fill(small_fs, 16 * 1024)
    code, err = _run(capsys, "import", str(archive), "--root", str(root))
    assert code == STORAGE_FAILED
    line = _assert_disk_full_line(err, small_fs)
    assert f"{root}/staging/import-" in line          # the member being written when the disk filled
    assert "needed" in line
    _assert_store_intact(root, capsys, versions[-1], versions)


def test_activate_and_rollback_on_a_full_disk(small_fs, two_versions, capsys):
    root = small_fs / "store"
    shutil.copytree(two_versions["root"], root)
    old, new = two_versions["versions"]
    filler = _fill(small_fs, 0)
    for argv in (["activate", old], ["rollback"]):
        code, err = _run(capsys, *argv, "--root", str(root))
        assert code == STORAGE_FAILED, err
        _assert_disk_full_line(err, small_fs)
        assert f"{root}/" in err
        _assert_store_intact(root, capsys, new, [old, new])
    filler.unlink()
    assert _run(capsys, "rollback", "--root", str(root))[0] == 0
    assert IndexStore(root).current_version() == old


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
        assert len(lines) == 1 and lines[0].startswith("error: Read-only file system [EROFS]: ") \
            and str(ro / "store") in lines[0], err
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
    big = np.ones((20000, 16), np.float32)                   # 1.2 MiB: cannot fit

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
