"""Per-client token-bucket rate limit (off by default): 429 + Retry-After when a bucket is empty.

A bucket holds at most `burst` tokens and refills at `rate` tokens per second; each request
takes one. Clients are keyed by peer address (the service binds loopback; a proxy in front
should do its own limiting). Health and metrics routes are never limited.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class TokenBucketLimiter:
    """Thread-safe token buckets keyed by client; bounded memory (least recently seen evicted)."""

    def __init__(self, rate: float, burst: int, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        assert rate > 0 and burst >= 1, f"bad limiter rate={rate} burst={burst}"
        self.rate, self.burst, self.max_clients, self.clock = float(rate), int(burst), max_clients, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, last time)
        self._lock = threading.Lock()

    def acquire(self, client: str) -> float:
        """Take one token. Returns 0.0 if allowed, else the seconds until a token is available."""
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.pop(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[client] = (tokens - 1.0, now)
                wait = 0.0
            else:
                self._buckets[client] = (tokens, now)
                wait = (1.0 - tokens) / self.rate
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        return wait


class RateLimitMiddleware:
    """ASGI middleware applying a TokenBucketLimiter to every non-exempt HTTP request."""

    def __init__(self, app: ASGIApp, limiter: TokenBucketLimiter, on_limited: Callable[[], None] | None = None):
        self.app, self.limiter, self.on_limited = app, limiter, on_limited

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        key = client[0] if client else "unknown"
        wait = self.limiter.acquire(key)
        if wait <= 0.0:
            await self.app(scope, receive, send)
            return
        if self.on_limited is not None:
            self.on_limited()
        retry_after = max(1, math.ceil(wait))
        body = json.dumps({
            "error": "rate_limited",
            "detail": f"too many requests from {key}: limit {self.limiter.rate:g}/s, burst {self.limiter.burst}; "
                      f"retry in {retry_after} s",
        }).encode()
        await send({
            "type": "http.response.start", "status": 429,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"retry-after", str(retry_after).encode())],
        })
        await send({"type": "http.response.body", "body": body})
