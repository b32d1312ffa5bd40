"""Shared API-layer pieces: the error type, `Annotated` dependency aliases, input decoding.

Route handlers stay a few lines long by taking `SettingsDep`, `SearcherDep`, `BatcherDep`,
`MetricsDep` and the `require_*` guards from here. HTTP errors live only in the api package.
"""
from __future__ import annotations

import hmac
import io
import logging
import warnings
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request
from PIL import Image

from api.batching import MicroBatcher
from api.config import Settings
from api.metrics import Metrics
from search.searcher import NotReadyError, Searcher, SearchSnapshot
from training.transforms import to_uint8_rgb

logger = logging.getLogger(__name__)


class ApiError(HTTPException):
    """An HTTP error with a short machine-readable code; rendered as {"error": code, "detail": message}."""

    def __init__(self, status_code: int, code: str, detail: str, headers: dict[str, str] | None = None):
        super().__init__(status_code=status_code, detail=detail, headers=headers)
        self.code = code


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_searcher(request: Request) -> Searcher:
    """The app's Searcher; 503 until an index and encoder are loaded."""
    searcher: Searcher | None = request.app.state.searcher
    if searcher is None or not searcher.ready:
        raise ApiError(503, "not_ready", "no index is loaded yet; see GET /readyz")
    return searcher


def get_snapshot(searcher: Annotated[Searcher, Depends(get_searcher)]) -> SearchSnapshot:
    """One (encoder, index version) snapshot for the whole request."""
    try:
        return searcher.snapshot()
    except NotReadyError as err:
        raise ApiError(503, "not_ready", str(err)) from err


def get_batcher(request: Request, searcher: Annotated[Searcher, Depends(get_searcher)]) -> MicroBatcher:
    return request.app.state.batcher


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
SearcherDep = Annotated[Searcher, Depends(get_searcher)]
SnapshotDep = Annotated[SearchSnapshot, Depends(get_snapshot)]
BatcherDep = Annotated[MicroBatcher, Depends(get_batcher)]


def require_content_type(*allowed: str):
    """Dependency factory: 415 unless the request's media type is one of `allowed`."""

    def check(request: Request) -> None:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media not in allowed:
            raise ApiError(415, "unsupported_media_type",
                           f"content-type must be {' or '.join(allowed)}, got {media or 'none'!r}")

    return check


def require_admin(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """Bearer-token guard for /v1/admin/*: 404 when no token is configured (routes disabled),
    401 without credentials, 403 with wrong ones. Compared in constant time."""
    if settings.admin_token is None:
        raise ApiError(404, "not_found", "admin routes are disabled (no admin token configured)")
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "unauthorized", "admin route needs 'Authorization: Bearer <token>'",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode(), settings.admin_token.encode()):
        raise ApiError(403, "forbidden", "wrong admin token")


AdminDep = Depends(require_admin)


def check_k(k: int, settings: Settings) -> int:
    if k < 1 or k > settings.max_k:
        raise ApiError(422, "k_out_of_range", f"k must be between 1 and {settings.max_k} (max_k), got {k}")
    return k


def decode_image(data: bytes, settings: Settings) -> Image.Image:
    """Upload bytes -> RGB PIL image, or a 4xx naming the problem.

    Checks size in bytes (413), that it is an image at all (400), width x height against
    max_image_pixels before decoding any pixels (413, decompression-bomb guard), and that the
    pixel data is complete (400 for truncated files).
    """
    if len(data) == 0:
        raise ApiError(400, "empty_file", "the uploaded file is empty")
    if len(data) > settings.max_upload_bytes:
        raise ApiError(413, "upload_too_large",
                       f"upload is {len(data)} bytes, limit is {settings.max_upload_bytes} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))  # reads the header only
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise ApiError(413, "image_too_large", f"image too large to decode: {err}") from err
        except Exception as err:  # noqa: BLE001 - PIL raises many types for junk input
            raise ApiError(400, "not_an_image", f"the upload is not a readable image ({type(err).__name__})") from err
        width, height = img.size
        if width * height > settings.max_image_pixels:
            raise ApiError(413, "image_too_large",
                           f"image is {width}x{height} = {width * height} pixels, "
                           f"limit is {settings.max_image_pixels} (decompression-bomb guard)")
        if width < 1 or height < 1:
            raise ApiError(400, "not_an_image", f"image has no pixels ({width}x{height})")
        try:
            img.load()
            rgb = Image.fromarray(to_uint8_rgb(img))  # the conversion preprocess() would apply
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise ApiError(413, "image_too_large", f"image too large to decode: {err}") from err
        except Exception as err:  # noqa: BLE001 - truncated/corrupt data
            raise ApiError(400, "corrupt_image", f"image data is truncated or corrupt: {err}") from err
    return rgb
