"""Start a server in a subprocess, wait until it is ready, stop it: the one launcher tests and bench use.

`serve_process(root, *args)` runs `softsearch serve --index ROOT` (the command a user runs) on a free
loopback port; `server_process(argv, port)` runs any server command (bench/plain_server.py too). Both
yield a `ServerProcess` once its ready check answers (`/readyz` 200 by default) and stop it on exit
(signal, then kill after `stop_timeout_s`). A server that exits or does not become ready within
`timeout_s` raises RuntimeError with the tail of its output. Output goes to `log_path` (a temporary
file when none is given), never to a pipe nobody drains.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

#: The repository root: the child imports the same code as the caller.
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Characters of the server's output a start-up failure quotes.
LOG_TAIL = 4000


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A started server: `url` (http://127.0.0.1:PORT), `proc` (its Popen; `returncode` after the
    block), `log_path`, `ready_s` (start to ready)."""

    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    ready_s: float = float("nan")
    argv: list[str] = field(default_factory=list)

    @property
    def log(self) -> str:
        """The server's output (stdout and stderr) so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def log_tail(self, chars: int = LOG_TAIL) -> str:
        return self.log[-chars:]


def http_ready(path: str = "/readyz", timeout_s: float = 5.0) -> Callable[[ServerProcess], bool]:
    """A ready check: GET path answers 200 (connection errors count as not yet)."""

    def check(server: ServerProcess) -> bool:
        import httpx

        try:
            return httpx.get(server.url + path, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def serve_argv(root, port: int, *args, torch_threads: int = 1, log_level: str = "warning") -> list[str]:
    """`softsearch serve --index ROOT` on 127.0.0.1:`port` with `args`, as this interpreter runs it."""
    return [
        sys.executable,
        "-m",
        "api.cli",
        "serve",
        "--index",
        str(root),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--torch-threads",
        str(torch_threads),
        "--log-level",
        log_level,
        *map(str, args),
    ]


@contextlib.contextmanager
def server_process(
    argv: Sequence[str],
    port: int,
    *,
    ready: Callable[[ServerProcess], bool] | None = None,
    timeout_s: float = 120.0,
    log_path: str | os.PathLike | None = None,
    env: dict | None = None,
    cwd: str | os.PathLike | None = None,
    stop_signal: int = signal.SIGTERM,
    stop_timeout_s: float = 20.0,
    poll_s: float = 0.2,
) -> Iterator[ServerProcess]:
    """Run `argv` (a server listening on 127.0.0.1:`port`) until `ready(server)` is true, yield it, stop it.

    `env` is added to this process's environment, with the repository root first on PYTHONPATH."""
    ready = ready or http_ready()
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH")) if p)
    url = f"http://127.0.0.1:{port}"
    name = " ".join(map(str, argv[1:4]))
    with contextlib.ExitStack() as stack:
        if log_path is None:  # removed after the block; pass log_path to read the output afterwards
            log_path = (
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="softsearch-serve-")))
                / "server.log"
            )
        log = stack.enter_context(open(log_path, "w"))
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            list(map(str, argv)),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=str(cwd or REPO_ROOT),
        )
        server = ServerProcess(url, port, proc, Path(log_path), argv=list(map(str, argv)))
        try:
            deadline = time.monotonic() + timeout_s
            while not ready(server):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} before it was ready; its output "
                        f"ends:\n{server.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name} did not become ready at {url} in {timeout_s:g} s; its output "
                        f"ends:\n{server.log_tail()}"
                    )
                time.sleep(poll_s)
            server.ready_s = time.perf_counter() - t0
            yield server
        finally:
            _stop(proc, stop_signal, stop_timeout_s)


def _stop(proc: subprocess.Popen, stop_signal: int, timeout_s: float) -> None:
    """Signal the server and wait; kill it when it has not exited after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(stop_signal)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def serve_process(
    root,
    *args,
    log_path: str | os.PathLike | None = None,
    torch_threads: int = 1,
    log_level: str = "warning",
    **kw,
) -> Iterator[ServerProcess]:
    """`softsearch serve --index ROOT ARGS...` on a free loopback port, ready on entry (see
    `server_process`)."""
    port = free_port()
    with server_process(
        serve_argv(root, port, *args, torch_threads=torch_threads, log_level=log_level),
        port,
        log_path=log_path,
        **kw,
    ) as server:
        yield server
