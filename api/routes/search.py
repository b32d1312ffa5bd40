"""POST /v1/search (image upload), POST /v1/search/vector (JSON embedding), POST /v1/search/item (stored item)."""
from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Response, UploadFile

from api.batching import QueryResult
from api.deps import ApiError, SearchContext, check_k, decode_image, search_context
from api.routes.models import ERROR_RESPONSES, MASS_DOC, MAX_TEMPERATURE, MIN_PROBABILITY_DOC, MIN_TEMPERATURE, \
    OFFSET_DOC, HitOut, NormaliserOut, ItemQuery, PeakednessOut, SearchResponse, VectorQuery
from search.serving.cutoffs import cut_and_page
from search.serving.peakedness import peakedness
from training.images import cache_resolution

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["search"])


def _fetch_count(k: int, offset: int, settings) -> int:
    """Hits to fetch for a page: k + offset, bounded by the server's max_k (422 beyond)."""
    check_k(k, settings)
    if offset + k > settings.max_k:
        raise ApiError(422, "k_out_of_range",
                       f"k + offset must be at most {settings.max_k} (max_k), got {k} + {offset}")
    return k + offset


def _response(result: QueryResult, k: int, self_rank: int | None = None, offset: int = 0,
              min_probability: float | None = None, mass: float | None = None) -> Response:
    """The SearchResponse as JSON, validated once and serialised by pydantic (returned as a model,
    FastAPI would validate it a second time and encode it again in Python: ~3x the time).

    `result.hits` are the ranked hits fetched; the cut-offs and the page are applied here, and the
    peakedness is measured on the ranked hits before paging."""
    ranked = result.hits
    page = cut_and_page([h.probability for h in ranked], k, offset, min_probability, mass,
                        fetched_all=len(ranked) >= result.count)
    body = SearchResponse(
        version=result.version, k=k, count=result.count, temperature=result.temperature,
        log_normalizer=result.log_normalizer, batch_size=result.batch_size,
        normaliser=None if (n := result.normaliser) is None else NormaliserOut(
            method=n.method, lower=n.lower, upper=n.upper, interval=n.interval, level=n.level, rows=n.rows),
        results=[HitOut(id=h.id, row=h.row, similarity=h.similarity, probability=h.probability)
                 for h in ranked[page.start : page.stop]],
        peakedness=PeakednessOut(**vars(peakedness([h.probability for h in ranked], result.count)))
        if result.count > 0 else None,
        self_rank=self_rank, offset=offset, n_passed=page.n_passed, more_may_pass=page.more_may_pass,
    )
    return Response(body.model_dump_json(), media_type="application/json")


@router.post("/search", response_model=SearchResponse, responses=ERROR_RESPONSES)
async def search_image(
    ctx: Annotated[SearchContext, Depends(search_context("multipart/form-data"))],
    file: Annotated[UploadFile, File(description="query image (PNG, JPEG, ...)")],
    k: Annotated[int, Form(ge=1, description="results to return, 1..max_k (server setting, default 100)")] = 10,
    temperature: Annotated[float | None, Form(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False,
                                              description="softmax temperature; default: the index's")] = None,
    offset: Annotated[int, Form(ge=0, description=OFFSET_DOC)] = 0,
    min_probability: Annotated[float | None, Form(ge=0.0, le=1.0, allow_inf_nan=False,
                                                  description=MIN_PROBABILITY_DOC)] = None,
    mass: Annotated[float | None, Form(gt=0.0, le=1.0, allow_inf_nan=False, description=MASS_DOC)] = None,
) -> Response:
    """Top-k most similar indexed images to an uploaded image, with exact softmax probabilities."""
    settings, snapshot = ctx.settings, ctx.snapshot
    fetch = _fetch_count(k, offset, settings)
    data = await file.read(settings.max_upload_bytes + 1)
    # decoded as an indexed file was (training/images.py), where the query runs (batch thread or, alone, the loop)
    decode = partial(decode_image, data, settings, side=cache_resolution(snapshot.encoder.image_size),
                     square=snapshot.file_backed)
    try:
        result = await ctx.batcher.search_image(decode, fetch, temperature)
    except ValueError as err:
        raise ApiError(422, "bad_query", str(err)) from err
    ctx.metrics.queries.labels(kind="image").inc()
    return _response(result, k, offset=offset, min_probability=min_probability, mass=mass)


@router.post("/search/vector", response_model=SearchResponse, responses=ERROR_RESPONSES)
async def search_vector(
    query: VectorQuery, ctx: Annotated[SearchContext, Depends(search_context("application/json"))],
) -> Response:
    """Top-k for a query embedding (cosine similarity; the vector is normalised to unit length)."""
    snapshot = ctx.snapshot
    fetch = _fetch_count(query.k, query.offset, ctx.settings)
    if len(query.vector) != snapshot.dim:
        raise ApiError(422, "bad_vector",
                       f"vector has {len(query.vector)} values; the index dimension is {snapshot.dim}")
    if not all(math.isfinite(v) for v in query.vector):
        raise ApiError(422, "bad_vector", "vector contains NaN or inf")
    vector = np.asarray(query.vector, dtype=np.float64)
    if np.abs(vector).max() > np.finfo(np.float32).max:
        raise ApiError(422, "bad_vector", "vector values overflow float32")
    if not np.any(vector):
        raise ApiError(422, "bad_vector", "vector has zero norm")
    vector = vector / np.linalg.norm(vector)  # in float64 first: tiny values must not underflow to 0
    try:
        result = await ctx.batcher.search_vector(vector.astype(np.float32), fetch, query.temperature)
    except ValueError as err:
        raise ApiError(422, "bad_vector", str(err)) from err
    ctx.metrics.queries.labels(kind="vector").inc()
    return _response(result, query.k, offset=query.offset, min_probability=query.min_probability, mass=query.mass)


@router.post("/search/item", response_model=SearchResponse, responses=ERROR_RESPONSES)
async def search_item(
    query: ItemQuery, ctx: Annotated[SearchContext, Depends(search_context("application/json"))],
) -> Response:
    """Top-k similar to an indexed item, searched with its stored embedding (no decode, no re-encode).

    The item itself (normally rank 1) is reported as `self_rank` and left out of `results` unless
    `include_self`; its probability is the same p(j|x) as for any other hit."""
    snapshot = ctx.snapshot
    fetch = _fetch_count(query.k, query.offset, ctx.settings)
    try:
        row = snapshot.row_of(query.id)
    except KeyError as err:
        raise ApiError(404, "item_not_found", f"no item {query.id!r} in index version {snapshot.version}") from err
    vector = np.asarray(snapshot.index.embeddings[row], dtype=np.float64)
    vector = vector / np.linalg.norm(vector)
    wanted = fetch if query.include_self else min(fetch + 1, snapshot.count)
    result = await ctx.batcher.search_vector(vector.astype(np.float32), wanted, query.temperature)
    ranks = [i for i, h in enumerate(result.hits) if h.id == query.id]
    self_rank = ranks[0] + 1 if ranks else None
    if not query.include_self:   # the item leaves the ranking; the others keep their probabilities
        result = dataclasses.replace(result, hits=[h for h in result.hits if h.id != query.id][:fetch])
    ctx.metrics.queries.labels(kind="item").inc()
    return _response(result, query.k, self_rank, offset=query.offset, min_probability=query.min_probability,
                     mass=query.mass)
