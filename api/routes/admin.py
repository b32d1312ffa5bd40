"""Admin routes (bearer token; disabled when no token is configured)."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Body, Request

from api import swap
from api.deps import AdminDep, ApiError
from api.routes.models import ERROR_RESPONSES, ReloadOut, ReloadRequest

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[AdminDep])


@router.post("/reload", response_model=ReloadOut, responses={
    401: {"description": "no bearer token"}, 403: {"description": "wrong token"},
    409: {"description": "new version refused; the old one keeps serving"}, **ERROR_RESPONSES})
async def reload_index(request: Request, body: ReloadRequest | None = Body(None)) -> ReloadOut:
    """Hot-swap to the store's current index version (or `version`); in-flight queries finish on the old one.

    With several workers this reaches the one that answers; the others follow the store's
    `current` pointer within `watch_interval_s`."""
    try:
        searcher, result = await swap.reload(request.app, body.version if body else None)
    except swap.LOAD_ERRORS as err:
        current = request.app.state.searcher.version if request.app.state.searcher else None
        logger.warning("reload refused: %s", err)
        raise ApiError(409, "reload_refused", f"reload refused: {err}; still serving version {current}") from err
    return ReloadOut(previous=result.previous, version=result.version, changed=result.changed,
                     encoder_reloaded=result.encoder_reloaded, count=searcher.snapshot().count)
