"""The web page and the evaluation report link."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from api.deps import ApiError, SettingsDep

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(include_in_schema=False)


@router.get("/")
def index_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


@router.get("/report")
def report(settings: SettingsDep) -> FileResponse:
    path = settings.report_path
    if path is None or not path.is_file():
        raise ApiError(404, "no_report", "no evaluation report is configured on this server")
    return FileResponse(path)
