"""Micro-batching: concurrent queries share one encoder forward and one index search.

Requests go into an asyncio queue; once one of `workers` batch threads is free, a dispatcher
task takes the first waiting request, waits up to `max_wait_ms` for up to `max_batch_size - 1`
more, and runs the batch in that thread (so the event loop stays free): one snapshot of the
searcher, one `encode` of all images, one `search` with the largest k, then each request gets
its own top-k prefix. While every thread is busy, new requests queue up, so under load batches
fill by themselves; with `max_wait_ms == 0` (the default) that adaptive batching is all there
is, except that a batch waits up to GATHER_S for HTTP requests already in the process (counted by
ActiveRequestsMiddleware, not yet queued or in a running batch): they would otherwise wait for
a whole pass. A query that finds the queue empty, a thread free and no such company skips the
queue altogether (it would form a batch of one anyway). A query that is the only HTTP request in the process
runs on the event loop itself: at one client the request never changes threads (on a loaded machine each
wake-up of another thread waits for a time slice). `workers` batches may run at once (torch
releases the GIL, so they use separate cores).
`max_batch_size == 1` disables batching: each query runs directly in the thread pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import anyio.to_thread
import numpy as np
from PIL import Image
from starlette.types import ASGIApp, Receive, Scope, Send

from api.metrics import Metrics
from search.serving.filters import Filter
from search.serving.normaliser import LogZEstimate
from search.serving.queries import unit_queries
from search.serving.searcher import Hit, NoEncoderError, NotReadyError, Searcher, SearchSnapshot

logger = logging.getLogger(__name__)

#: Adaptive batching (max_wait_ms 0): how long a batch waits at most for requests already in the process
#: (read or being parsed) to reach the queue. An exact pass costs about the same for 1 query as for 16
#: (it reads every stored row once either way), so a batch that leaves them behind costs them a pass.
GATHER_S = 0.002


@dataclass(frozen=True)
class QueryResult:
    """One query's answer and the index version that produced it."""

    hits: list[Hit]
    version: str
    temperature: float
    log_normaliser: float
    batch_size: int
    count: int  # items in the version that answered
    normaliser: LogZEstimate | None = None  # how log Z was computed, its bound and sampled interval
    matched: int | None = None  # filtered searches: items passing the filter (the softmax runs over them)


@dataclass
class _Pending:
    image: (
        Image.Image | np.ndarray | Callable[[], Image.Image | np.ndarray] | None
    )  # image/pixels, or a decoder
    vector: np.ndarray | None
    k: int
    temperature: float | None
    future: asyncio.Future
    filter: Filter | None = None  # restrict the search to the rows passing it


def _run_batch(snapshot: SearchSnapshot, batch: list[_Pending]) -> list[QueryResult | Exception]:
    """Answer a batch on ONE snapshot: one encoder forward for all images, one index search."""
    n = len(batch)
    out: list[QueryResult | Exception | None] = [None] * n
    vecs = np.zeros((n, snapshot.dim), dtype=np.float32)  # (B, D)
    images: dict[int, Image.Image | np.ndarray] = {}
    for i, p in enumerate(batch):
        if p.image is None:
            continue
        try:  # decoding here saves a thread hop per request; a bad upload fails only itself
            images[i] = p.image() if callable(p.image) else p.image
        except Exception as err:  # noqa: BLE001 - handed back to that request's caller
            out[i] = err
    if (
        images and snapshot.encoder is None
    ):  # a version built from vectors (swapped in meanwhile): 409 for these
        for i in images:
            out[i] = NoEncoderError(snapshot.version)
    elif images:
        vecs[list(images)] = snapshot.encode(list(images.values()))
    for i, p in enumerate(batch):
        if p.vector is None:
            continue
        try:  # a bad vector (or one for a version swapped in meanwhile) fails only its own request
            vecs[i] = unit_queries(np.asarray(p.vector).reshape(-1), snapshot.dim)[0]
        except ValueError as err:
            out[i] = err
    valid = [i for i in range(n) if out[i] is None]
    # (rows whose decode failed keep their exception; the rest share one search per filter)
    groups: dict[str | None, list[int]] = {}
    for i in valid:
        groups.setdefault(None if batch[i].filter is None else batch[i].filter.key, []).append(i)
    for key, members in groups.items():
        try:
            mask = None if key is None else snapshot.filter_mask(batch[members[0]].filter)
            k_max = max(batch[i].k for i in members)
            answer = snapshot.search(
                vecs[members],
                k_max,
                [batch[i].temperature for i in members],
                mask=mask,
                unit=not images,  # every row came out of unit_queries just above
            )
        except Exception as err:  # noqa: BLE001 - e.g. a filter the swapped-in version cannot run
            for i in members:
                out[i] = err
            continue
        for j, i in enumerate(members):
            out[i] = QueryResult(
                answer[j][: batch[i].k],
                answer.version,
                answer.temperatures[j],
                answer.log_normalisers[j],
                len(valid),
                snapshot.count,
                answer.normalisers[j],
                None if mask is None else int(np.count_nonzero(mask)),
            )
    return out  # type: ignore[return-value]


