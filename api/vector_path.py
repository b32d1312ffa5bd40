"""POST /v1/search/vector as a raw ASGI handler, in front of FastAPI's per-request machinery.

A vector query at 10^5 rows costs ~2-3 ms of search; FastAPI's routing, dependency, request object,
exception middleware and the pure-ASGI middleware stack around them added ~0.5-0.75 ms of CPU per request,
this handler ~0.3 (docs/results.md §28). It sits outermost among the app's middlewares and answers the plain
case itself -- POST to exactly /v1/search/vector, a JSON or octet-stream body within the size limit, an
index loaded -- through the same functions as the FastAPI route (`vector_body.parse_vector_query`,
`routes.search.answer_vector`), so its answers are the route's, byte for byte.

Everything else goes to the full app untouched, and so does every query that fails anywhere on the way
(bad input included): its body is replayed to the app, whose handlers word the 4xx / 5xx as always. What
the skipped middlewares do for an answered query is done here: the request counts in ActiveRequests
(the batcher's company), in the request metrics under route /v1/search/vector and in the queries
counter; the body has the same size limit (over it: handed over, the app answers 413) and the same
deadline (408 as BodyTimeoutMiddleware words it). With a rate limit or trusted proxies configured every
request takes the full app (the limiter keys on what the proxy middleware rewrites).
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import vector_body
from api.timeouts import send_body_timeout

PATH = "/v1/search/vector"
ROUTE = PATH  # the request metrics' route label, as MetricsMiddleware labels the FastAPI route
_MEDIA = (vector_body.JSON, vector_body.OCTET)


class VectorPathState:
    """Switch and counters of the raw path (app.state.vector_path): `answered` by it, `handed_over` to
    the full app after it started on a request."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.answered = 0
        self.handed_over = 0


class VectorPathMiddleware:
    """ASGI middleware answering plain POST /v1/search/vector requests without the app below it."""

    def __init__(
        self,
        app: ASGIApp,
        fastapi_app,
        state: VectorPathState,
        active,
        body_limit: int,
        body_timeout_s: float,
    ):
        self.app, self.fastapi_app, self.state, self.active = app, fastapi_app, state, active
        self.body_limit, self.body_timeout_s = body_limit, body_timeout_s
        self._children: tuple | None = None  # (requests counter 200, latency histogram) children

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != PATH
            or scope["method"] != "POST"
            or not self.state.enabled
            or scope.get("root_path")
        ):
            await self.app(scope, receive, send)
            return
        media = length = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                media = value.decode("latin-1").split(";", 1)[0].strip().lower()
            elif name == b"content-length":
                length = value
        if media not in _MEDIA:
            await self.app(scope, receive, send)  # 415 from the route's dependency
            return
        if length is not None:
            try:
                too_big = int(length) > self.body_limit
            except ValueError:
                too_big = True  # let the app's middleware judge it
            if too_big:
                await self.app(scope, receive, send)
                return
        await self._answer(scope, receive, send, media)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, media: str) -> None:
        start = time.perf_counter()
        app_state = self.fastapi_app.state
        active = self.active
        active.count += 1
        counted = True
        read: list[Message] = []
        try:
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    body = await self._read_body(receive, read)
            except TimeoutError:
                await send_body_timeout(send, self.body_timeout_s)
                self._observe("408", time.perf_counter() - start)
                return
            response = None
            if body is not None:
                try:
                    response = await self._respond(app_state, scope, body, media)
                except Exception:  # noqa: BLE001 - the full app answers it (and words the error)
                    response = None
            if response is None:
                if counted:
                    active.count -= 1
                    counted = False
                self.state.handed_over += 1
                await self.app(scope, _replay(read, receive), send)
                return
            await response(scope, receive, send)
            self.state.answered += 1
            self._observe("200", time.perf_counter() - start)
        finally:
            if counted:
                active.count -= 1

    async def _read_body(self, receive: Receive, read: list[Message]) -> bytes | None:
        """The whole body, or None (a disconnect, or more than the limit: the app answers those)."""
        seen = 0
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                return None
            seen += len(message.get("body", b""))
            if seen > self.body_limit:
                return None
            if not message.get("more_body", False):
                break
        return read[0].get("body", b"") if len(read) == 1 else b"".join(m.get("body", b"") for m in read)

    async def _respond(self, app_state, scope: Scope, body: bytes, media: str):
        """The route's response to this query, or None where the app must answer (no index loaded)."""
        from api.routes.search import answer_vector

        searcher = app_state.searcher
        if searcher is None or not searcher.ready:
            return None
        query = vector_body.parse_vector_query(body, media, scope.get("query_string") or b"")
        snapshot = searcher.snapshot()
        return await answer_vector(query, snapshot, app_state.settings, app_state.batcher, app_state.metrics)

    def _observe(self, status: str, seconds: float) -> None:
        metrics = self.fastapi_app.state.metrics
        if status == "200":
            if self._children is None:
                self._children = (
                    metrics.requests.labels(ROUTE, "POST", "200"),
                    metrics.latency.labels(ROUTE, "POST"),
                )
            counter, latency = self._children
        else:
            counter, latency = (
                metrics.requests.labels(ROUTE, "POST", status),
                metrics.latency.labels(ROUTE, "POST"),
            )
        counter.inc()
        latency.observe(seconds)


def _replay(read: list[Message], receive: Receive) -> Receive:
    """`receive` that first gives back the messages already read."""
    pending = list(read)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
