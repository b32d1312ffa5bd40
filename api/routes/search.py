"""POST /v1/search (image upload), /v1/search/vector (JSON embedding), /v1/search/item (stored item) and
/v1/search/batch (several images or vectors); each takes a metadata `filter` and probability cut-offs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from functools import partial
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Request, Response, UploadFile
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile as StarletteUpload

from api import vector_body
from api.batching import QueryResult
from api.deps import ApiError, SearchContext, check_k, decode_image, search_context
from api.routes.models import (
    ERROR_RESPONSES,
    FILTER_DOC,
    MASS_DOC,
    MAX_BATCH_QUERIES,
    MAX_TEMPERATURE,
    MIN_PROBABILITY_DOC,
    MIN_TEMPERATURE,
    OFFSET_DOC,
    BatchImageForm,
    BatchResponse,
    BatchVectorQuery,
    ErrorResponse,
    HitOut,
    ItemQuery,
    NormaliserOut,
    PeakednessOut,
    SearchResponse,
)
from api.vector_body import vector_openapi
from search.serving.cutoffs import cut_and_page
from search.serving.filters import Filter, FilterError, parse_filter
from search.serving.peakedness import peakedness
from search.serving.queries import unit_queries
from search.serving.searcher import NO_ENCODER, NoEncoderError
from training.images import cache_resolution

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["search"])

#: image routes also answer 409 on a version built from vectors (no encoder)
IMAGE_RESPONSES = {
    **ERROR_RESPONSES,
    409: {
        "model": ErrorResponse,
        "description": "the served index version has no encoder (built from vectors)",
    },
}


def fetch_count(k: int, offset: int, settings) -> int:
    """Hits to fetch for a page: k + offset, each at most the server's max_k (422 beyond; two bounds the
    OpenAPI schema can state, api/openapi.py), so a page fetches at most 2 max_k hits."""
    check_k(k, settings)
    if offset > settings.max_k:
        raise ApiError(
            422, "offset_out_of_range", f"offset must be at most {settings.max_k} (max_k), got {offset}"
        )
    return k + offset


def query_filter(spec, snapshot) -> Filter | None:
    """The request's filter parsed against the served version's metadata fields (422 naming the field,
    400 nested too deep)."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "null")):  # JSON null: no filter
        return None
    try:
        return parse_filter(spec, snapshot.metadata_fields)
    except FilterError as err:  # 422 bad_filter; 400 filter_too_deep, as for a JSON body nested too deep
        raise ApiError(err.status, err.code, str(err)) from err


def _require_encoder(snapshot) -> None:
    """409 for an image query on a version built from vectors (it has no encoder to embed the image)."""
    if snapshot.encoder is None:
        raise ApiError(
            409,
            "no_encoder",
            f"{NO_ENCODER} (POST /v1/search/vector, /v1/search/item or a JSON "
            f"/v1/search/batch); index version {snapshot.version} was built from vectors",
        )


def _unit_vector(values: list[float], snapshot, where: str = "vector") -> np.ndarray:
    """A query embedding checked against the served version (422 naming the problem), unit length, float32."""
    try:
        return unit_queries(values, snapshot.dim, where)[0]
    except ValueError as err:
        raise ApiError(422, "bad_vector", str(err)) from err


def result_response(
    result: QueryResult,
    k: int,
    self_rank: int | None = None,
    offset: int = 0,
    min_probability: float | None = None,
    mass: float | None = None,
) -> Response:
    """The SearchResponse as JSON, validated once and serialised by pydantic (returned as a model,
    FastAPI would validate it a second time and encode it again in Python: ~3x the time)."""
    body = result_body(result, k, self_rank, offset, min_probability, mass)
    return Response(body.model_dump_json(), media_type="application/json")


