"""Indexed items: random sample (for the web page), metadata, and the stored image as PNG."""

from __future__ import annotations

import io
import random
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.deps import ApiError, SnapshotDep
from api.routes.models import ERROR_RESPONSES, ErrorResponse, ItemOut, ItemSample, ItemSummary

router = APIRouter(prefix="/v1/items", tags=["items"])

THUMBNAIL_MAX_SIDE = 256
#: longest item id the item routes take (422 beyond): a path of up to 1,024 characters, so the request
#: line stays within the HTTP server's 16 KiB head even when every character is percent-encoded
MAX_ITEM_ID_LENGTH = 1024
ItemId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_ITEM_ID_LENGTH,
        examples=["class0/0001.png"],
        description="an indexed item's id ('/' may stay unescaped)",
    ),
]


# the item routes also answer 404 (no such id in the served version, or its image cannot be rebuilt)
ITEM_RESPONSES = {
    **ERROR_RESPONSES,
    404: {
        "model": ErrorResponse,
        "description": "no such item in the served version, or its image cannot be recovered",
    },
}


def thumbnail_url(item_id: str) -> str:
    return f"/v1/items/{quote(item_id, safe='')}/thumbnail"


@router.get("", response_model=ItemSample, responses=ERROR_RESPONSES)
def sample_items(
    snapshot: SnapshotDep,
    n: Annotated[int, Query(ge=1, le=100, description="how many random items")] = 12,
    seed: Annotated[int | None, Query(ge=0, le=2**63 - 1, description="seed for a repeatable sample")] = None,
) -> ItemSample:
    """A random sample of indexed items (ids + thumbnail URLs)."""
    rows = random.Random(seed).sample(range(snapshot.count), min(n, snapshot.count))
    ids = snapshot.index.ids
    return ItemSample(
        version=snapshot.version,
        count=snapshot.count,
        items=[ItemSummary(id=ids[r], row=r, thumbnail_url=thumbnail_url(ids[r])) for r in rows],
    )


def _png(snapshot, item_id: str) -> bytes:
    try:
        image = snapshot.item_image(item_id)
    except KeyError as err:
        raise ApiError(
            404, "item_not_found", f"no item {item_id!r} in index version {snapshot.version}"
        ) from err
    except (FileNotFoundError, ValueError) as err:
        raise ApiError(404, "image_unavailable", f"image of {item_id!r} cannot be recovered: {err}") from err
    image = image.copy()
    image.thumbnail((THUMBNAIL_MAX_SIDE, THUMBNAIL_MAX_SIDE))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@router.get(
    "/{item_id:path}/thumbnail",
    response_class=Response,
    responses={
        200: {"content": {"image/png": {}}, "description": "the stored image as PNG"},
        **ITEM_RESPONSES,
    },
)
async def item_thumbnail(item_id: ItemId, snapshot: SnapshotDep) -> Response:
    """The item's stored image (PNG, longest side <= 256), rebuilt from the manifest's dataset spec."""
    png = await run_in_threadpool(_png, snapshot, item_id)
    return Response(
        png,
        media_type="image/png",
        headers={"Cache-Control": "max-age=3600", "X-Index-Version": snapshot.version},
    )


@router.get("/{item_id:path}", response_model=ItemOut, responses=ITEM_RESPONSES)
def item_metadata(item_id: ItemId, snapshot: SnapshotDep) -> ItemOut:
    """Metadata of one indexed item."""
    try:
        info = snapshot.item(item_id)
    except KeyError as err:
        raise ApiError(
            404, "item_not_found", f"no item {item_id!r} in index version {snapshot.version}"
        ) from err
    return ItemOut(
        id=info.id,
        row=info.row,
        version=info.version,
        label=info.label,
        class_name=info.class_name,
        dataset=info.dataset,
        thumbnail_url=thumbnail_url(info.id),
        fields=snapshot.item_fields(info.row),
    )
