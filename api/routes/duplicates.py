"""GET /v1/duplicates (the served version's duplicate groups, from `softsearch dedup`) and /duplicates (their
page)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from api.deps import ApiError, SettingsDep, SnapshotDep
from api.routes.models import ERROR_RESPONSES, DuplicatesOut
from index.store import IndexStore
from search.duplicates.config import FORMAT

router = APIRouter(tags=["duplicates"])


@lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _scan_path(settings, snapshot, suffix: str) -> Path:
    if settings.index_root is None:
        raise ApiError(404, "no_duplicates", "this server has no index store")
    path = IndexStore(settings.index_root).duplicates_path(snapshot.version, suffix)
    if not path.is_file():
        raise ApiError(
            404,
            "no_duplicates",
            f"no duplicate scan of version {snapshot.version}; run "
            f"'softsearch dedup --index {settings.index_root}'",
        )
    return path


@router.get(
    "/v1/duplicates",
    response_model=DuplicatesOut,
    responses={
        **ERROR_RESPONSES,
        404: {"description": "the served version has not been scanned (softsearch dedup)"},
    },
)
def duplicates(
    settings: SettingsDep,
    snapshot: SnapshotDep,
    offset: Annotated[int, Query(ge=0, description="groups to skip (largest groups first)")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000, description="groups to return")] = 100,
) -> DuplicatesOut:
    """Near-duplicate groups of the served version at its probability threshold, with the scan's notes."""
    path = _scan_path(settings, snapshot, ".json")
    data = _load(str(path), path.stat().st_mtime_ns)
    if data.get("format") != FORMAT:
        raise ApiError(
            404,
            "no_duplicates",
            f"the duplicate scan of version {snapshot.version} was written by an "
            f"older softsearch; run 'softsearch dedup --index {settings.index_root}' again",
        )
    return DuplicatesOut(
        version=data["version"],
        created=data["created"],
        count=data["count"],
        threshold=data["threshold"],
        threshold_rule=data["threshold_rule"],
        max_probability=data["max_probability"],
        notes=data["notes"],
        collection_share=data["collection_share"],
        copy_recall=(data["model"] or data.get("copy_model") or {}).get("copy_recall", float("nan")),
        skipped=data["skipped"],
        identical_pairs=data.get("identical_pairs", 0),
        baselines=data.get("baselines", []),
        total_groups=len(data["groups"]),
        offset=offset,
        groups=data["groups"][offset : offset + limit],
    )


@router.get("/duplicates", include_in_schema=False)
def duplicates_page(settings: SettingsDep, snapshot: SnapshotDep) -> FileResponse:
    return FileResponse(_scan_path(settings, snapshot, ".html"), media_type="text/html")
