"""Even keep-alive connections across `serve --workers N` processes.

uvicorn's workers accept from one shared socket, and whichever wakes first takes a burst: 16 connections
were seen split 2 / 14 to 8 / 8, and the worker holding more serves its clients from one core while the
other idles (docs/results.md §30). Here each worker publishes its open connection count in a small shared
file (`ConnectionShare`: one (pid, count) slot per worker), and a worker holding more than its share,
ceil(all open connections / N), answers its next response with `Connection: close`
(`BalanceConnections`); the client reconnects and the shared socket places it again. Connections already
told to close are not counted, so one surplus closes one connection; a lone client is never closed.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Slots in the file: workers restarted by uvicorn take a free slot (a dead pid's) again.
SLOTS = 64
_SLOT = 16  # bytes: pid, count (int64 each)
FILE_NAME = "connections.bin"


class ConnectionShare:
    """This process's slot in the shared connection-count file at `path` (made by the supervisor,
    `create`), and the counts of all `workers` processes."""

    def __init__(self, path: str | os.PathLike, workers: int, pid: int | None = None):
        self.workers, self.pid = int(workers), os.getpid() if pid is None else int(pid)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SLOTS * _SLOT)
            fcntl.flock(fd, fcntl.LOCK_EX)  # claim a slot: free (pid 0) or a dead process's
            try:
                self._view = memoryview(self._map).cast("q")
                self.slot = self._claim()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self.closing: set = set()  # clients of this process told to close (not counted as its own)

    @staticmethod
    def create(directory: str | os.PathLike) -> Path:
        """The zeroed file in `directory` (the supervisor, before it starts the workers)."""
        path = Path(directory) / FILE_NAME
        path.write_bytes(bytes(SLOTS * _SLOT))
        return path

    def _claim(self) -> int:
        view, me = self._view, self.pid
        for slot in range(SLOTS):
            pid = view[2 * slot]
            if pid == me or pid == 0 or not _alive(pid):
                view[2 * slot], view[2 * slot + 1] = me, 0
                return slot
        raise RuntimeError(f"no free slot in the connection-count file ({SLOTS} taken by live processes)")

    def publish(self, count: int) -> None:
        """This process now holds `count` open connections."""
        self._view[2 * self.slot + 1] = int(count)

    def total(self) -> int:
        return sum(self._view[1::2])

    def over_share(self) -> bool:
        """Whether this process holds more open connections (less those told to close) than its share."""
        own = self._view[2 * self.slot + 1] - len(self.closing)
        return own > math.ceil(self.total() / self.workers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BalanceConnections:
    """ASGI wrapper: a response goes out with `Connection: close` while this worker is over its share of
    the workers' open connections (`ConnectionShare.over_share`), its client remembered as closing until
    the connection is gone (`connection_gone`, from the protocol)."""

    def __init__(self, app: ASGIApp, share: ConnectionShare):
        self.app, self.share = app, share

    def __getattr__(self, name):  # app.state, app.router ... (the wrapped app's)
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        share, client = self.share, scope.get("client")

        async def balanced_send(message: Message) -> None:
            if (
                message["type"] == "http.response.start"
                and client is not None
                and client not in share.closing
                and share.over_share()
            ):
                share.closing.add(client)
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, balanced_send)


#: This process's share, when it is one of several workers (set by api.server.worker_app).
SHARE: ConnectionShare | None = None


def connections_changed(count: int, client=None) -> None:
    """The protocol's hook: this process now holds `count` connections; `client` (host, port) is gone."""
    if SHARE is not None:
        if client is not None:
            SHARE.closing.discard(client)
        SHARE.publish(count)
