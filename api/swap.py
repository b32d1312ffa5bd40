"""What this process serves: reloads (admin route and store follower) and the follower itself.

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

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from search.searcher import ReloadResult, Searcher

logger = logging.getLogger(__name__)

#: What a load may raise for a bad or missing version (the old one keeps serving).
LOAD_ERRORS = (FileNotFoundError, ValueError, KeyError, OSError)


async def reload(app: FastAPI, version: str | None = None) -> tuple[Searcher, ReloadResult]:
    """Load `version` (default: the store's current one) into the app's Searcher, creating it if
    needed; counts the attempt in softsearch_index_reloads_total. Raises LOAD_ERRORS on refusal."""
    metrics = app.state.metrics
    try:
        searcher = app.state.searcher or await run_in_threadpool(app.state.make_searcher)
        app.state.searcher = searcher
        result = await run_in_threadpool(searcher.reload, version)
    except LOAD_ERRORS:
        metrics.reloads.labels(result="refused").inc()
        raise
    metrics.reloads.labels(result="changed" if result.changed else "unchanged").inc()
    metrics.observe_searcher(searcher)
    return searcher, result


async def follow_store(app: FastAPI, interval: float) -> None:
    """Poll the store's `current` every `interval` seconds and serve it (runs until cancelled)."""
    from index.store import IndexStore

    store = IndexStore(app.state.settings.index_root)
    refused: str | None = None  # a version that failed to load: not retried until `current` moves
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
            await reload(app, current)
            refused = None
            logger.info("following the store: now serving index version %s", current)
        except LOAD_ERRORS as err:
            refused = current
            logger.warning("store's current version %s refused (%s); still serving %s", current, err,
                           searcher.version if searcher is not None else None)
