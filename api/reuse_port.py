"""`serve --workers N` with one listening socket per worker (SO_REUSEPORT), so the kernel spreads connections.

uvicorn's supervisor binds one socket and hands it to every worker. Each worker's event loop, woken by a
new connection, accepts every connection waiting at that moment, so a burst of keep-alive connections
(16 clients opening at once) lands mostly on one worker while the other idles: at 16 clients two workers
answered no more than one (docs/results.md §30). Here the supervisor binds the address with SO_REUSEPORT
but never listens on it (it only holds the port, so `--port 0` resolves once); each worker opens its own
SO_REUSEPORT socket on that address and listens, and the kernel hashes each new connection to one
worker's queue. Everything else is uvicorn's supervisor (health pings, restarts, signals).
"""

from __future__ import annotations

import socket

from uvicorn.supervisors import multiprocess


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEADDR and SO_REUSEPORT, not listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class ReusePortProcess(multiprocess.Process):
    """A uvicorn worker that serves on its own SO_REUSEPORT socket at the supervisor's address."""

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # pragma: no cover - in the child
        own = []
        for held in sockets or []:
            host, port = held.getsockname()[:2]
            own.append(reuse_port_socket(host, port))
            held.close()  # the supervisor's copy: never listened on, so it takes no connections
        super().target(own)


def run_workers(config, host: str, port: int) -> None:
    """uvicorn's supervisor over `config` (workers > 1), each worker on its own SO_REUSEPORT socket."""
    sock = reuse_port_socket(host, port)
    # the supervisor builds its workers through this module global; this process only supervises
    multiprocess.Process = ReusePortProcess  # type: ignore[misc]
    try:
        multiprocess.Multiprocess(config, sockets=[sock]).run()
    finally:
        sock.close()
