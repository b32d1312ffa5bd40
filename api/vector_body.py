"""The two bodies POST /v1/search/vector takes, read without FastAPI's per-request JSON machinery.

* ``application/json``: the VectorQuery object, parsed by orjson and validated by pydantic once
  (FastAPI's own body handling parses with the standard library and validates through more layers:
  about 3x the time for a 512-float vector, bench/profile_query.py).
* ``application/octet-stream``: the vector itself as little-endian float32 (4 x dim bytes, no
  parsing at all), the other fields (k, temperature, offset, min_probability, mass, filter as JSON
  text) in the query string (where a JSON body may also put them; its own fields take precedence).

Answers are encoded by orjson from the validated response model (`json_response`).
"""

from __future__ import annotations

import orjson
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import QueryParams

from api.routes.models import (
    FILTER_DOC,
    MASS_DOC,
    MIN_PROBABILITY_DOC,
    OFFSET_DOC,
    QueryTemperature,
    VectorQuery,
)

OCTET = "application/octet-stream"
JSON = "application/json"


class VectorParams(BaseModel):
    """The query-string fields of a binary (octet-stream) vector query."""

    model_config = {"extra": "forbid"}
    k: int = Field(10, ge=1, description="results to return, 1..max_k")
    temperature: QueryTemperature = None
    offset: int = Field(0, ge=0, description=OFFSET_DOC)
    min_probability: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False, description=MIN_PROBABILITY_DOC
    )
    mass: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description=MASS_DOC)
    filter: str | None = Field(None, description=FILTER_DOC + " (as JSON text)")


class BinaryVectorQuery:
    """A parsed binary query: the raw float32 vector and the query-string fields (VectorQuery's names)."""

    def __init__(self, vector, params: VectorParams):
        self.vector = vector
        self.k, self.temperature, self.offset = params.k, params.temperature, params.offset
        self.min_probability, self.mass, self.filter = params.min_probability, params.mass, params.filter


def _invalid(err: ValidationError, where: str) -> RequestValidationError:
    """A pydantic error located as FastAPI locates its own (`body` / `query`, field, ...)."""
    return RequestValidationError([{**e, "loc": (where, *e.get("loc", ()))} for e in err.errors()])


async def read_vector_query(request: Request, media: str) -> VectorQuery | BinaryVectorQuery:
    """The request's query: JSON (422 as FastAPI words it for bad JSON or fields) or binary float32
    (the vector as a numpy array, its length and values checked by the route against the served index).
    Query-string fields apply to both; a JSON body's own fields take precedence over them."""
    return parse_vector_query(await request.body(), media, request.scope.get("query_string") or b"")


def parse_vector_query(body: bytes, media: str, query_string: bytes) -> VectorQuery | BinaryVectorQuery:
    """`read_vector_query` on a body already read and the raw query string (the route and the raw ASGI
    path, api/vector_path.py, share it, so both parse and refuse alike)."""
    from api.deps import ApiError

    query = QueryParams(query_string) if query_string else None
    if query is not None and len(query.getlist("filter")) > 1:
        raise ApiError(422, "bad_filter", "give `filter` once")
    if query is not None or media == OCTET:
        try:
            params = VectorParams.model_validate(dict(query) if query is not None else {})
        except ValidationError as err:
            raise _invalid(err, "query") from err
    else:  # a JSON body and no query string: nothing to merge (skips a validation per request)
        params = None
    if media == OCTET:
        import numpy as np

        if len(body) % 4:
            raise ApiError(
                422,
                "bad_vector",
                f"an octet-stream body is little-endian float32 values: {len(body)} "
                "bytes is not a multiple of 4",
            )
        return BinaryVectorQuery(np.frombuffer(body, dtype="<f4"), params)
    if not body:  # as FastAPI words a missing body
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = _stdlib_json(
            body
        )  # NaN / Infinity / 1e999 literals: parsed, then refused as a bad vector (422)
    from_query = params.model_dump(exclude_unset=True) if params is not None else {}
    if from_query and isinstance(data, dict):
        if from_query.get("filter") is not None:
            try:
                from_query["filter"] = orjson.loads(from_query["filter"])
            except orjson.JSONDecodeError as err:
                raise ApiError(422, "bad_filter", f"filter is not JSON: {err.msg}") from err
        data = {**from_query, **data}
    try:
        return VectorQuery.model_validate(data)
    except ValidationError as err:
        raise _invalid(err, "body") from err


def _stdlib_json(body: bytes):
    """What FastAPI's parser (the standard library's) makes of a body orjson refuses: non-finite number
    literals parse (the vector check refuses them, 422 bad_vector); anything else is malformed (400)."""
    import json

    try:
        return json.loads(body)
    except (
        ValueError,
        RecursionError,
    ) as err:  # malformed, undecodable, nested past the parser, over int digits
        pos, msg = (
            (err.pos, err.msg)
            if isinstance(err, json.JSONDecodeError)
            else (err.start, str(err))
            if isinstance(err, UnicodeDecodeError)
            else (0, str(err))
        )
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": msg},
                }
            ]
        ) from err


def json_response(body: BaseModel) -> Response:
    """`body` (an already validated response model) as JSON, encoded by orjson."""
    return Response(orjson.dumps(body.model_dump()), media_type=JSON)


def vector_openapi() -> dict:
    """The JSON request body of POST /v1/search/vector (the route reads its body itself). The binary body
    is described in the operation's text, not as a second media type with query parameters: a
    schema-driven client or fuzzer would send arbitrary bytes and strings there that only the served
    index's dimension and metadata fields make valid (api/openapi.py states those for JSON bodies)."""
    return {"requestBody": {"required": True, "content": {JSON: {"schema": VectorQuery.model_json_schema()}}}}
