"""POST /v1/search/text and /v1/search/text/batch: images found by words, with calibrated probabilities.

The text is embedded by the served version's text tower (search/serving/text.py) and searched as a
query vector, at the version's text temperature (calibrated on held-out captions, stored in the
manifest) unless the request names one. A version without a text tower answers 409."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Response
from pydantic import Field

from api.deps import ApiError, SearchContext, search_context
from api.routes.models import (
    ERROR_RESPONSES,
    MAX_BATCH_QUERIES,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    BatchResponse,
    ErrorResponse,
    JsonPageQuery,
    SearchResponse,
)
from api.routes.search import fetch_count, query_filter, result_body, result_response
from search.serving.text import NoTextTowerError, encode_texts, text_temperature
from training.text import MAX_TEXT_CHARS

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["search"])

TEXT_RESPONSES = {
    **ERROR_RESPONSES,
    409: {"model": ErrorResponse, "description": "the served index version has no text tower"},
}
_TEMPERATURE_DOC = (
    "softmax temperature; default: the index's text temperature (calibrated on held-out captions)"
)


class TextQuery(JsonPageQuery):
    model_config = {"extra": "forbid"}
    text: str = Field(
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        pattern=r"\S",
        description="words describing the images wanted (not only white space)",
    )
    k: int = Field(10, ge=1, description="results to return, 1..max_k")
    temperature: float | None = Field(
        None, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False, description=_TEMPERATURE_DOC
    )


class BatchTextQuery(JsonPageQuery):
    model_config = {"extra": "forbid"}
    texts: list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS, pattern=r"\S")]] = Field(
        min_length=1, max_length=MAX_BATCH_QUERIES, description="one text per query"
    )
    k: int = Field(10, ge=1, description="results per query, 1..max_k")
    temperature: float | None = Field(
        None, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False, description=_TEMPERATURE_DOC
    )


async def _text_jobs(ctx: SearchContext, texts: list[str], query) -> list:
    """One search job per text: embedded off the event loop, then searched like a vector."""
    snapshot = ctx.snapshot
    fetch = fetch_count(query.k, query.offset, ctx.settings)
    flt = query_filter(query.filter, snapshot)
    try:
        vectors = await anyio.to_thread.run_sync(encode_texts, snapshot, texts)
        tau = query.temperature if query.temperature is not None else text_temperature(snapshot)
    except NoTextTowerError as err:
        raise ApiError(409, "no_text_tower", str(err)) from err
    except ValueError as err:
        raise ApiError(422, "bad_text", str(err)) from err
    return [ctx.batcher.search_vector(v, fetch, tau, flt) for v in vectors]


@router.post("/search/text", response_model=SearchResponse, responses=TEXT_RESPONSES)
async def search_text(
    query: TextQuery,
    ctx: Annotated[SearchContext, Depends(search_context("application/json"))],
) -> Response:
    """Top-k indexed images for a text, with exact softmax probabilities at the calibrated text
    temperature."""
    (job,) = await _text_jobs(ctx, [query.text], query)
    try:
        result = await job
    except ValueError as err:
        raise ApiError(422, "bad_query", str(err)) from err
    ctx.metrics.queries.labels(kind="text").inc()
    return result_response(
        result, query.k, offset=query.offset, min_probability=query.min_probability, mass=query.mass
    )


@router.post("/search/text/batch", response_model=BatchResponse, responses=TEXT_RESPONSES)
async def search_text_batch(
    query: BatchTextQuery,
    ctx: Annotated[SearchContext, Depends(search_context("application/json"))],
) -> Response:
    """Several texts in one request (one k, temperature, filter and cut-offs); each answered as
    /v1/search/text."""
    jobs = await _text_jobs(ctx, list(query.texts), query)
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for i, r in enumerate(results):
        if isinstance(r, ValueError):
            raise ApiError(422, "bad_query", f"texts[{i}]: {r}")
        if isinstance(r, BaseException):
            raise r
    ctx.metrics.queries.labels(kind="batch_text").inc(len(results))
    body = BatchResponse(
        responses=[
            result_body(
                r, query.k, offset=query.offset, min_probability=query.min_probability, mass=query.mass
            )
            for r in results
        ]
    )
    return Response(body.model_dump_json(), media_type="application/json")
