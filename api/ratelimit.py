"""Per-client token-bucket rate limit (off by default): 429 + Retry-After when a bucket is empty.

A bucket holds at most `burst` tokens and refills at `rate` tokens per second; each request
takes one. Clients are keyed by the TCP peer address: `X-Forwarded-For` and friends are ignored
unless the operator names trusted proxies (`serve --forwarded-allow-ips`), in which case
uvicorn's ProxyHeadersMiddleware (outside this one) has already replaced the peer of requests from
those proxies with the client they forward for. Health and metrics routes are never limited, and
neither are admin requests carrying the right bearer token (an operator's reload must not wait
behind, or be refused by, the search clients' buckets); wrong or missing tokens are charged.
"""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
ADMIN_PREFIX = "/v1/admin/"


def is_admin(scope: Scope, token: str | None) -> bool:
    """An admin route called with the configured bearer token (constant-time compare)."""
    if token is None or not scope.get("path", "").startswith(ADMIN_PREFIX):
        return False
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
    return False


class TokenBucketLimiter:
    """Thread-safe token buckets keyed by client; bounded memory (least recently seen evicted)."""

    def __init__(
        self, rate: float, burst: int, max_clients: int = 10_000, clock: Callable[[], float] = time.monotonic
    ):
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

    def __init__(
        self,
        app: ASGIApp,
        limiter: TokenBucketLimiter,
        on_limited: Callable[[], None] | None = None,
        admin_token: str | None = None,
    ):
        self.app, self.limiter, self.on_limited, self.admin_token = app, limiter, on_limited, admin_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in EXEMPT_PATHS or is_admin(scope, self.admin_token):
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
        body = json.dumps(
            {
                "error": "rate_limited",
                "detail": f"too many requests from {key}: limit {self.limiter.rate:g}/s, "
                f"burst {self.limiter.burst}; retry in {retry_after} s",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 429,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(retry_after).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
