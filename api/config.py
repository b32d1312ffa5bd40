"""Service settings: one validated object, read from SOFTSEARCH_* env vars and CLI overrides.

Invalid values fail at start-up with a message naming the setting, never at the first request.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger(__name__)

ENV_PREFIX = "SOFTSEARCH_"

#: Default largest k a client may ask for. Larger k costs one exact softmax per hit and a
#: bigger response; 100 covers every evaluation cut-off the project reports (k <= 100).
DEFAULT_MAX_K = 100


#: `--batch-linger-ms auto` with several workers over a vector version (docs/results.md §30).
AUTO_LINGER_MS = 3.0


class Settings(BaseModel):
    """Everything the HTTP service reads at start-up.

    env var = SOFTSEARCH_ + upper-case field name, e.g. SOFTSEARCH_INDEX_ROOT, SOFTSEARCH_MAX_K.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    index_root: Path | None = Field(None, description="IndexStore root (root/versions, root/current)")
    host: str = Field("127.0.0.1", description="bind address; loopback by default")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one")
    admin_token: str | None = Field(
        None,
        description="bearer token for /v1/admin/*, at least 8 characters; "
        "unset disables the admin routes (404)",
    )
    max_k: int = Field(DEFAULT_MAX_K, ge=1, le=10_000, description="largest k a request may ask for")
    max_upload_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="largest accepted image upload / request body (413 above)"
    )
    max_image_pixels: int = Field(
        20_000_000, ge=1, description="decompression-bomb guard: width * height of an upload (413 above)"
    )
    batch_max_size: int = Field(32, ge=1, le=4096, description="micro-batch size; 1 disables batching")
    batch_max_wait_ms: float = Field(
        0.0,
        ge=0.0,
        le=1000.0,
        description="how long the first query of a batch waits for company; 0 = adaptive batching only "
        "(a batch takes whatever queued while the previous one ran; measured fastest on small CPUs)",
    )
    batch_linger_ms: float | Literal["auto"] = Field(
        "auto",
        description="adaptive batching under concurrent load: a batch formed while queries queued waits up "
        "to this long (ms, 0-1000) for more (fuller batches, less CPU per query; a lone client never "
        "waits); auto: 3 with --workers > 1 over a version built from vectors (p99 at 16 clients 29-36 ms "
        "against 67-73 without, in four of six runs: docs/results.md §30), else 0",
    )
    batch_workers: int | Literal["auto"] = Field(
        "auto",
        description="micro-batches in flight at once (threads, 1-64); auto: 1 for a version built from "
        "vectors (one batch thread fills its batches and shares the GIL with the event loop least: the "
        "lower tail latency at 16 clients, docs/results.md §28, §30), 2 for a version with an encoder "
        "(its forwards release the GIL)",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="serving processes sharing the port (they share the memory-mapped "
        "embeddings and merge their metrics)",
    )
    watch_interval_s: float = Field(
        1.0,
        ge=0.0,
        le=3600.0,
        description="how often each process checks the store's current pointer and swaps to a new version; "
        "0 = only on POST /v1/admin/reload",
    )
    rate_limit_rps: float = Field(0.0, ge=0.0, description="per-client token refill rate; 0 = off")
    rate_limit_burst: int = Field(20, ge=1, description="per-client bucket size")
    forwarded_allow_ips: str | None = Field(
        None,
        description="comma-separated IP addresses / networks of trusted reverse proxies whose "
        "X-Forwarded-For / X-Forwarded-Proto are honoured (the rate-limit key becomes the client "
        "they forward for); unset = proxy headers ignored, clients keyed by the TCP peer",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=3600.0,
        description="a request's head (request line + headers) must arrive within this many seconds of the "
        "connection opening or of its first byte; otherwise the connection is closed",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=3600.0,
        description="a request's body must arrive within this many seconds of its head; otherwise 408 and "
        "the connection is closed (60 s lets a 10 MiB upload through at ~1.4 Mbit/s)",
    )
    keep_alive_timeout_s: float = Field(
        5.0,
        gt=0.0,
        le=3600.0,
        description="an idle keep-alive connection is closed this long after its last "
        "response (uvicorn's timeout_keep_alive)",
    )
    report_path: Path | None = Field(None, description="evaluation report (html/json) linked from the page")
    device: str = Field("cpu", description="torch device for the encoder")
    torch_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="torch intra-op threads per serving process (None = cores / (workers x batch_workers), "
        "at least 1, so concurrent batches do not oversubscribe the CPU with spinning OpenMP threads)",
    )
    log_level: str = Field("info", description="uvicorn / logging level")
    normaliser: Literal["exact", "bounded", "auto"] = Field(
        "auto",
        description="softmax normaliser log Z: exact (every embedding per query), bounded (a few IVF "
        "lists + a sampled tail; the response carries a bound that contains the exact value) "
        "or auto (exact while N * dim <= 1.28e8, i.e. N = 1e6 at dim 128; bounded above)",
    )
    balance_connections: Literal["on", "off"] = Field(
        "on",
        description="with workers > 1: a worker holding more than its share of the open connections "
        "answers with Connection: close, so the client reconnects and the shared socket places it "
        "again (on), or connections stay where uvicorn's shared socket put them (off)",
    )
    normaliser_overlap: Literal["on", "off"] = Field(
        "off",
        description="bounded normaliser, a lone query: its head lists' and first sample's dot products on "
        "a helper thread while the index searches (on), or one after the other (off, default: the "
        "overlap was measured to cost CPU and gain no time on 2 cores); the same answer",
    )
    mapped_pages: Literal["auto", "release", "keep"] = Field(
        "auto",
        description="the embeddings memory map's pages once the normaliser has read them: release "
        "(unmapped from the process: its RSS stays ~index + model), keep (no refaults, but "
        "every page read counts in the RSS as shared page cache) or auto (release after the "
        "exact scan, keep the bounded estimate's scattered reads)",
    )

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if v == "localhost":
            return v
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError(f"host must be an IP address or 'localhost', got {v!r}") from None
        return v

    @field_validator("admin_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if len(v) < 8:
            raise ValueError("admin_token must be at least 8 characters (or unset to disable admin routes)")
        return v

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxies(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        entries = [e.strip() for e in v.split(",") if e.strip()]
        for entry in entries:
            if entry == "*":
                continue
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network (e.g. 10.0.0.5 or 10.0.0.0/24)"
                ) from None
        return ",".join(entries)

    @field_validator(
        "batch_max_wait_ms",
        "rate_limit_rps",
        "watch_interval_s",
        "header_timeout_s",
        "body_timeout_s",
        "keep_alive_timeout_s",
    )
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be finite, got {v}")
        return v

    @field_validator("batch_workers", mode="before")
    @classmethod
    def _batch_workers(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        whole = (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, str) and v.strip().isdigit()
        )
        if not whole or not 1 <= int(v) <= 64:
            raise ValueError(f"must be an integer from 1 to 64 or 'auto', got {v!r}")
        return int(v)

    @field_validator("batch_linger_ms", mode="before")
    @classmethod
    def _batch_linger_ms(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        try:
            ms = float(v)
        except (TypeError, ValueError):
            ms = math.nan
        if isinstance(v, bool) or not (math.isfinite(ms) and 0.0 <= ms <= 1000.0):
            raise ValueError(f"must be a number of ms from 0 to 1000 or 'auto', got {v!r}")
        return ms

    def resolved_batch_linger_ms(self, vector_only: bool) -> float:
        """How long a batch formed under load lingers: `batch_linger_ms`, or for auto 3 ms with several
        worker processes over a version built from vectors, else 0 (one worker: it cost 664 -> 581 QPS at
        16 clients for no better tail; with an encoder it was not measured)."""
        if self.batch_linger_ms != "auto":
            return float(self.batch_linger_ms)
        return AUTO_LINGER_MS if vector_only and self.workers > 1 else 0.0

    def resolved_batch_workers(self, vector_only: bool) -> int:
        """The batch threads to run: `batch_workers`, or for auto 1 over a version built from vectors (no
        encoder) and 2 otherwise."""
        if self.batch_workers != "auto":
            return int(self.batch_workers)
        return 1 if vector_only else 2

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in {"critical", "error", "warning", "info", "debug", "trace"}:
            raise ValueError(f"unknown log level {v!r}")
        return v

    @field_validator("index_root", "report_path", "torch_threads", mode="before")
    @classmethod
    def _empty_path(cls, v: Any) -> Any:
        return None if v == "" else v

    @model_validator(mode="after")
    def _paths_exist(self) -> "Settings":
        if self.index_root is not None and self.index_root.exists() and not self.index_root.is_dir():
            raise ValueError(f"index_root {self.index_root} is not a directory")
        return self

    @property
    def rate_limit_enabled(self) -> bool:
        return self.rate_limit_rps > 0

    @property
    def batching_enabled(self) -> bool:
        return self.batch_max_size > 1


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, str] | None = None,
) -> Settings:
    """Build Settings from SOFTSEARCH_* env vars, then `overrides` (CLI values; None = not given).

    Raises ValueError with one line per bad setting, naming where the bad value came from: its
    command-line flag (`flags[name]`, default --name-with-dashes) or its env var.
    """
    environ = os.environ if environ is None else environ
    fields = Settings.model_fields
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name in fields:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            values[name] = environ[key]
            origin[name] = key
    unknown = sorted(
        k for k in environ if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX) :].lower() not in fields
    )
    if unknown:
        logger.warning("ignoring unknown settings in the environment: %s", ", ".join(unknown))
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
            origin[name] = (flags or {}).get(name, "--" + name.replace("_", "-"))
    try:
        return Settings(**values)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"]) or "settings"
            shown = values.get(name, "<default>")
            if name == "admin_token":
                shown = "<hidden>"
            where = origin.get(name, ENV_PREFIX + name.upper())
            lines.append(f"invalid setting {name} ({where}={shown!s}): {err['msg']}")
        raise ValueError("; ".join(lines)) from None