def result_body(
    result: QueryResult,
    k: int,
    self_rank: int | None = None,
    offset: int = 0,
    min_probability: float | None = None,
    mass: float | None = None,
) -> SearchResponse:
    """One query's SearchResponse. `result.hits` are the ranked hits fetched; the cut-offs and the page
    are applied here, and the peakedness is measured on the ranked hits before paging."""
    ranked = result.hits
    population = result.count if result.matched is None else result.matched  # what the softmax runs over
    page = cut_and_page(
        [h.probability for h in ranked],
        k,
        offset,
        min_probability,
        mass,
        fetched_all=len(ranked) >= population,
    )
    body = SearchResponse(
        version=result.version,
        k=k,
        count=result.count,
        temperature=result.temperature,
        log_normaliser=(log_z := result.log_normaliser if population > 0 else None),
        log_normalizer=log_z,
        batch_size=result.batch_size,
        normaliser=None
        if (n := result.normaliser) is None or population == 0
        else NormaliserOut(
            method=n.method, lower=n.lower, upper=n.upper, interval=n.interval, level=n.level, rows=n.rows
        ),
        results=[
            HitOut(id=h.id, row=h.row, similarity=h.similarity, probability=h.probability)
            for h in ranked[page.start : page.stop]
        ],
        peakedness=PeakednessOut(**vars(peakedness([h.probability for h in ranked], population)))
        if population > 0
        else None,
        self_rank=self_rank,
        offset=offset,
        n_passed=page.n_passed,
        more_may_pass=page.more_may_pass,
        matched=result.matched,
    )
    return body


@router.post("/search", response_model=SearchResponse, responses=IMAGE_RESPONSES)
async def search_image(
    ctx: Annotated[SearchContext, Depends(search_context("multipart/form-data"))],
    file: Annotated[UploadFile, File(description="query image (PNG, JPEG, ...)")],
    k: Annotated[
        int, Form(ge=1, description="results to return, 1..max_k (server setting, default 100)")
    ] = 10,
    temperature: Annotated[
        float | None,
        Form(
            ge=MIN_TEMPERATURE,
            le=MAX_TEMPERATURE,
            allow_inf_nan=False,
            description="softmax temperature; default: the index's",
        ),
    ] = None,
    offset: Annotated[int, Form(ge=0, description=OFFSET_DOC)] = 0,
    min_probability: Annotated[
        float | None, Form(ge=0.0, le=1.0, allow_inf_nan=False, description=MIN_PROBABILITY_DOC)
    ] = None,
    mass: Annotated[float | None, Form(gt=0.0, le=1.0, allow_inf_nan=False, description=MASS_DOC)] = None,
    filter: Annotated[str | None, Form(description=FILTER_DOC + " (as JSON text)")] = None,
) -> Response:
    """Top-k most similar indexed images to an uploaded image, with exact softmax probabilities."""
    settings, snapshot = ctx.settings, ctx.snapshot
    _require_encoder(snapshot)
    fetch = fetch_count(k, offset, settings)
    flt = query_filter(filter, snapshot)
    data = await file.read(settings.max_upload_bytes + 1)
    # decoded as an indexed file was (training/images.py), where the query runs (batch thread, or the loop
    # when alone)
    decode = partial(
        decode_image,
        data,
        settings,
        side=cache_resolution(snapshot.encoder.image_size),
        square=snapshot.file_backed,
    )
    try:
        result = await ctx.batcher.search_image(decode, fetch, temperature, flt)
    except NoEncoderError as err:  # a version built from vectors was swapped in meanwhile
        raise ApiError(409, "no_encoder", str(err)) from err
    except ValueError as err:
        raise ApiError(422, "bad_query", str(err)) from err
    ctx.metrics.queries.labels(kind="image").inc()
    return result_response(result, k, offset=offset, min_probability=min_probability, mass=mass)


