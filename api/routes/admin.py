"""Admin routes (bearer token; disabled when no token is configured)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Body, Request

from api import swap
from api.deps import AdminDep, ApiError
from api.routes.models import ERROR_RESPONSES, ReloadOut, ReloadRequest

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[AdminDep])


@router.post(
    "/reload",
    response_model=ReloadOut,
    responses={
        401: {"description": "no bearer token"},
        403: {"description": "wrong token"},
        409: {
            "description": "refused by the activation rule or not loadable; the store's current keeps serving"
        },
        **ERROR_RESPONSES,
    },
)
async def reload_index(request: Request, body: ReloadRequest | None = Body(None)) -> ReloadOut:
    """Serve the store's current index version, or `version` -- which then becomes the store's current
    too -- through the store's activation rule (quality gate, recall against target; `force`
    overrides and is recorded). In-flight queries finish on the old version; never rate limited.

    With several workers this reaches the one that answers; the others follow the store's
    `current` pointer within `watch_interval_s`."""
    version, force = (body.version, body.force) if body else (None, False)
    try:
        searcher, result = await swap.reload(request.app, version, force=force)
    except swap.REFUSALS as err:
        served = request.app.state.searcher.version if request.app.state.searcher else None
        current = _store_current(request)
        logger.warning("reload refused: %s", err)
        raise ApiError(
            409,
            "reload_refused",
            f"reload refused: {err}; still serving version {served} (the store's current is {current})",
        ) from err
    return ReloadOut(
        previous=result.previous,
        version=result.version,
        changed=result.changed,
        encoder_reloaded=result.encoder_reloaded,
        count=searcher.snapshot().count,
        store_current=_store_current(request),
    )


def _store_current(request: Request) -> str | None:
    searcher = request.app.state.searcher
    try:
        return (
            searcher.store.current_version() if searcher is not None and searcher.store is not None else None
        )
    except OSError:
        return None