class ActiveRequests:
    """HTTP requests this process has received and not yet answered (ActiveRequestsMiddleware counts)."""

    def __init__(self) -> None:
        self.count = 0


class ActiveRequestsMiddleware:
    """ASGI middleware keeping `ActiveRequests.count` (outermost, so a request counts from its headers on)."""

    def __init__(self, app: ASGIApp, active: ActiveRequests):
        self.app, self.active = app, active

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.active.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active.count -= 1


class MicroBatcher:
    """Groups concurrent `search_image` / `search_vector` calls into batched searcher calls."""

    def __init__(
        self,
        searcher: Searcher | Callable[[], Searcher | None],
        max_batch_size: int = 32,
        max_wait_ms: float = 0.0,
        metrics: Metrics | None = None,
        workers: int = 1,
        active: ActiveRequests | None = None,
        linger_ms: float = 0.0,
    ):
        """`searcher` may be a callable returning the current Searcher (the app swaps it on reload).
        With `active` (the app's request count), a query that is the only request in the process
        runs on the event loop itself (see `_submit`). `linger_ms` (adaptive batching only): a batch
        formed under concurrent load waits up to that long for more queries (see `_collect`)."""
        assert max_batch_size >= 1 and max_wait_ms >= 0 and workers >= 1, "bad batching settings"
        assert linger_ms >= 0, "bad batching settings"
        self.linger = float(linger_ms) / 1000.0
        self._source = searcher
        self.max_batch_size = int(max_batch_size)
        self.max_wait = float(max_wait_ms) / 1000.0
        self.metrics = metrics
        self.workers = int(workers)  # batches in flight at once (each in its own thread)
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="softsearch-batch")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._slots: asyncio.Semaphore | None = None  # free batch threads (<= workers batches in flight)
        self._tasks: list[asyncio.Task] = []
        self._running: set[asyncio.Task] = set()
        self._active = active
        self.inline_answers = 0  # queries answered on the event loop (the lone-request path)
        self._in_batches = 0  # queries inside running batches

    def snapshot(self) -> SearchSnapshot:
        """The current searcher's snapshot; NotReadyError if none is loaded."""
        searcher = self._source() if callable(self._source) else self._source
        if searcher is None:
            raise NotReadyError("no index loaded yet")
        return searcher.snapshot()

    @property
    def enabled(self) -> bool:
        return self.max_batch_size > 1

    async def search_image(
        self,
        image: Image.Image | np.ndarray | Callable[[], Image.Image | np.ndarray],
        k: int,
        temperature: float | None = None,
        filter: Filter | None = None,
    ) -> QueryResult:
        """Search with one image; `image` may be a zero-argument decoder (its errors are re-raised here)."""
        return await self._submit(_Pending(image, None, k, temperature, None, filter))  # type: ignore[arg-type]

    async def search_vector(
        self, vector: np.ndarray, k: int, temperature: float | None = None, filter: Filter | None = None
    ) -> QueryResult:
        return await self._submit(_Pending(None, vector, k, temperature, None, filter))  # type: ignore[arg-type]

    async def _submit(self, pending: _Pending) -> QueryResult:
        snapshot = self.snapshot()  # NotReadyError early, before queueing
        if not self.enabled:
            result = (await anyio.to_thread.run_sync(_run_batch, snapshot, [pending]))[0]
            self._observe(1)
            if isinstance(result, Exception):
                raise result
            return result
        self._ensure_worker()
        if self.max_wait == 0 and self._active is not None and not self._running and self._queue.empty():
            # One pass of the loop lets requests that arrived with this one start (and count); if it is
            # still the only request and nothing runs, answer it here: no thread hop there and back,
            # each of which waits for a time slice on a busy machine. It holds the loop for one query.
            await asyncio.sleep(0)
            if self._active.count <= 1 and not self._running and self._queue.empty():
                result = _run_batch(snapshot, [pending])[0]
                self.inline_answers += 1
                self._observe(1)
                if isinstance(result, Exception):
                    raise result
                return result
        pending.future = asyncio.get_running_loop().create_future()
        if (
            self.max_wait == 0
            and self._queue.empty()
            and not self._slots.locked()
            and not self._company_expected(1)
        ):  # type: ignore[union-attr]
            # nothing to batch with and a batch thread is free: run now, without the queue's
            # round trip through the dispatcher task (the batch of one it would form anyway)
            await self._slots.acquire()  # type: ignore[union-attr]  (free: returns at once)
            self._start(snapshot, [pending])
        else:
            await self._queue.put(pending)  # type: ignore[union-attr]
        return await pending.future

    def _ensure_worker(self) -> None:
        """Start the dispatcher on the running loop (test clients may run each request on a new loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or not self._tasks or any(t.done() for t in self._tasks):
            for t in self._tasks:
                if self._loop is loop and not t.done():
                    t.cancel()
            self._loop = loop
            self._queue = asyncio.Queue()
            self._slots = asyncio.Semaphore(self.workers)
            self._running = set()
            self._in_batches = 0
            self._tasks = [loop.create_task(self._dispatch(), name="softsearch-batcher")]

    def _company_expected(self, have: int) -> bool:
        """More HTTP requests are in this process than the `have` queries at hand and those inside running
        batches: the others are being read or parsed and will reach the queue within moments."""
        return self._active is not None and self._active.count > have + self._in_batches

    def _observe(self, size: int) -> None:
        if self.metrics is not None:
            self.metrics.batch_size.observe(size)

    async def _collect(self, first: _Pending) -> list[_Pending]:
        """`first` plus whatever waits in the queue, waiting up to max_wait for up to max_batch_size."""
        queue = self._queue
        assert queue is not None
        batch = [first]
        adaptive = self.max_wait == 0
        # a query gets here only under concurrent load (a lone one runs inline or skips the queue:
        # `_submit`); then an adaptive batch may linger for queries not yet in the process: fuller, fewer
        # batches (less CPU per query, fewer GIL hand-offs between the event loop and the batch thread)
        linger = adaptive and self.linger > 0
        wait = max(GATHER_S, self.linger) if linger else GATHER_S if adaptive else self.max_wait
        deadline = time.monotonic() + wait
        while len(batch) < self.max_batch_size:
            try:
                batch.append(queue.get_nowait())  # already waiting: no need to sleep
                continue
            except asyncio.QueueEmpty:
                pass
            if adaptive and not linger and not self._company_expected(len(batch)):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return [p for p in batch if not p.future.done()]  # drop cancelled (client went away)

    async def _dispatch(self) -> None:
        """Take the first waiting query once a batch thread is free, gather the batch, start it."""
        queue, slots = self._queue, self._slots
        assert queue is not None and slots is not None
        while True:
            first = await queue.get()
            await slots.acquire()  # while every thread is busy, the queue fills: that is the batch
            try:
                batch = await self._collect(first)
            except BaseException:
                slots.release()
                raise
            try:
                snapshot = self.snapshot() if batch else None
            except NotReadyError as err:
                for p in batch:
                    p.future.set_exception(err)
                snapshot = None
            if snapshot is None:
                slots.release()
            else:
                self._start(snapshot, batch)

    def _start(self, snapshot: SearchSnapshot, batch: list[_Pending]) -> None:
        """Run `batch` in a batch thread (its slot is held) and answer its futures when done."""
        self._in_batches += len(batch)
        task = asyncio.get_running_loop().create_task(self._run(snapshot, batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, snapshot: SearchSnapshot, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        slots = self._slots
        assert slots is not None
        try:
            try:
                results = await loop.run_in_executor(self._executor, _run_batch, snapshot, batch)
            except Exception as err:  # noqa: BLE001 - isolate a bad request: retry one by one
                if len(batch) == 1:
                    results = [err]
                else:
                    logger.warning("batch of %d failed (%s); answering one by one", len(batch), err)
                    results = []
                    for p in batch:
                        try:
                            one = await loop.run_in_executor(self._executor, _run_batch, self.snapshot(), [p])
                            results.append(one[0])
                        except Exception as one_err:  # noqa: BLE001
                            results.append(one_err)
        except asyncio.CancelledError:
            for p in batch:
                if not p.future.done():
                    p.future.cancel()
            raise
        finally:
            slots.release()
            self._in_batches -= len(batch)
        self._observe(len(batch))
        for p, r in zip(batch, results):
            if p.future.done():
                continue
            if isinstance(r, Exception):
                p.future.set_exception(r)
            else:
                p.future.set_result(r)

    async def aclose(self) -> None:
        """Stop the dispatcher and running batches (app shutdown)."""
        for task in [*self._tasks, *self._running]:
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
        self._tasks = []
        self._running = set()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
