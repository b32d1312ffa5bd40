"""api/launch.py: the launcher tests and bench start servers with -- ready on entry, stopped on exit,
and a start-up failure names the server's own output."""

from __future__ import annotations

import signal
import sys

import httpx
import pytest

from api.launch import free_port, http_ready, server_process


def test_a_server_is_ready_inside_the_block_and_stopped_after(tmp_path):
    (tmp_path / "hello.txt").write_text("hi")
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(tmp_path),
    ]
    with server_process(argv, port, ready=http_ready("/hello.txt"), timeout_s=30) as server:
        assert server.url == f"http://127.0.0.1:{port}" and server.proc.poll() is None
        assert httpx.get(server.url + "/hello.txt").text == "hi" and server.ready_s > 0
    assert server.proc.returncode == -signal.SIGTERM
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/hello.txt", timeout=2)


def test_a_server_that_exits_is_reported_with_its_output(tmp_path):
    argv = [
        sys.executable,
        "-c",
        "import sys; print('cannot bind: port taken', file=sys.stderr); sys.exit(3)",
    ]
    with pytest.raises(
        RuntimeError, match=r"exited with 3 before it was ready(.|\n)*cannot bind: port taken"
    ):
        with server_process(argv, free_port(), log_path=tmp_path / "log", timeout_s=30):
            pass


def test_a_server_that_never_becomes_ready_times_out_and_is_stopped(tmp_path):
    argv = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    with pytest.raises(RuntimeError, match=r"did not become ready(.|\n)*loading"):
        with server_process(argv, free_port(), log_path=tmp_path / "log", timeout_s=1.0, stop_timeout_s=5):
            pass
