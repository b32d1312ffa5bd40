"""MicroBatcher without HTTP: concurrent calls share batches; answers equal direct searches."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from api.batching import MicroBatcher
from api.metrics import Metrics
from search.searcher import Searcher


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
        np.testing.assert_allclose([h.probability for h in r.hits], [h.probability for h in ref[0]], rtol=1e-5)
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
            return await asyncio.gather(batcher.search_vector(good, 3), batcher.search_vector(good[:3], 3),
                                        batcher.search_vector(good * np.nan, 3), batcher.search_vector(good, 2),
                                        return_exceptions=True)
        finally:
            await batcher.aclose()

    a, b, c, d = asyncio.run(go())
    batcher.shutdown()
    assert isinstance(b, ValueError) and "dimension" in str(b)
    assert isinstance(c, ValueError) and "NaN" in str(c)
    assert [h.id for h in a.hits[:2]] == [h.id for h in d.hits]
