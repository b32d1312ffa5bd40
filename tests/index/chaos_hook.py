"""The audit-hook test of tests/index/test_chaos_slow.py: does an audit event write under `root`?
(A module of its own: the killed subprocess imports it without pytest.)"""

from __future__ import annotations

import os

#: Python audit events that change the filesystem (an "open" only when it opens for writing)
WRITE_EVENTS = frozenset(
    {
        "open",
        "os.rename",
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "shutil.rmtree",
        "os.symlink",
        "os.truncate",
        "os.chmod",
    }
)


def is_store_write(event: str, args: tuple, root: str) -> bool:
    if event not in WRITE_EVENTS or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return False
    if not os.fsdecode(args[0]).startswith(root):
        return False
    if event == "open":
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 else 0
        if isinstance(mode, str):
            return any(c in mode for c in "wax+")
        return bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    return True
