"""Service metrics with prometheus_client, scraped at GET /metrics.

One `Metrics` object per app. In a single process it owns a `CollectorRegistry` with the
service's metrics and the standard process, platform and GC collectors, so two apps in one
process (tests) never share counts. With several worker processes (`softsearch serve
--workers N`) the parent sets PROMETHEUS_MULTIPROC_DIR before any worker imports
prometheus_client: every worker writes its samples to its own files in that directory and a
scrape of ANY worker merges all of them (prometheus_client's MultiProcessCollector), so
counters and histograms add up over workers. Gauges say in their help how workers combine.
The process collectors describe one process and are not merged; per-worker memory is exported
instead as `softsearch_worker_resident_memory_bytes{pid}`.
"""

from __future__ import annotations

import os
import time

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as _multiprocess
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# `*_created` timestamp series double every counter and histogram for no use on a dashboard.
prometheus_client.disable_created_metrics()


def multiprocess_dir() -> str | None:
    """The shared sample directory when running as one of several workers, else None."""
    return os.environ.get(MULTIPROC_ENV) or None


def resident_bytes() -> int:
    """This process's resident set size (VmRSS), 0 where /proc is unavailable."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Metrics:
    """The service's metrics (names are part of the API; dashboards use them)."""

    def __init__(self):
        self.multiprocess_dir = multiprocess_dir()
        own = None if self.multiprocess_dir else CollectorRegistry()  # None: samples go to the shared files
        self.requests = Counter(
            "softsearch_http_requests_total",
            "HTTP requests by route template, method and status",
            ("route", "method", "status"),
            registry=own,
        )
        self.latency = Histogram(
            "softsearch_http_request_duration_seconds",
            "HTTP request latency by route template",
            ("route", "method"),
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.batch_size = Histogram(
            "softsearch_batch_size",
            "queries per encoder/index call (micro-batch size)",
            buckets=BATCH_BUCKETS,
            registry=own,
        )
        self.queries = Counter(
            "softsearch_queries_total", "search queries answered, by kind", ("kind",), registry=own
        )
        self.reloads = Counter(
            "softsearch_index_reloads_total", "index reload attempts by result", ("result",), registry=own
        )
        self.rate_limited = Counter(
            "softsearch_rate_limited_total", "requests refused with 429", registry=own
        )
        self.index_info = Gauge(
            "softsearch_index_info",
            "1 for an index version answering queries (in any live worker), else 0",
            ("version",),
            registry=own,
            multiprocess_mode="livemax",
        )
        self.index_items = Gauge(
            "softsearch_index_items",
            "items in the active index version (the most recently loaded one)",
            registry=own,
            multiprocess_mode="livemostrecent",
        )
        self.ready = Gauge(
            "softsearch_ready",
            "1 when an index and encoder are loaded (in every live worker)",
            registry=own,
            multiprocess_mode="livemin",
        )
        self.workers = Gauge(
            "softsearch_workers", "live serving processes", registry=own, multiprocess_mode="livesum"
        )
        self.worker_memory = Gauge(
            "softsearch_worker_resident_memory_bytes",
            "resident set size of each serving process",
            registry=own,
            multiprocess_mode="liveall",
        )
        self.workers.set(1)
        self.ready.set(0)
        self._version: str | None = None
        if own is None:
            self.registry = CollectorRegistry()
            _multiprocess.MultiProcessCollector(self.registry, path=self.multiprocess_dir)
        else:
            self.registry = own
            prometheus_client.ProcessCollector(registry=own)
            prometheus_client.PlatformCollector(registry=own)
            prometheus_client.GCCollector(registry=own)
        self.update_process()

    def set_index(self, version: str | None, count: int) -> None:
        """Record the index version this process now answers with (None: not ready)."""
        if self._version is not None and self._version != version:
            if self.multiprocess_dir:  # the merged files cannot drop a series: 0 = no longer answering
                self.index_info.labels(version=self._version).set(0)
            else:
                self.index_info.remove(self._version)
        if version is not None:
            self.index_info.labels(version=version).set(1)
            self.index_items.set(count)
        self.ready.set(1 if version is not None else 0)
        self._version = version

    def observe_searcher(self, searcher) -> None:
        """set_index from a Searcher (or None): the version its current snapshot answers with."""
        if searcher is None or not searcher.ready:
            self.set_index(None, 0)
            return
        snap = searcher.snapshot()
        self.set_index(snap.version, snap.count)

    def update_process(self) -> None:
        """Refresh per-process gauges (called periodically by the store watcher)."""
        self.worker_memory.set(resident_bytes())

    def render(self) -> bytes:
        """Prometheus text exposition of every metric (all workers merged in multiprocess mode)."""
        return generate_latest(self.registry)

    def sample(self, name: str, **labels: str) -> float | None:
        """The current value of one sample (e.g. 'softsearch_queries_total', kind='image'), None if absent."""
        return self.registry.get_sample_value(name, labels)

    def close(self) -> None:
        """On worker exit: drop this process's live gauges from the merged view."""
        if self.multiprocess_dir:
            _multiprocess.mark_process_dead(os.getpid(), self.multiprocess_dir)


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

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics
        self._children: dict[tuple[str, str, str], tuple] = {}  # labels -> (counter, histogram) children

    def _observe(self, template: str, method: str, status: str, seconds: float) -> None:
        key = (template, method, status)
        children = self._children.get(key)
        if children is None:  # labels() validates and locks on every call: once per label set instead
            children = (
                self.metrics.requests.labels(template, method, status),
                self.metrics.latency.labels(template, method),
            )
            if len(self._children) < 4096:  # route templates bound the label sets; this bounds the cache
                self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._observe(
                _route_label(scope), scope.get("method", "GET"), str(status), time.perf_counter() - start
            )
