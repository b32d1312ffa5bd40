"""Filesystem failures of store writes, told in one line: which path, and for a full disk the space
left on that filesystem and roughly the space the operation needed (`softsearch index` exits 4).

Writers wrap their writes in `writing(path, needed)`: a full disk becomes `DiskFull` (an OSError
naming the path and the bytes needed) whichever way the library underneath reports it -- ENOSPC /
EDQUOT, numpy's short write without an errno, FAISS's RuntimeError, safetensors' SafetensorError --
and any other OSError without a file name gets `path`. `describe` turns one into the CLI's `error:` line,
ending with what the failed operation left (its `outcome`: a build's staging removed, an activation not made,
...).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

#: errno values that mean "out of space" (a quota included)
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SPACE_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


#: what a full disk left behind, when the writer says nothing else: a build or import removes its staging
STAGED_OUTCOME = "its staged files were removed and `current` is unchanged: free some space and rerun"


class DiskFull(OSError):
    """A write under `filename` ran out of space; `needed`: bytes the whole operation needs (None: unknown);
    `outcome`: what the failed operation left, for the user (None: STAGED_OUTCOME)."""

    def __init__(self, path, needed: int | None = None, outcome: str | None = None):
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.needed = needed
        self.outcome = outcome


def is_space_error(err: BaseException) -> bool:
    """Does `err` say the filesystem (or a quota) is full?"""
    if isinstance(err, OSError):
        text = str(err)
        # numpy's ndarray.tofile reports a short write with no errno: "N requested and M written"
        return err.errno in SPACE_ERRNOS or (
            err.errno is None and "requested and" in text and "written" in text
        )
    # FAISS's file writer: RuntimeError "... write error in PATH: a != b (No space left on device)";
    # safetensors: SafetensorError "... IoError(Os { code: 28, kind: StorageFull, ... })"
    return isinstance(err, Exception) and (
        any(t in str(err) for t in _SPACE_TEXTS) or "StorageFull" in str(err)
    )


@contextlib.contextmanager
def writing(path, needed: int | None = None, outcome: str | None = None):
    """Re-raise a full disk inside as DiskFull(path, needed, outcome) and name `path` in an OSError that
    names no file. Nested uses keep the innermost path and `outcome`, and the largest `needed`."""
    try:
        yield
    except DiskFull as err:
        if needed is not None and (err.needed or 0) < needed:
            err.needed = int(needed)
        if err.outcome is None:
            err.outcome = outcome
        raise
    except Exception as err:  # noqa: BLE001 - only a full disk is translated; everything else re-raised as is
        if is_space_error(err):
            where = err.filename if isinstance(err, OSError) and err.filename else path
            raise DiskFull(where, needed, outcome) from err
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


#: filesystem block: every file takes whole blocks
BLOCK = 4096


def on_disk(nbytes: int) -> int:
    """Bytes a file of `nbytes` takes on disk: rounded up to whole blocks."""
    return -(-int(nbytes) // BLOCK) * BLOCK


def free_bytes(path) -> int | None:
    """Free bytes (for an unprivileged user) on the filesystem holding `path` or its nearest existing
    parent."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def format_bytes(n: int | None) -> str:
    """1536 -> '1.5 KiB'."""
    if n is None:
        return "unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe(err: OSError, root=None) -> str:
    """One line for `err` (no 'error:' prefix): the path (else `root`), and for a full disk the free space
    there now and the space the operation needed, when known."""
    path = err.filename or root
    if is_space_error(err):
        needed = getattr(err, "needed", None)
        text = (
            f"no space left on device writing {path}: {format_bytes(free_bytes(path or '.'))} free on that "
            "filesystem"
        )
        if needed:
            text += f", about {format_bytes(needed)} needed"
        return f"{text}; {getattr(err, 'outcome', None) or STAGED_OUTCOME}"
    code = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    reason = err.strerror or str(err)
    return f"{reason}{f' [{code}]' if code else ''}: {path}" + (
        f" -> {err.filename2}" if err.filename2 else ""
    )
