"""Shared API-layer pieces: the error type, `Annotated` dependency aliases, input decoding.

Route handlers stay a few lines long by taking `SettingsDep`,
`MetricsDep` and the `require_*` guards from here. HTTP errors live only in the api package.
The dependencies are `async def` although none of them awaits: FastAPI runs a plain `def`
dependency in its thread pool, one thread hop each (five per search request).
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from fastapi import Depends, Header, HTTPException, Request

from api.batching import MicroBatcher
from api.config import Settings
from api.metrics import Metrics
from search.serving.searcher import NotReadyError, Searcher, SearchSnapshot
from training.images import ImageError, ImageLimits, load_query, load_rgb, load_square

logger = logging.getLogger(__name__)


class ApiError(HTTPException):
    """An HTTP error with a short machine-readable code; rendered as {"error": code, "detail": message}."""

    def __init__(self, status_code: int, code: str, detail: str, headers: dict[str, str] | None = None):
        super().__init__(status_code=status_code, detail=detail, headers=headers)
        self.code = code


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def get_searcher(request: Request) -> Searcher:
    """The app's Searcher; 503 until an index and encoder are loaded."""
    searcher: Searcher | None = request.app.state.searcher
    if searcher is None or not searcher.ready:
        raise ApiError(503, "not_ready", "no index is loaded yet; see GET /readyz")
    return searcher


async def get_snapshot(searcher: Annotated[Searcher, Depends(get_searcher)]) -> SearchSnapshot:
    """One (encoder, index version) snapshot for the whole request."""
    try:
        return searcher.snapshot()
    except NotReadyError as err:
        raise ApiError(503, "not_ready", str(err)) from err


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
SnapshotDep = Annotated[SearchSnapshot, Depends(get_snapshot)]


@dataclass(frozen=True)
class SearchContext:
    """What a search route needs, resolved by ONE dependency (each dependency FastAPI solves costs
    Python time on the per-request path)."""

    settings: Settings
    batcher: MicroBatcher
    snapshot: SearchSnapshot
    metrics: Metrics
    media: str = ""  # the request's content type (routes that take two)


def search_context(*content_types: str):
    """Dependency factory for the search routes: 415 unless the media type is one of `content_types`,
    503 until an index is loaded, else the request's SearchContext (one snapshot for the whole query)."""

    async def resolve(request: Request) -> SearchContext:
        media = _check_media(request, content_types)
        state = request.app.state
        searcher: Searcher | None = state.searcher
        if searcher is None or not searcher.ready:
            raise ApiError(503, "not_ready", "no index is loaded yet; see GET /readyz")
        try:
            snapshot = searcher.snapshot()
        except NotReadyError as err:
            raise ApiError(503, "not_ready", str(err)) from err
        return SearchContext(state.settings, state.batcher, snapshot, state.metrics, media)

    return resolve


def _check_media(request: Request, allowed: tuple[str, ...]) -> str:
    """The request's media type, or 415 unless it is one of `allowed`."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in allowed:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"content-type must be {' or '.join(allowed)}, got {media or 'none'!r}",
        )
    return media


async def require_admin(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """Bearer-token guard for /v1/admin/*: 404 when no token is configured (routes disabled),
    401 without credentials, 403 with wrong ones. Compared in constant time."""
    if settings.admin_token is None:
        raise ApiError(404, "not_found", "admin routes are disabled (no admin token configured)")
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            401,
            "unauthorized",
            "admin route needs 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(token.strip().encode(), settings.admin_token.encode()):
        raise ApiError(403, "forbidden", "wrong admin token")


AdminDep = Depends(require_admin)


def check_k(k: int, settings: Settings) -> int:
    if k < 1 or k > settings.max_k:
        raise ApiError(422, "k_out_of_range", f"k must be between 1 and {settings.max_k} (max_k), got {k}")
    return k


# ImageError.code -> (HTTP status, API error code)
_UPLOAD_ERRORS = {
    "empty_file": (400, "empty_file"),
    "file_too_large": (413, "upload_too_large"),
    "image_too_large": (413, "image_too_large"),
    "not_an_image": (400, "not_an_image"),
    "corrupt_image": (400, "corrupt_image"),
    "unreadable": (400, "not_an_image"),
}


def decode_image(
    data: bytes, settings: Settings, side: int | None = None, square: bool = False
) -> np.ndarray:
    """Upload bytes -> (H, W, 3) uint8 RGB pixels through training.images (the decode policy every path uses),
    or a 4xx naming the problem: size in bytes (413), not an image (400), width x height over
    max_image_pixels from the header before any pixel is decoded (413), truncated data (400).

    `side` is the image cache's resolution for the serving encoder. With `square` (an index of
    image files) every upload becomes the (side, side) square the cache holds for a file, so an
    uploaded copy of an indexed file gets exactly its pixels; otherwise an upload larger than
    `side` is shrunk to it (JPEG draft, reduce, resize) and a smaller one is kept as it is, as
    the in-memory datasets' arrays are.
    """
    limits = ImageLimits(max_pixels=settings.max_image_pixels, max_bytes=settings.max_upload_bytes)
    try:
        if side is None:
            pixels = load_rgb(data, limits)
        else:
            pixels = load_square(data, side, limits) if square else load_query(data, side, limits)
    except ImageError as err:
        status, code = _UPLOAD_ERRORS.get(err.code, (400, "not_an_image"))
        raise ApiError(status, code, str(err)) from err
    return pixels
