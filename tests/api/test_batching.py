"""MicroBatcher without HTTP: concurrent calls share batches; answers equal direct searches."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from api.batching import MicroBatcher
from api.metrics import Metrics
from search.serving.searcher import Searcher


@pytest.mark.parametrize("workers", [1, 2])
def test_gathered_queries_are_batched_and_exact(api_index, api_dataset, workers):
    searcher = Searcher(api_index["root"], load=True)
    registry = Metrics()
    batcher = MicroBatcher(searcher, max_batch_size=8, max_wait_ms=50, metrics=registry, workers=workers)
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(10, searcher.snapshot().dim)).astype(np.float32)
    images = [api_dataset.image(i) for i in range(6)]
    ks = [1, 3, 5, 7, 2, 9, 4, 6, 8, 10]
    temps = [None, 0.05, 1.0, None, 0.3, None, 2.0, None, 0.1, None]

    async def go():
        vec = [batcher.search_vector(v, k, t) for v, k, t in zip(vectors, ks, temps)]
        img = [batcher.search_image(im, 4) for im in images]
        try:
            return await asyncio.gather(*vec, *img)
        finally:
            await batcher.aclose()

    results = asyncio.run(go())
    batcher.shutdown()
    total, n = registry.sample("softsearch_batch_size_sum"), registry.sample("softsearch_batch_size_count")
    assert total == 16 and n < 16 and max(r.batch_size for r in results) > 1
    for r, v, k, t in zip(results[:10], vectors, ks, temps):
        ref = searcher.search_vectors(v[None], k, t)
        assert [h.id for h in r.hits] == [h.id for h in ref[0]] and len(r.hits) == k
        np.testing.assert_allclose(
            [h.probability for h in r.hits], [h.probability for h in ref[0]], rtol=1e-5
        )
        assert r.version == api_index["version"]
    ref = searcher.search_images(images, 4)
    for r, hits in zip(results[10:], ref):
        assert [h.id for h in r.hits] == [h.id for h in hits]


def test_bad_vector_in_a_batch_fails_alone(api_index):
    searcher = Searcher(api_index["root"], load=True)
    batcher = MicroBatcher(searcher, max_batch_size=8, max_wait_ms=50)
    good = np.ones(searcher.snapshot().dim, dtype=np.float32)

    async def go():
        try:
            return await asyncio.gather(
                batcher.search_vector(good, 3),
                batcher.search_vector(good[:3], 3),
                batcher.search_vector(good * np.nan, 3),
                batcher.search_vector(good, 2),
                return_exceptions=True,
            )
        finally:
            await batcher.aclose()

    a, b, c, d = asyncio.run(go())
    batcher.shutdown()
    assert isinstance(b, ValueError) and "dimension" in str(b)
    assert isinstance(c, ValueError) and "NaN" in str(c)
    assert [h.id for h in a.hits[:2]] == [h.id for h in d.hits]


@pytest.mark.parametrize("workers", [1, 2])
def test_lone_queries_skip_the_queue_and_batches_never_exceed_the_threads(api_index, monkeypatch, workers):
    """max_wait 0: a query that finds the queue empty and a thread free runs at once as a batch of
    one; under a burst, at most `workers` batches run at the same time and the rest share batches."""
    import threading
    import time

    import api.batching as batching

    searcher = Searcher(api_index["root"], load=True)
    registry = Metrics()
    batcher = MicroBatcher(searcher, max_batch_size=8, max_wait_ms=0, metrics=registry, workers=workers)
    lock = threading.Lock()
    running, peak = [0], [0]
    real = batching._run_batch

    def counted(snapshot, batch):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)  # long enough for the burst to queue up behind the busy threads
        try:
            return real(snapshot, batch)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(batching, "_run_batch", counted)
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(20, searcher.snapshot().dim)).astype(np.float32)

    async def go():
        try:
            alone = [await batcher.search_vector(v, 5) for v in vectors[:4]]  # one after another
            burst = await asyncio.gather(*[batcher.search_vector(v, 5) for v in vectors[4:]])
            return alone, burst
        finally:
            await batcher.aclose()

    alone, burst = asyncio.run(go())
    batcher.shutdown()
    assert [r.batch_size for r in alone] == [1, 1, 1, 1]
    assert peak[0] == workers
    assert max(r.batch_size for r in burst) > 1
    assert registry.sample("softsearch_batch_size_sum") == 20
    for r, v in zip(alone + list(burst), vectors):
        ref = searcher.search_vectors(v[None], 5)
        assert [h.id for h in r.hits] == [h.id for h in ref[0]]
        np.testing.assert_allclose(
            [h.probability for h in r.hits], [h.probability for h in ref[0]], rtol=1e-5
        )


def test_only_request_runs_on_the_event_loop(api_index):
    """With a request count: the only active request is answered on the loop (no thread), the same
    answer as the searcher's; with another request active it goes to the batch threads."""
    import threading

    from api.batching import ActiveRequests

    searcher = Searcher(api_index["root"], load=True)
    active = ActiveRequests()
    batcher = MicroBatcher(searcher, max_batch_size=8, max_wait_ms=0, workers=1, active=active)
    v = np.random.default_rng(2).normal(size=searcher.snapshot().dim).astype(np.float32)
    threads_used = []
    real = searcher.snapshot().search

    async def go(count: int):
        active.count = count
        try:
            return await batcher.search_vector(v, 6, 0.2)
        finally:
            active.count = 0

    snap = searcher.snapshot()
    object.__setattr__(
        snap, "search", lambda *a, **kw: threads_used.append(threading.get_ident()) or real(*a, **kw)
    )
    loop_thread = threading.get_ident()
    try:
        alone = asyncio.run(go(1))
        assert batcher.inline_answers == 1 and threads_used == [loop_thread]
        crowded = asyncio.run(go(2))
        assert batcher.inline_answers == 1 and threads_used[1] != loop_thread
    finally:
        object.__delattr__(snap, "search")
        batcher.shutdown()
    ref = searcher.search_vectors(v[None], 6, 0.2)[0]
    for r in (alone, crowded):
        assert [h.id for h in r.hits] == [h.id for h in ref] and r.batch_size == 1
        np.testing.assert_allclose([h.probability for h in r.hits], [h.probability for h in ref], rtol=1e-6)


