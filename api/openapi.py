"""The served OpenAPI document states the limits the routes enforce at run time.

FastAPI builds the schema from the route declarations once; two limits are only known when serving:
`k` and `offset` are at most the server's `max_k`, and a query vector has exactly the served index's
dimension (at least one non-zero value, each within float32), and a `filter` names the served
version's metadata fields with values of their types (search/serving/filters.py: filter_json_schema).
`install_served_openapi` makes /openapi.json (and /docs) patch those into a copy of the static schema,
per served version shape, so a client (or a fuzzer) generating schema-valid requests is never refused
for a limit it could not see. An upload part is stated as what the decoder takes: non-empty, of an
image media type (the multipart `encoding`; "a decodable image" is beyond JSON Schema, so a fuzzer
needs a generator for those media types: tests/api/schemathesis_hooks.py).
"""

from __future__ import annotations

import copy
import threading

import numpy as np
from fastapi import FastAPI

from search.serving.filters import filter_json_schema

#: largest finite float32: a larger query value overflows when the vector is cast (422 bad_vector)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _vector_schema(dim: int | None) -> dict:
    """A query embedding: `dim` finite float32 values, not all zero (a zero vector has no direction)."""
    schema = {
        "type": "array",
        "items": {"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX},
        "contains": {"not": {"const": 0}},
    }
    if dim is not None:
        schema["minItems"] = schema["maxItems"] = dim
    return schema


FILTER_REF = "#/components/schemas/Filter"
#: the media types an upload part may have (Pillow decodes each; the service reads the bytes, not the label)
IMAGE_MEDIA_TYPES = "image/png, image/jpeg, image/gif, image/webp, image/bmp, image/tiff"


def _is_binary(schema: object) -> bool:
    """A file part: `format: binary`, or OpenAPI 3.1's `contentMediaType: application/octet-stream`."""
    return (
        isinstance(schema, dict)
        and schema.get("type") == "string"
        and (schema.get("format") == "binary" or schema.get("contentMediaType") == "application/octet-stream")
    )


def _image_parts(form: dict, media: dict) -> None:
    """Each file part of a multipart form (one file or a list of them) is a non-empty image. A list's
    media types are stated in its description only: schemathesis fills an encoded list with one value."""
    for name, prop in (form.get("properties") or {}).items():
        if _is_binary(prop):
            prop["minLength"] = 1
            media.setdefault("encoding", {})[name] = {"contentType": IMAGE_MEDIA_TYPES}
        elif prop.get("type") == "array" and _is_binary(prop.get("items")):
            prop["items"]["minLength"] = 1
            prop["items"].setdefault("description", f"an image file ({IMAGE_MEDIA_TYPES})")


def _patch_object(schema: dict, max_k: int, dim: int | None, fields: dict | None) -> None:
    props = schema.get("properties") or {}
    if "filter" in props and fields is not None:
        keep = {key: props["filter"][key] for key in ("description", "title") if key in props["filter"]}
        as_text = props["filter"].get("type") == "string" or any(
            alt.get("type") == "string" for alt in props["filter"].get("anyOf", [])
        )
        if as_text:  # a multipart field: the filter object as a JSON part (the media type's encoding)
            props["filter"] = (
                {"$ref": FILTER_REF, **keep} if fields else {"type": "string", "maxLength": 0, **keep}
            )
        else:
            props["filter"] = {
                "anyOf": [{"$ref": FILTER_REF}, {"type": "null"}] if fields else [{"type": "null"}],
                **keep,
            }
    for name in ("k", "offset"):
        if name in props and "maximum" not in props[name]:
            props[name]["maximum"] = max_k
    if "vector" in props:
        keep = {key: props["vector"][key] for key in ("description", "title") if key in props["vector"]}
        props["vector"] = {**_vector_schema(dim), **keep}
    if "vectors" in props and isinstance(props["vectors"].get("items"), dict):
        props["vectors"]["items"] = _vector_schema(dim)


def _no_nulls(form: dict) -> None:
    """A form field has no null: an optional one is left out. `anyOf [X, null]` becomes X."""
    for name, prop in (form.get("properties") or {}).items():
        alternatives = prop.get("anyOf")
        if isinstance(alternatives, list) and any(a.get("type") == "null" for a in alternatives):
            rest = [a for a in alternatives if a.get("type") != "null"]
            others = {key: value for key, value in prop.items() if key not in ("anyOf", "default")}
            form["properties"][name] = {**(rest[0] if len(rest) == 1 else {"anyOf": rest}), **others}


def served_schema(base: dict, max_k: int, dim: int | None, fields: dict | None = None) -> dict:
    """`base` (FastAPI's schema) with the run-time limits stated on every search request body (`fields`:
    the served version's metadata fields and types; None: unknown, no index loaded)."""
    schema = copy.deepcopy(base)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    if fields:
        components["Filter"] = filter_json_schema(fields, FILTER_REF)
    for path, item in schema.get("paths", {}).items():
        if not path.startswith("/v1/search"):
            continue
        for operation in item.values():
            for media_type, media in ((operation.get("requestBody") or {}).get("content") or {}).items():
                body = media.get("schema") or {}
                ref = body.get("$ref", "")
                target = components.get(ref.rsplit("/", 1)[-1]) if ref else body
                if isinstance(target, dict):
                    _patch_object(target, max_k, dim, fields)
                    if media_type == "multipart/form-data":
                        _no_nulls(target)
                        _image_parts(target, media)
                        if fields and "filter" in (target.get("properties") or {}):
                            media.setdefault("encoding", {})["filter"] = {"contentType": "application/json"}
    return schema


def install_served_openapi(app: FastAPI, max_k: int) -> None:
    """Serve `served_schema` for the dimension of the version being served (recomputed when it changes)."""
    static = app.openapi
    cache: dict[tuple, dict] = {}
    lock = threading.Lock()

    def openapi() -> dict:
        searcher = app.state.searcher
        dim, fields = None, None
        if searcher is not None and searcher.ready:
            try:
                snapshot = searcher.snapshot()
                dim, fields = snapshot.dim, dict(snapshot.metadata_fields)
            except Exception:  # noqa: BLE001 - swapped out between the two reads: state no limits
                dim, fields = None, None
        key = (dim, None if fields is None else tuple(sorted(fields.items())))
        with lock:
            if key not in cache:
                cache[key] = served_schema(static(), max_k, dim, fields)
            return cache[key]

    app.openapi = openapi
