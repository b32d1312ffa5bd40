"""A Python client for the softsearch HTTP API (httpx), with the server's own response models as types.

    from api.client import SoftsearchClient
    with SoftsearchClient("http://127.0.0.1:8000") as ss:
        answer = ss.search_image("query.png", k=5, filter={"class": "apps"}, min_probability=0.01)
        for hit in answer.results:
            print(hit.id, hit.probability)

Every non-2xx answer raises SoftsearchError with the server's status, error code and detail.
Pass `http=` an existing httpx.Client (e.g. FastAPI's TestClient) to reuse its connection pool.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Sequence

import httpx

from api.routes.models import (
    BatchResponse,
    HealthOut,
    IndexOut,
    ItemOut,
    ItemSample,
    ReloadOut,
    SearchResponse,
    ServiceConfigOut,
)

ImageInput = str | os.PathLike | bytes | Any  # a path, the file's bytes, or a PIL image


class SoftsearchError(RuntimeError):
    """The server refused a request: `status` (HTTP), `code` (e.g. bad_filter) and `detail`."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


class SoftsearchClient:
    """One method per route; search methods take the same options as the routes."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
    ):
        self._own = http is None
        self.http = http if http is not None else httpx.Client(base_url=base_url, timeout=timeout)
        self.token = token

    def __enter__(self) -> "SoftsearchClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.http.close()

    # ---------------------------------------------------------------- plumbing
    def _call(self, method: str, path: str, **kw) -> httpx.Response:
        response = self.http.request(method, path, **kw)
        if response.status_code >= 400:
            try:
                body = response.json()
                code, detail = str(body.get("error", "error")), str(body.get("detail", response.text))
            except (ValueError, AttributeError):
                code, detail = "error", response.text[:200]
            raise SoftsearchError(response.status_code, code, detail)
        return response

    @staticmethod
    def _options(k: int, temperature, offset, min_probability, mass, filter) -> dict:
        opts = {
            "k": k,
            "temperature": temperature,
            "offset": offset,
            "min_probability": min_probability,
            "mass": mass,
            "filter": filter,
        }
        return {key: v for key, v in opts.items() if v is not None and not (key == "offset" and v == 0)}

    @staticmethod
    def _form(options: dict) -> dict:
        return {k: json.dumps(v) if k == "filter" else str(v) for k, v in options.items()}

    @staticmethod
    def _image_part(image: ImageInput, n: int = 0) -> tuple[str, bytes, str]:
        if isinstance(image, (bytes, bytearray)):
            return f"query{n}", bytes(image), "application/octet-stream"
        if isinstance(image, (str, os.PathLike)):
            path = Path(image)
            return path.name, path.read_bytes(), "application/octet-stream"
        buf = io.BytesIO()  # a PIL image
        image.save(buf, format="PNG")
        return f"query{n}.png", buf.getvalue(), "image/png"

    # ---------------------------------------------------------------- search
    def search_image(
        self,
        image: ImageInput,
        k: int = 10,
        *,
        temperature: float | None = None,
        offset: int = 0,
        min_probability: float | None = None,
        mass: float | None = None,
        filter: dict | None = None,
    ) -> SearchResponse:
        """POST /v1/search: the indexed images most similar to `image`."""
        options = self._options(k, temperature, offset, min_probability, mass, filter)
        r = self._call(
            "POST", "/v1/search", files={"file": self._image_part(image)}, data=self._form(options)
        )
        return SearchResponse.model_validate_json(r.content)

    def search_vector(
        self,
        vector: Sequence[float],
        k: int = 10,
        *,
        temperature: float | None = None,
        offset: int = 0,
        min_probability: float | None = None,
        mass: float | None = None,
        filter: dict | None = None,
    ) -> SearchResponse:
        """POST /v1/search/vector: search with an embedding (normalised by the server)."""
        body = {
            "vector": [float(v) for v in vector],
            **self._options(k, temperature, offset, min_probability, mass, filter),
        }
        return SearchResponse.model_validate_json(self._call("POST", "/v1/search/vector", json=body).content)

    def search_item(
        self,
        item_id: str,
        k: int = 10,
        *,
        include_self: bool = False,
        temperature: float | None = None,
        offset: int = 0,
        min_probability: float | None = None,
        mass: float | None = None,
        filter: dict | None = None,
    ) -> SearchResponse:
        """POST /v1/search/item: items similar to an indexed one (its stored embedding is the query)."""
        body = {
            "id": item_id,
            "include_self": include_self,
            **self._options(k, temperature, offset, min_probability, mass, filter),
        }
        return SearchResponse.model_validate_json(self._call("POST", "/v1/search/item", json=body).content)

    def search_batch(
        self,
        *,
        images: Sequence[ImageInput] | None = None,
        vectors: Sequence[Sequence[float]] | None = None,
        k: int = 10,
        temperature: float | None = None,
        offset: int = 0,
        min_probability: float | None = None,
        mass: float | None = None,
        filter: dict | None = None,
    ) -> list[SearchResponse]:
        """POST /v1/search/batch: several images or several vectors, one answer each, in order."""
        if (images is None) == (vectors is None):
            raise ValueError("give either images or vectors")
        options = self._options(k, temperature, offset, min_probability, mass, filter)
        if vectors is not None:
            r = self._call(
                "POST",
                "/v1/search/batch",
                json={"vectors": [[float(v) for v in vec] for vec in vectors], **options},
            )
        else:
            r = self._call(
                "POST",
                "/v1/search/batch",
                data=self._form(options),
                files=[("files", self._image_part(im, n)) for n, im in enumerate(images)],
            )
        return BatchResponse.model_validate_json(r.content).responses

    def search_text(
        self,
        text: str,
        k: int = 10,
        *,
        temperature: float | None = None,
        offset: int = 0,
        min_probability: float | None = None,
        mass: float | None = None,
        filter: dict | None = None,
    ) -> SearchResponse:
        """POST /v1/search/text: indexed images described by `text` (needs a version with a text tower)."""
        body = {"text": text, **self._options(k, temperature, offset, min_probability, mass, filter)}
        return SearchResponse.model_validate_json(self._call("POST", "/v1/search/text", json=body).content)

    def search_texts(
        self,
        texts: Sequence[str],
        k: int = 10,
        *,
        temperature: float | None = None,
        offset: int = 0,
        min_probability: float | None = None,
        mass: float | None = None,
        filter: dict | None = None,
    ) -> list[SearchResponse]:
        """POST /v1/search/text/batch: several texts, one answer each, in order."""
        body = {"texts": list(texts), **self._options(k, temperature, offset, min_probability, mass, filter)}
        return BatchResponse.model_validate_json(
            self._call("POST", "/v1/search/text/batch", json=body).content
        ).responses

    # ---------------------------------------------------------------- index and items
    def index(self) -> IndexOut:
        """GET /v1/index: the served version, its manifest and its filterable fields."""
        return IndexOut.model_validate_json(self._call("GET", "/v1/index").content)

    def config(self) -> ServiceConfigOut:
        return ServiceConfigOut.model_validate_json(self._call("GET", "/v1/config").content)

    def item(self, item_id: str) -> ItemOut:
        from urllib.parse import quote

        return ItemOut.model_validate_json(self._call("GET", f"/v1/items/{quote(item_id, safe='')}").content)

    def thumbnail(self, item_id: str) -> bytes:
        """The item's stored image as PNG bytes."""
        from urllib.parse import quote

        return self._call("GET", f"/v1/items/{quote(item_id, safe='')}/thumbnail").content

    def sample(self, n: int = 12, seed: int | None = None) -> ItemSample:
        params = {"n": n, **({} if seed is None else {"seed": seed})}
        return ItemSample.model_validate_json(self._call("GET", "/v1/items", params=params).content)

    # ---------------------------------------------------------------- service
    def healthz(self) -> HealthOut:
        return HealthOut.model_validate_json(self._call("GET", "/healthz").content)

    def ready(self) -> bool:
        """True once the server answers /readyz with 200 (an index is loaded)."""
        try:
            return self.http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def metrics(self) -> str:
        return self._call("GET", "/metrics").text

    def reload(self, version: str | None = None, *, force: bool = False) -> ReloadOut:
        """POST /v1/admin/reload (needs the client's admin `token`)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        body = {"force": force, **({} if version is None else {"version": version})}
        return ReloadOut.model_validate_json(
            self._call("POST", "/v1/admin/reload", json=body, headers=headers).content
        )
