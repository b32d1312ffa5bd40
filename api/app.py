"""create_app(): the FastAPI application (routes, error handlers, middleware, static page).

Every error is JSON `{"error": code, "detail": message}`: HTTP errors, validation errors
(422; malformed JSON is 400), not-ready (503), and the catch-all 500 (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from api import swap
from api.batching import ActiveRequests, ActiveRequestsMiddleware, MicroBatcher
from api.config import Settings
from api.deps import ApiError
from api.metrics import Metrics, MetricsMiddleware
from api.openapi import install_served_openapi
from api.ratelimit import RateLimitMiddleware, TokenBucketLimiter
from api.routes import admin, duplicates, health, index, items, search, text, web
from api.timeouts import BodyTimeoutMiddleware
from api.vector_path import VectorPathMiddleware, VectorPathState
from search.serving.normaliser import NormaliserConfig
from search.serving.searcher import NotReadyError, Searcher

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: Room for multipart boundaries and form fields on top of the image itself.
BODY_OVERHEAD_BYTES = 64 * 1024

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "rate_limited",
    503: "not_ready",
}


def _error(status: int, code: str, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status, headers=headers)


class BodySizeLimitMiddleware:
    """413 for request bodies over the limit: early from Content-Length, else while streaming."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.limit
            except ValueError:
                too_big = False
            if too_big:
                await _error(
                    413,
                    "upload_too_large",
                    f"request body is {int(declared)} bytes, limit is {self.limit} bytes",
                )(scope, receive, send)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, "upload_too_large", f"request body exceeds {self.limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


