"""GET /v1/index (the active manifest) and GET /v1/config (what the web page needs)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.deps import SettingsDep, SnapshotDep
from api.routes.models import ERROR_RESPONSES, IndexOut, ServiceConfigOut

router = APIRouter(prefix="/v1", tags=["index"])


@router.get("/index", response_model=IndexOut, responses=ERROR_RESPONSES)
def index_manifest(snapshot: SnapshotDep) -> IndexOut:
    """The manifest of the index version now answering queries."""
    return IndexOut(
        version=snapshot.version,
        count=snapshot.count,
        dim=snapshot.dim,
        temperature=snapshot.temperature,
        fields=snapshot.metadata_fields,
        categories=snapshot.metadata_categories(),
        normaliser=getattr(snapshot, "normaliser_info", None),
        manifest=snapshot.manifest.to_json(),
    )


@router.get("/config", response_model=ServiceConfigOut)
def service_config(settings: SettingsDep, request: Request) -> ServiceConfigOut:
    """Service limits and links (max_k, upload limit, report URL) for clients and the web page."""
    searcher = request.app.state.searcher
    report = settings.report_path
    return ServiceConfigOut(
        max_k=settings.max_k,
        max_upload_bytes=settings.max_upload_bytes,
        batching=settings.batching_enabled,
        report_url="/report" if report is not None and report.is_file() else None,
        version=searcher.version if searcher is not None else None,
        rate_limit={
            "rps": settings.rate_limit_rps,
            "burst": settings.rate_limit_burst,
            "key": "forwarded client from " + settings.forwarded_allow_ips
            if settings.forwarded_allow_ips
            else "TCP peer address",
        }
        if settings.rate_limit_enabled
        else None,
    )