@router.post(
    "/search/vector", response_model=SearchResponse, responses=ERROR_RESPONSES, openapi_extra=vector_openapi()
)
async def search_vector(
    request: Request,
    ctx: Annotated[SearchContext, Depends(search_context(vector_body.JSON, vector_body.OCTET))],
) -> Response:
    """Top-k for a query embedding (cosine similarity; the vector is normalised to unit length).

    The body is a JSON VectorQuery, or (`Content-Type: application/octet-stream`) the vector itself as
    little-endian float32 values, 4 x dim bytes, with k, temperature, offset, min_probability, mass and
    filter (JSON text) in the query string, e.g. `POST /v1/search/vector?k=10`: no JSON parsing at all.
    Query-string fields also apply to a JSON body, whose own fields take precedence."""
    query = await vector_body.read_vector_query(request, ctx.media)
    return await answer_vector(query, ctx.snapshot, ctx.settings, ctx.batcher, ctx.metrics)


async def answer_vector(query, snapshot, settings, batcher, metrics) -> Response:
    """The answer to a parsed vector query (`vector_body.parse_vector_query`) on one snapshot: the route
    above and the raw ASGI path (api/vector_path.py) both answer through here, so their bytes agree."""
    fetch = fetch_count(query.k, query.offset, settings)
    flt = query_filter(query.filter, snapshot)
    vector = _unit_vector(query.vector, snapshot)
    try:
        result = await batcher.search_vector(vector, fetch, query.temperature, flt)
    except ValueError as err:
        raise ApiError(422, "bad_vector", str(err)) from err
    response = vector_body.json_response(
        result_body(
            result, query.k, offset=query.offset, min_probability=query.min_probability, mass=query.mass
        )
    )
    metrics.queries.labels(kind="vector").inc()
    return response


@router.post(
    "/search/item",
    response_model=SearchResponse,
    responses={
        **ERROR_RESPONSES,
        404: {"model": ErrorResponse, "description": "no item with this id in the served version"},
    },
)
async def search_item(
    query: ItemQuery,
    ctx: Annotated[SearchContext, Depends(search_context("application/json"))],
) -> Response:
    """Top-k similar to an indexed item, searched with its stored embedding (no decode, no re-encode).

    The item itself (normally rank 1) is reported as `self_rank` and left out of `results` unless
    `include_self`; its probability is the same p(j|x) as for any other hit."""
    snapshot = ctx.snapshot
    fetch = fetch_count(query.k, query.offset, ctx.settings)
    flt = query_filter(query.filter, snapshot)
    try:
        row = snapshot.row_of(query.id)
    except KeyError as err:
        raise ApiError(
            404, "item_not_found", f"no item {query.id!r} in index version {snapshot.version}"
        ) from err
    vector = unit_queries(snapshot.index.embeddings[row], snapshot.dim)[0]  # the stored row (already unit)
    wanted = fetch if query.include_self else min(fetch + 1, snapshot.count)
    try:
        result = await ctx.batcher.search_vector(vector, wanted, query.temperature, flt)
    except ValueError as err:
        raise ApiError(422, "bad_query", str(err)) from err
    ranks = [i for i, h in enumerate(result.hits) if h.id == query.id]
    self_rank = ranks[0] + 1 if ranks else None
    if not query.include_self:  # the item leaves the ranking; the others keep their probabilities
        result = dataclasses.replace(result, hits=[h for h in result.hits if h.id != query.id][:fetch])
    ctx.metrics.queries.labels(kind="item").inc()
    return result_response(
        result,
        query.k,
        self_rank,
        offset=query.offset,
        min_probability=query.min_probability,
        mass=query.mass,
    )


def _batch_openapi() -> dict:
    """The two request bodies /v1/search/batch accepts (FastAPI cannot declare both from parameters)."""
    form = BatchImageForm.model_json_schema()
    form["properties"] = {
        "files": {
            "type": "array",
            "items": {"type": "string", "format": "binary"},
            "minItems": 1,
            "maxItems": MAX_BATCH_QUERIES,
            "description": "query images",
        },
        **{k: v for k, v in form["properties"].items() if k != "filter"},
        "filter": {"type": "string", "description": FILTER_DOC + " (as JSON text)"},
    }
    form["required"] = ["files"]
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": BatchVectorQuery.model_json_schema()},
                "multipart/form-data": {"schema": form},
            },
        }
    }