class UnhandledErrorMiddleware:
    """An unhandled error, before any response byte, is logged and answered with the 500 JSON here.
    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes the
    connection, so a keep-alive client's next request failed too."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - every error becomes the documented 500
            if started:
                raise
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await _error(500, "internal_error", f"internal error ({type(exc).__name__})")(
                scope, receive, send
            )


def _validation_detail(errors: list[dict]) -> str:
    parts = []
    for e in errors:
        full = [str(p) for p in e.get("loc", ())]
        loc = ".".join(p for p in full if p not in ("body", "query", "path", "header")) or ".".join(full)
        parts.append(f"{loc or 'request'}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = getattr(exc, "code", None) or _STATUS_CODES.get(exc.status_code, "error")
        return _error(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            ctx = bad_json[0].get("ctx") or {}
            pos = bad_json[0].get("loc", ("body", "?"))[-1]
            return _error(
                400,
                "malformed_json",
                f"malformed JSON body: {ctx.get('error', 'decode error')} at position {pos}",
            )
        slim = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": str(e.get("type"))}
            for e in errors
        ]
        return JSONResponse(
            {"error": "validation_error", "detail": _validation_detail(errors), "errors": slim},
            status_code=422,
        )

    @app.exception_handler(NotReadyError)
    async def not_ready(request: Request, exc: NotReadyError) -> JSONResponse:
        return _error(503, "not_ready", str(exc))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "internal_error", f"internal error ({type(exc).__name__})")


def _vector_only(searcher: Searcher | None) -> bool:
    """Whether the version loaded at start was built from vectors (no encoder): `--batch-workers auto`
    then runs one batch thread (a version swapped in later keeps the count chosen here)."""
    try:
        return searcher is not None and searcher.ready and searcher.snapshot().encoder is None
    except Exception:  # noqa: BLE001 - nothing loaded: the image default
        return False


def create_app(settings: Settings, searcher: Searcher | None = None) -> FastAPI:
    """Build the service. With no `searcher`, one is opened on settings.index_root and the
    current version loaded if there is one; otherwise /readyz says 503 until a version is
    activated (followed within watch_interval_s) or an admin reload."""
    metrics = Metrics()

    def make_searcher() -> Searcher:
        if settings.index_root is None:
            raise ValueError("no index root configured (SOFTSEARCH_INDEX_ROOT / --index)")
        release = {"auto": None, "release": True, "keep": False}[settings.mapped_pages]
        # several serving processes map one list-ordered copy of the rows instead of one copy each
        normaliser = NormaliserConfig(
            method=settings.normaliser,
            release_pages=release,
            listed_shared=settings.workers > 1,
            overlap=settings.normaliser_overlap == "on",
        )
        return Searcher(settings.index_root, device=settings.device, normaliser=normaliser)

    load_error = None
    if searcher is None and settings.index_root is not None:
        try:
            searcher = make_searcher()
            swap.load_at_startup(searcher)  # through the store's activation rule
        except swap.REFUSALS as err:
            load_error = str(err)
            fixes = (
                [
                    f"`softsearch index build --root {settings.index_root} ...` (picked up within "
                    f"{settings.watch_interval_s:g} s)"
                ]
                if settings.watch_interval_s > 0
                else []
            )
            if settings.admin_token:
                fixes.append("POST /v1/admin/reload")
            logger.warning(
                "no index loaded at start-up (%s); /readyz is 503 until %s",
                err,
                " or ".join(fixes) or "a restart (no watcher, no admin token)",
            )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        follower = None
        if settings.index_root is not None and settings.watch_interval_s > 0:
            follower = asyncio.get_running_loop().create_task(
                swap.follow_store(app, settings.watch_interval_s), name="softsearch-store-follower"
            )
        yield
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        await app.state.batcher.aclose()
        app.state.batcher.shutdown()
        metrics.close()

    # /docs and /redoc from the Swagger UI and ReDoc files packaged in fastapi-offline (no CDN: they
    # render on a machine without internet)
    app = FastAPIOffline(
        title="softsearch",
        version="1",
        summary="Image similarity search with exact softmax probabilities over the whole index.",
        description="Upload an image (or send an embedding) and get the top-k indexed items with their "
        "cosine similarity and the learned softmax-search probability p(j|x) over the whole index. "
        "Errors are JSON {error, detail}.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.searcher = searcher
    app.state.make_searcher = make_searcher
    app.state.swap_lock = threading.Lock()  # one swap at a time (admin reloads, the follower)
    app.state.load_error = load_error

    active = ActiveRequests()
    vector_only = _vector_only(searcher)
    batch_workers = settings.resolved_batch_workers(vector_only)
    if settings.batch_workers == "auto":
        logger.info("batch threads: %d (--batch-workers auto)", batch_workers)
    app.state.batcher = MicroBatcher(
        lambda: app.state.searcher,
        settings.batch_max_size,
        settings.batch_max_wait_ms,
        metrics,
        workers=batch_workers,
        active=active,
        linger_ms=settings.resolved_batch_linger_ms(vector_only),
    )

    metrics.observe_searcher(searcher)

    _install_error_handlers(app)
    install_served_openapi(app, settings.max_k)
    for module in (search, text, items, index, duplicates, health, admin, web):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    # add_middleware wraps: the last added is outermost; metrics sit outside the limits, so count 413s/429s
    app.add_middleware(
        UnhandledErrorMiddleware
    )  # innermost: a route's unhandled error is a 500 on a kept connection
    app.add_middleware(BodySizeLimitMiddleware, limit=settings.max_upload_bytes + BODY_OVERHEAD_BYTES)
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.body_timeout_s)
    if settings.rate_limit_enabled:
        limiter = TokenBucketLimiter(settings.rate_limit_rps, settings.rate_limit_burst)
        app.add_middleware(
            RateLimitMiddleware,
            limiter=limiter,
            on_limited=lambda: metrics.rate_limited.inc(),
            admin_token=settings.admin_token,
        )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if settings.forwarded_allow_ips:
        # outside the limits: the client address every layer below sees (the rate-limit key) is the
        # X-Forwarded-For one only when the TCP peer is one of these trusted proxies
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.forwarded_allow_ips)
    app.add_middleware(ActiveRequestsMiddleware, active=active)  # counts every request
    # outermost: plain vector queries answered without the stack below (api/vector_path.py); with a rate
    # limit or trusted proxies every request takes the full stack
    app.state.vector_path = VectorPathState(
        enabled=not settings.rate_limit_enabled and not settings.forwarded_allow_ips
    )
    app.add_middleware(
        VectorPathMiddleware,
        fastapi_app=app,
        state=app.state.vector_path,
        active=active,
        body_limit=settings.max_upload_bytes + BODY_OVERHEAD_BYTES,
        body_timeout_s=settings.body_timeout_s,
    )
    return app
