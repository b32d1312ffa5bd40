"""What this process serves: reloads (admin route and store follower), start-up, and the follower.

Every path goes through the store's activation rule (index.store: `IndexStore.activate` for a
named version that is not current -- which moves `current`, so the server and the store never
disagree -- and `IndexStore.serving_check` for the store's current version). A refused version is
never loaded; the old one keeps serving. A server never evaluates: a version it is asked to activate that
has no quality-gate result is refused (`UngatedVersion`, 409 on the admin reload); `softsearch index
activate` gates it.

Every serving process follows the store's `current` pointer: a task polls it every
`watch_interval_s` and swaps the new version in when it moves. With `serve --workers N` an
admin reload reaches one worker; the others follow the pointer within one interval, so an
activation (`index activate`, `index build`, a rollback, a reload that moves `current`) reaches
every worker. A version that fails to load is refused once (logged, counted) and retried only
when the pointer moves again; the old version keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from index.gate import ActivationRefused, ScoreCheck
from index.store import IndexStore
from search.serving.searcher import ReloadResult, Searcher

logger = logging.getLogger(__name__)

#: What a load may raise for a bad or missing version (the old one keeps serving).
LOAD_ERRORS = (FileNotFoundError, ValueError, KeyError, OSError)
#: Everything that refuses a reload: load errors and the activation rule.
REFUSALS = (*LOAD_ERRORS, ActivationRefused)
_SWAP_LOCK = threading.Lock()  # fallback for apps built without create_app's own lock


class UngatedVersion(ActivationRefused):
    """A version to activate has no quality-gate result. Gating it means running the evaluator (encoding
    held-out queries with both versions' encoders), which a serving process never does; the CLI does it."""

    def __init__(self, version: str):
        super().__init__(
            version,
            [
                ScoreCheck(
                    None, f"index version {version} has no quality-gate result and a server does not evaluate"
                )
            ],
            hint=f"gate it with `softsearch index activate {version}` (which runs the quality gate), "
            "then reload",
        )


def require_gate(store: IndexStore, version: str) -> None:
    """UngatedVersion unless `version`'s manifest records a quality-gate result."""
    if store.manifest(version).quality_gate is None:
        raise UngatedVersion(version)


def serve_version(
    searcher: Searcher,
    version: str | None = None,
    *,
    force: bool = False,
    path: str = "POST /v1/admin/reload",
) -> ReloadResult:
    """Serve `version` (default: the store's current one) through the activation rule (blocking).

    A version other than the store's current one is checked, loaded, made current in the store
    (`IndexStore.activate`, recorded with `path`) and only then swapped in. ActivationRefused (UngatedVersion
    for a version with no gate result, with or without `force`) or a load error leaves both the store and the
    served version as they were."""
    store = searcher.store
    current = store.current_version()
    if version is None or version == current:
        if current is None:
            raise FileNotFoundError(
                f"no current index version under {store.root}; build and activate one first"
            )
        if force:
            require_gate(store, current)
            state = searcher.prepare(current)
            store.activate(current, force=True, path=path, verify=False)
            return searcher.install(state)
        store.serving_check(current)
        return searcher.install(searcher.prepare(current))
    require_gate(store, version)  # refuse before loading anything
    store.check_activation(version, force=force)
    state = searcher.prepare(version)  # verified and loaded, not served yet
    store.activate(version, force=force, path=path, verify=False)
    return searcher.install(state)


def load_at_startup(searcher: Searcher) -> ReloadResult | None:
    """Serve the store's current version at start-up if the activation rule accepts it."""
    current = searcher.store.current_version()
    if current is None:
        raise FileNotFoundError(f"no current index version under {searcher.store.root}; build one first")
    return serve_version(searcher, current, path="start-up")


async def reload(
    app: FastAPI, version: str | None = None, *, force: bool = False, path: str = "POST /v1/admin/reload"
) -> tuple[Searcher, ReloadResult]:
    """Serve `version` (default: the store's current one) in the app's Searcher, creating it if
    needed; counts the attempt in softsearch_index_reloads_total. Raises REFUSALS on refusal."""
    metrics = app.state.metrics
    lock = getattr(app.state, "swap_lock", _SWAP_LOCK)

    def run() -> tuple[Searcher, ReloadResult]:
        with lock:  # one swap at a time per process: admin reloads and the follower never interleave
            searcher = app.state.searcher or app.state.make_searcher()
            app.state.searcher = searcher
            return searcher, serve_version(searcher, version, force=force, path=path)

    try:
        searcher, result = await run_in_threadpool(run)
    except REFUSALS:
        metrics.reloads.labels(result="refused").inc()
        raise
    app.state.load_error = None
    metrics.reloads.labels(result="changed" if result.changed else "unchanged").inc()
    metrics.observe_searcher(searcher)
    return searcher, result


async def follow_store(app: FastAPI, interval: float) -> None:
    """Poll the store's `current` every `interval` seconds and serve it (runs until cancelled)."""
    store = IndexStore(app.state.settings.index_root)
    refused: str | None = None  # a version that was refused: not retried until `current` moves
    while True:
        await asyncio.sleep(interval)
        app.state.metrics.update_process()
        try:
            current = store.current_version()
        except OSError as err:
            logger.warning("cannot read the index pointer under %s: %s", store.root, err)
            continue
        searcher = app.state.searcher
        if current is None or current == refused or (searcher is not None and searcher.version == current):
            if current != refused:
                refused = None
            continue
        try:
            await reload(app, current, path="follow")
            refused = None
            logger.info("following the store: now serving index version %s", current)
        except REFUSALS as err:
            refused = current
            logger.warning(
                "store's current version %s refused (%s); still serving %s",
                current,
                err,
                searcher.version if searcher is not None else None,
            )
