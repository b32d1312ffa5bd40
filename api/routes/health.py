"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from api.deps import MetricsDep
from api.metrics import CONTENT_TYPE
from api.routes.models import ErrorResponse, HealthOut

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut)
def healthz(request: Request) -> HealthOut:
    """The process is up (always 200); `version` names the loaded index version, null before one is loaded."""
    searcher = request.app.state.searcher
    return HealthOut(status="ok", version=searcher.version if searcher is not None else None)


@router.get("/readyz", response_model=HealthOut, responses={503: {"model": ErrorResponse}})
def readyz(request: Request):
    """200 once an index version and its encoder are loaded, else 503."""
    searcher = request.app.state.searcher
    if searcher is None or not searcher.ready:
        reason = getattr(request.app.state, "load_error", None)
        return JSONResponse(
            {"error": "not_ready", "detail": "no index loaded yet" + (f" ({reason})" if reason else "")},
            status_code=503,
        )
    return HealthOut(status="ready", version=searcher.version)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format 0.0.4"}},
)
def metrics(metrics: MetricsDep) -> PlainTextResponse:
    """Request counts and latency histograms per route, batch sizes, index version and size (all workers)."""
    return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)
