"""POST /v1/admin/reload from a store command (`index build | add | sync | activate ... --notify URL`):
the HTTP client with retries that tells a running server about a new version."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

from index.cli import DEFAULT_NOTIFY_TIMEOUT_S

logger = logging.getLogger(__name__)

#: Answers worth retrying: the server is busy, restarting or behind a proxy that is.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def _retry_after(headers) -> float | None:
    value = (headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _served_version(url: str, timeout: float) -> str | None:
    """The version GET {url}/healthz reports (never rate limited), or None."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=timeout) as response:
            return json.loads(response.read() or b"{}").get("version")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def notify_server(
    url: str,
    token: str | None,
    version: str,
    *,
    wait_s: float = DEFAULT_NOTIFY_TIMEOUT_S,
    timeout: float = 10.0,
    sleep=time.sleep,
    clock=time.monotonic,
) -> tuple[bool, str]:
    """POST {url}/v1/admin/reload {"version": version} until the server reports serving it -> (ok, message).

    429 / 5xx / connection errors are retried after Retry-After (else 0.25 s doubling, at most 5 s)
    for up to `wait_s` seconds; other answers (401, 403, 404, 409, ...) end at once. When the
    reload never succeeded, /healthz decides (a server that follows the store may serve it anyway).
    Never raises."""
    endpoint = url.rstrip("/") + "/v1/admin/reload"
    deadline = clock() + max(0.0, wait_s)
    attempt = 0
    while True:
        attempt += 1
        request = urllib.request.Request(
            endpoint,
            data=json.dumps({"version": version}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        wait = None
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                served = json.loads(response.read() or b"{}").get("version")
            if served == version:
                return True, f"{url} now serves {served} (HTTP 200, attempt {attempt})"
            return False, f"{endpoint}: HTTP 200 but the server reports version {served!r}, not {version}"
        except urllib.error.HTTPError as err:
            try:
                detail = json.loads(err.read() or b"{}").get("detail") or err.reason
            except (ValueError, OSError, AttributeError):
                detail = err.reason
            reason = f"HTTP {err.code}: {detail}"
            if err.code not in RETRY_STATUSES:
                return False, f"{endpoint}: {reason}"
            wait = _retry_after(err.headers)
        except ValueError as err:  # not a URL at all: retrying cannot help
            return False, f"{endpoint}: {err}"
        except (urllib.error.URLError, OSError) as err:
            reason = str(getattr(err, "reason", err))
        delay = wait if wait is not None else min(0.25 * 2 ** (attempt - 1), 5.0)
        left = deadline - clock()
        if left <= 0.0:
            break
        logger.info("notify %s: %s; retrying in %.2f s", endpoint, reason, min(delay, left))
        sleep(min(delay, left))
    served = _served_version(url, timeout)
    if served == version:
        return True, f"{url} serves {version} (it followed the store; the reload answered {reason})"
    return False, (
        f"{endpoint}: no success after {attempt} attempts in {wait_s:g} s ({reason}); "
        f"the server reports version {served!r}"
    )
