"""Prometheus text-format metrics, written by hand (no extra dependency).

Counters, gauges and histograms with labels, thread-safe (route handlers run in a thread pool),
rendered in the text exposition format 0.0.4 that Prometheus scrapes from GET /metrics.
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        assert set(labels) == set(self.labelnames), f"{self.name}: labels {sorted(labels)} != {self.labelnames}"
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """Monotonic count per label set."""

    kind = "counter"

    def __init__(self, name, help, labelnames=()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        assert amount >= 0, "counters only go up"
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_fmt(v)}" for k, v in items]


class Gauge(_Metric):
    """Current value per label set; optionally computed at scrape time by `fn`."""

    kind = "gauge"

    def __init__(self, name, help, labelnames=(), fn: Callable[[], dict[tuple[str, ...], float]] | None = None):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        self._fn = fn

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)

    def render(self) -> list[str]:
        if self._fn is not None:
            items = sorted(self._fn().items())
        else:
            with self._lock:
                items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_fmt(v)}" for k, v in items]


class Histogram(_Metric):
    """Cumulative-bucket histogram per label set (_bucket{le=...}, _sum, _count)."""

    kind = "histogram"

    def __init__(self, name, help, labelnames=(), buckets: Sequence[float] = LATENCY_BUCKETS):
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        self._data: dict[tuple[str, ...], list] = {}  # key -> [counts per bucket + overflow, sum, count]

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        i = bisect.bisect_left(self.buckets, value)  # first bucket with upper bound >= value
        with self._lock:
            d = self._data.setdefault(key, [[0] * (len(self.buckets) + 1), 0.0, 0])
            d[0][i] += 1
            d[1] += value
            d[2] += 1

    def snapshot(self, **labels: str) -> tuple[list[int], float, int]:
        """(non-cumulative counts per bucket + overflow, sum, count) for one label set."""
        with self._lock:
            d = self._data.get(self._key(labels))
            return (list(d[0]), d[1], d[2]) if d else ([0] * (len(self.buckets) + 1), 0.0, 0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(v[0]), v[1], v[2])) for k, v in self._data.items())
        out = self.header()
        for key, (counts, total, n) in items:
            cum = 0
            for bound, c in zip(self.buckets + (math.inf,), counts):
                cum += c
                le = 'le="' + _fmt(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {cum}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_fmt(total)}")
            out.append(f"{self.name}_count{_labels(self.labelnames, key)} {n}")
        return out


class Registry:
    """The service's metrics. One per app, so tests never share counts."""

    def __init__(self):
        self.requests = Counter(
            "softsearch_http_requests_total", "HTTP requests by route template, method and status",
            ("route", "method", "status"),
        )
        self.latency = Histogram(
            "softsearch_http_request_duration_seconds", "HTTP request latency by route template",
            ("route", "method"),
        )
        self.batch_size = Histogram(
            "softsearch_batch_size", "queries per encoder/index call (micro-batch size)", (), BATCH_BUCKETS
        )
        self.queries = Counter("softsearch_queries_total", "search queries answered, by kind", ("kind",))
        self.reloads = Counter("softsearch_index_reloads_total", "index reload attempts by result", ("result",))
        self.rate_limited = Counter("softsearch_rate_limited_total", "requests refused with 429", ())
        self._info_fn: Callable[[], tuple[str | None, int]] = lambda: (None, 0)
        self.index_info = Gauge(
            "softsearch_index_info", "1 for the index version now answering queries", ("version",),
            fn=lambda: {(v,): 1.0} if (v := self._info_fn()[0]) else {},
        )
        self.index_items = Gauge(
            "softsearch_index_items", "items in the active index version", (),
            fn=lambda: {(): float(self._info_fn()[1])},
        )
        self.ready = Gauge(
            "softsearch_ready", "1 when an index and encoder are loaded", (),
            fn=lambda: {(): 1.0 if self._info_fn()[0] else 0.0},
        )

    def bind_index(self, fn: Callable[[], tuple[str | None, int]]) -> None:
        """fn() -> (active version or None, item count), read at scrape time."""
        self._info_fn = fn

    def render(self) -> str:
        metrics = [self.requests, self.latency, self.batch_size, self.queries, self.reloads,
                   self.rate_limited, self.index_info, self.index_items, self.ready]
        lines: list[str] = []
        for m in metrics:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"


def _route_label(scope: Scope) -> str:
    """Route template for FastAPI routes; fixed labels for plain Starlette routes and the static mount."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if template:
        return template
    if "endpoint" in scope:  # matched a Starlette route (/openapi.json, /docs) or the /static mount
        path = scope.get("path", "")
        return "/static" if path.startswith("/static") else path
    return "unmatched"


class MetricsMiddleware:
    """ASGI middleware: count and time every HTTP request by its route template.

    The route template (e.g. /v1/items/{item_id:path}) keeps label cardinality bounded;
    unmatched paths share the label "unmatched".
    """

    def __init__(self, app: ASGIApp, registry: Registry):
        self.app, self.registry = app, registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            template = _route_label(scope)
            method = scope.get("method", "GET")
            self.registry.requests.inc(route=template, method=method, status=str(status["code"]))
            self.registry.latency.observe(time.perf_counter() - start, route=template, method=method)