def test_a_batch_waits_for_requests_already_in_the_process(api_index, monkeypatch):
    """Adaptive batching (max_wait 0) with three HTTP requests in the process: the first query does not run
    alone while the other two are still being parsed; one batch answers all three, each as the searcher
    alone would. (The gather window is made long so the test cannot depend on the machine's speed: the
    batch closes when the company has arrived, not when the window ends.)"""
    import api.batching as batching
    from api.batching import ActiveRequests

    monkeypatch.setattr(batching, "GATHER_S", 30.0)
    searcher = Searcher(api_index["root"], load=True)
    active = ActiveRequests()
    batcher = MicroBatcher(searcher, max_batch_size=8, max_wait_ms=0, workers=2, active=active)
    vectors = np.random.default_rng(4).normal(size=(3, searcher.snapshot().dim)).astype(np.float32)

    async def late(v, turns):
        for _ in range(turns):  # still "parsing": a few turns of the loop
            await asyncio.sleep(0)
        return await batcher.search_vector(v, 5)

    async def go():
        active.count = 3
        try:
            return await asyncio.wait_for(
                asyncio.gather(*[late(v, t) for v, t in zip(vectors, (0, 3, 6))]), 60
            )
        finally:
            active.count = 0
            await batcher.aclose()

    results = asyncio.run(go())
    batcher.shutdown()
    assert [r.batch_size for r in results] == [3, 3, 3]
    for r, v in zip(results, vectors):
        ref = searcher.search_vectors(v[None], 5)[0]
        assert [h.id for h in r.hits] == [h.id for h in ref]
        np.testing.assert_allclose([h.probability for h in r.hits], [h.probability for h in ref], rtol=1e-6)


@pytest.mark.parametrize("linger_ms", [0.0, 60_000.0])
def test_a_batch_under_load_lingers_for_queries_not_yet_in_the_process(api_index, linger_ms):
    """--batch-linger-ms: a batch formed while the batch thread was busy waits for a query that arrives
    later (it closes when full, not when the long window ends); without it that query runs alone. A lone
    query never lingers: it is answered on the event loop at once. Every answer is the searcher's own."""
    from api.batching import ActiveRequests

    searcher = Searcher(api_index["root"], load=True)
    batcher = MicroBatcher(searcher, max_batch_size=2, max_wait_ms=0, workers=1, linger_ms=linger_ms)
    vectors = np.random.default_rng(6).normal(size=(3, searcher.snapshot().dim)).astype(np.float32)

    async def later(v):
        await asyncio.sleep(0.2)  # not yet in the process when the batch before it formed
        return await batcher.search_vector(v, 5)

    async def go():
        try:  # the first takes the only batch thread at once; the second queues behind it
            return await asyncio.wait_for(
                asyncio.gather(
                    batcher.search_vector(vectors[0], 5),
                    batcher.search_vector(vectors[1], 5),
                    later(vectors[2]),
                ),
                30,
            )
        finally:
            await batcher.aclose()

    results = asyncio.run(go())
    batcher.shutdown()
    assert [r.batch_size for r in results] == ([1, 2, 2] if linger_ms else [1, 1, 1])
    for r, v in zip(results, vectors):
        ref = searcher.search_vectors(v[None], 5)[0]
        assert [h.id for h in r.hits] == [h.id for h in ref]
        np.testing.assert_allclose([h.probability for h in r.hits], [h.probability for h in ref], rtol=1e-6)

    active = ActiveRequests()
    lone = MicroBatcher(
        searcher, max_batch_size=8, max_wait_ms=0, workers=1, active=active, linger_ms=linger_ms
    )

    async def alone():
        active.count = 1
        try:
            return await asyncio.wait_for(lone.search_vector(vectors[0], 5), 30)
        finally:
            active.count = 0
            await lone.aclose()

    r = asyncio.run(alone())
    lone.shutdown()
    assert r.batch_size == 1 and lone.inline_answers == 1
    assert [h.id for h in r.hits] == [h.id for h in results[0].hits]