@router.post(
    "/search/batch", response_model=BatchResponse, responses=IMAGE_RESPONSES, openapi_extra=_batch_openapi()
)
async def search_batch(
    request: Request,
    ctx: Annotated[SearchContext, Depends(search_context("application/json", "multipart/form-data"))],
) -> Response:
    """Several queries in one request: images (multipart, repeated `files` parts) or vectors (JSON
    `vectors`), with one k, temperature, filter and cut-offs for all. Each is answered exactly as the
    single-query route would answer it; together they share encoder forwards and index searches."""
    snapshot = ctx.snapshot
    if ctx.media == "application/json":
        try:
            query = BatchVectorQuery.model_validate_json(await request.body())
        except ValidationError as err:
            raise _request_error(err, "body") from err
        fetch = fetch_count(query.k, query.offset, ctx.settings)
        flt = query_filter(query.filter, snapshot)
        vectors = [_unit_vector(v, snapshot, f"vectors[{i}]") for i, v in enumerate(query.vectors)]
        jobs = [ctx.batcher.search_vector(v, fetch, query.temperature, flt) for v in vectors]
        kind = "vector"
    else:
        query, flt, jobs = await _image_batch(request, ctx)
        kind = "image"
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for i, r in enumerate(results):
        if isinstance(r, NoEncoderError):
            raise ApiError(409, "no_encoder", str(r))
        if isinstance(r, ApiError):
            raise ApiError(
                r.status_code, r.code, f"{'files' if kind == 'image' else 'vectors'}[{i}]: {r.detail}"
            )
        if isinstance(r, ValueError):
            raise ApiError(422, "bad_query", f"query {i}: {r}")
        if isinstance(r, BaseException):
            raise r
    ctx.metrics.queries.labels(kind=f"batch_{kind}").inc(len(results))
    body = BatchResponse(
        responses=[
            result_body(
                r, query.k, offset=query.offset, min_probability=query.min_probability, mass=query.mass
            )
            for r in results
        ]
    )
    return Response(body.model_dump_json(), media_type="application/json")


def _request_error(err: ValidationError, where: str) -> RequestValidationError:
    """A pydantic error of a hand-parsed body, located as FastAPI locates its own (`body`, field, ...)."""
    return RequestValidationError([{**e, "loc": (where, *e.get("loc", ()))} for e in err.errors()])


async def _image_batch(request: Request, ctx: SearchContext):
    """(form fields, filter, one search job per uploaded image) of a multipart batch."""
    settings, snapshot = ctx.settings, ctx.snapshot
    _require_encoder(snapshot)
    form = await request.form(max_files=MAX_BATCH_QUERIES, max_fields=16)
    files = [f for f in form.getlist("files") if isinstance(f, StarletteUpload)]
    if not files:
        raise ApiError(422, "no_files", "a multipart batch needs one or more `files` parts (images)")
    fields = {k: v for k, v in form.multi_items() if k != "files"}
    if any(not isinstance(v, str) for v in fields.values()):
        raise ApiError(422, "bad_form", "only `files` parts may be files")
    text_filter = fields.pop("filter", None)
    try:
        query = BatchImageForm.model_validate({k: (None if v == "" else v) for k, v in fields.items()})
    except ValidationError as err:
        raise _request_error(err, "form") from err
    fetch = fetch_count(query.k, query.offset, settings)
    flt = query_filter(text_filter, snapshot)
    side, square = cache_resolution(snapshot.encoder.image_size), snapshot.file_backed
    jobs = []
    for upload in files:
        data = await upload.read(settings.max_upload_bytes + 1)
        decode = partial(decode_image, data, settings, side=side, square=square)
        jobs.append(ctx.batcher.search_image(decode, fetch, query.temperature, flt))
    return query, flt, jobs
