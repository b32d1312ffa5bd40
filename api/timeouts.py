"""Deadlines for slow and idle clients, so a connection cannot be held open by sending nothing.

Three clocks, each a `softsearch serve` setting:

- header_timeout_s: a request's head (request line + headers) must arrive within this many seconds
  of the connection opening or of its first byte; otherwise the connection is closed
  (`HeadTimeoutHttpToolsProtocol` / `HeadTimeoutH11Protocol`, uvicorn's httptools or h11 protocol with that
  one timer added -- uvicorn has none).
- body_timeout_s: a request's body must arrive within this many seconds of its head; otherwise the
  request is answered 408 and the connection closed (`BodyTimeoutMiddleware`, an ASGI middleware).
- keep_alive_timeout_s: an idle keep-alive connection is closed this long after its last response
  (uvicorn's own timeout_keep_alive).
"""

from __future__ import annotations

import asyncio
import json

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from api import balance

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: only the h11 protocol
    HttpToolsProtocol = H11Protocol  # type: ignore[misc,assignment]


class HeadTimerMixin:
    """The head deadline's timer, shared by both protocols: armed when a head is awaited, cancelled when
    it arrives; on expiry the connection closes if the protocol's `_head_pending()` still says so."""

    head_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        balance.connections_changed(len(self.connections), self.client)

    def _connection_opened(self) -> None:
        balance.connections_changed(len(self.connections))

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self._head_pending():
            self.logger.debug("closing a connection whose request head took over %.3g s", self.head_timeout_s)
            self.transport.close()


class HeadTimeoutH11Protocol(HeadTimerMixin, H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head has not arrived within
    `head_timeout_s` of the connection opening (a client that connects and says nothing) or of the
    head's first byte (a client that trickles its headers). Between requests the keep-alive timer runs.

    `head_timeout_s` is a class attribute: uvicorn builds one protocol per connection from the class,
    so the serving process sets it once (api.server) before it accepts connections.
    """

    head_timeout_s: float = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()
        self._connection_opened()

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()  # a head arrived (or the connection is going)
        elif self.conn.trailing_data[0]:
            self._arm_head_timer()  # part of the next head is buffered: its clock runs

    def _head_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE


class HeadTimeoutHttpToolsProtocol(HeadTimerMixin, HttpToolsProtocol):
    """uvicorn's httptools protocol (C parser: ~0.1-0.4 ms less CPU per request than h11 here, docs/results.md
    §28) with the same head deadline as `HeadTimeoutH11Protocol`: a connection whose request head has not
    arrived within `head_timeout_s` of the connection opening or of the head's first byte is closed. As h11
    does, a head still incomplete after `max_head_bytes` (h11's 16 KiB) is answered 400 and the connection
    closed (httptools itself has no such limit). `softsearch serve` uses this class when httptools is
    installed."""

    head_timeout_s: float = 10.0
    max_head_bytes: int = 16 * 1024

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = False
        self._head_bytes = 0
        self._arm_head_timer()
        self._connection_opened()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head:  # still incomplete after this chunk (one that began the head counts whole)
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
                self._cancel_head_timer()
                self.send_400_response("Invalid HTTP request received.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def _head_pending(self) -> bool:
        return self._in_head or self.cycle is None


def head_timeout_protocol():
    """The HTTP protocol class `softsearch serve` runs: httptools' when it is installed, else h11's."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return HeadTimeoutH11Protocol
    return HeadTimeoutHttpToolsProtocol


class BodyTimeoutMiddleware:
    """408 and `Connection: close` for a request whose body has not fully arrived within `timeout_s`
    of its head (the deadline covers the whole body, however it is chunked)."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        state = {"body_done": False, "timed_out": False, "started": False}

        async def timed_receive() -> Message:
            if state["body_done"] or state["timed_out"]:
                return await receive()  # after the body: waits for a disconnect, never timed
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                state["timed_out"] = True
                raise BodyTimeout(self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        async def guarded_send(message: Message) -> None:
            if state["timed_out"]:
                return  # the app's own answer to the aborted read is dropped
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not state["timed_out"]:
                raise
        if state["timed_out"] and not state["started"]:
            await send_body_timeout(send, self.timeout_s)


async def send_body_timeout(send: Send, timeout_s: float) -> None:
    """The 408 answer (and `Connection: close`) to a body that did not arrive within `timeout_s`."""
    body = json.dumps(
        {
            "error": "request_timeout",
            "detail": f"request body not received within {timeout_s:g} s",
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 408,
            "headers": [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyTimeout(Exception):
    """Raised into the app from `receive` when the body deadline passes."""

    def __init__(self, timeout_s: float):
        super().__init__(f"request body not received within {timeout_s:g} s")
