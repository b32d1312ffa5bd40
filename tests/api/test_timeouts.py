"""Slow and idle clients against a real `softsearch serve` (api/timeouts.py): a silent connection, a
trickled head, a stalled body and an idle keep-alive connection are closed after their timeouts,
while searches on other connections keep being answered."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from api_helpers import png_bytes

from api.launch import serve_process

TIMEOUT_S = 1.5


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    t0 = time.monotonic()
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def _search(url: str, image: bytes) -> int:
    return httpx.post(
        url + "/v1/search", files={"file": ("q.png", image, "image/png")}, data={"k": "3"}, timeout=30
    ).status_code


def test_slow_and_idle_connections_are_closed_after_their_timeouts(api_index, api_dataset, tmp_path):
    image = png_bytes(api_dataset.image(0))
    with serve_process(
        api_index["root"],
        "--header-timeout-s",
        TIMEOUT_S,
        "--body-timeout-s",
        TIMEOUT_S,
        "--keep-alive-timeout-s",
        TIMEOUT_S,
        log_path=tmp_path / "serve.log",
    ) as server:
        silent = _connect(server.url)  # connects, says nothing
        trickle = _connect(server.url)  # half a head, then nothing
        trickle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        stalled = _connect(server.url)  # a head, a tenth of its body
        head = (
            "POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b0undary\r\n"
            "Content-Length: 1000\r\n\r\n"
        ).encode()
        stalled.sendall(
            head + b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="q.png"\r\n\r\n'
        )
        idle = _connect(server.url)  # one request, then idle
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        # a slow but punctual client: its head in pieces, all within the deadline, is answered
        punctual = _connect(server.url)
        for piece in (b"GET /healthz HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n\r\n"):
            punctual.sendall(piece)
            time.sleep(TIMEOUT_S / 5)
        assert _search(server.url, image) == 200  # others are served meanwhile

        for sock in (silent, trickle):
            data, waited = _read_until_closed(sock)
            assert data == b""
            assert waited < TIMEOUT_S + 10
        data, _ = _read_until_closed(stalled)
        status, _, body = data.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408") and b"connection: close" in status.lower(), data
        assert json.loads(body)["error"] == "request_timeout"
        data, _ = _read_until_closed(idle)
        assert data.startswith(b"HTTP/1.1 200") and data.count(b"HTTP/1.1") == 1  # answered once, then closed
        data, _ = _read_until_closed(punctual)
        assert data.startswith(b"HTTP/1.1 200"), data

        # the clocks run for the stated time, not less: a fresh silent connection is still open at half of it
        late = _connect(server.url)
        late.settimeout(TIMEOUT_S / 2)
        try:
            late.recv(1)
            raise AssertionError("closed before its head timeout")
        except TimeoutError:
            pass
        late.settimeout(30)
        data, waited = _read_until_closed(late)
        assert data == b"" and waited < TIMEOUT_S + 10

        huge = _connect(server.url)  # a head still incomplete after h11's 16 KiB
        huge.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000)
        data, _ = _read_until_closed(huge)
        assert data.startswith(b"HTTP/1.1 400")
        assert _search(server.url, image) == 200
        for sock in (silent, trickle, stalled, idle, punctual, late, huge):
            sock.close()


def test_serve_runs_httptools_when_installed_else_h11(monkeypatch):
    """Both protocol classes carry the head deadline; httptools' (the C parser) is served when importable."""
    import sys

    from api.timeouts import HeadTimeoutH11Protocol, HeadTimeoutHttpToolsProtocol, head_timeout_protocol

    pytest.importorskip("httptools")
    assert head_timeout_protocol() is HeadTimeoutHttpToolsProtocol
    monkeypatch.setitem(sys.modules, "httptools", None)  # as if not installed
    assert head_timeout_protocol() is HeadTimeoutH11Protocol
    for cls in (HeadTimeoutH11Protocol, HeadTimeoutHttpToolsProtocol):
        assert cls.head_timeout_s > 0


@pytest.mark.parametrize("protocol_name", ["HeadTimeoutH11Protocol", "HeadTimeoutHttpToolsProtocol"])
def test_each_protocol_closes_a_silent_and_a_trickling_connection(protocol_name, monkeypatch):
    """Both protocols (h11's is the fallback without httptools) run the shared head timer: a silent and a
    trickling connection are closed after the deadline while a punctual request is answered."""
    import asyncio
    import threading

    import uvicorn

    import api.timeouts as timeouts

    protocol = getattr(timeouts, protocol_name)
    monkeypatch.setattr(protocol, "head_timeout_s", 0.5)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        silent, trickle = _connect(url), _connect(url)
        trickle.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        for conn in (silent, trickle):
            data, seconds = _read_until_closed(conn)
            assert data == b"" and seconds < 5
            conn.close()
        assert httpx.get(url + "/", timeout=10).text == "ok"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
