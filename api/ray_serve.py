"""`softsearch serve --engine ray`: a sharded version served on Ray Serve, with the same routes and numbers.

One Ray Serve deployment per shard position (`shard-000`, ...; `--shard-replicas` replicas each) holds that
shard of the served version (its FAISS index, mapped embeddings and list statistics) and answers its top-k
and log Z_s (search/serving/sharded.py `shard_answer`). The ingress deployment runs the same FastAPI app as
`serve` (`serve.ingress`, api/app.py create_app): it encodes image queries, resolves ids, metadata and
filters, fans every search out to all shard deployments and merges exactly (log Z = logsumexp of log Z_s).

Consistency: every shard call names the version; a shard answers for that version only (loading it on first
use), so one answer never mixes versions. A swap (`POST /v1/admin/reload`, the store follower) first makes
every shard load the new version and only then moves the ingress's snapshot. A shard that does not answer
within `shard_timeout_s` (replica down, being restarted by Ray) fails the query with 503 `shard_unavailable`
naming it: never probabilities renormalised over the shards that answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from ray import serve

from index.manifest import MANIFEST_NAME, read_manifest, verify_files
from index.shards import ShardedVersion
from index.store import EMBEDDINGS_FILE, IDS_FILE, INDEX_FILE, IndexVersion
from search.serving.normaliser import NormaliserConfig
from search.serving.searcher import Searcher
from search.serving.sharded import ShardAnswer, ShardUnavailable, shard_answer

logger = logging.getLogger(__name__)

#: seconds the ingress waits for a shard's answer before the query fails with 503
DEFAULT_SHARD_TIMEOUT_S = 10.0
#: versions a shard replica keeps loaded (the serving one and the one a swap brings in)
KEEP_VERSIONS = 2
APP_NAME = "softsearch"


class ShardServer:
    """One shard position of the served versions (a Ray Serve deployment): shard `position` of any version."""

    def __init__(self, root: str, position: int, normaliser: str = "auto"):
        self.searcher = Searcher(root, normaliser=NormaliserConfig.of(normaliser), optimise_encoder=False)
        self.position = int(position)
        self.loaded: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def _snapshot(self, version: str):
        with self.lock:
            snap = self.loaded.get(version)
            if snap is not None:
                self.loaded.move_to_end(version)
                return snap
            store = self.searcher.store
            entry = store.manifest(version).shards[self.position]
            shard = IndexVersion.load(store.path(version) / entry["name"], verify=False, gpu=False)
            snap = self.searcher._make_snapshot(None, None, shard)
            self.loaded[version] = snap
            while len(self.loaded) > KEEP_VERSIONS:
                self.loaded.popitem(last=False)
            logger.info("shard %d: version %s loaded (%d rows)", self.position, version, snap.count)
            return snap

    def prepare(self, version: str) -> str:
        """Load `version`'s shard (a swap calls this on every shard before it moves)."""
        return self._snapshot(version).version

    def search(
        self, version: str, q: np.ndarray, k: int, taus: np.ndarray, mask: np.ndarray | None
    ) -> ShardAnswer:
        return shard_answer(self._snapshot(version), q, k, taus, mask)

    def check_health(self) -> None:
        """Ray Serve's periodic health check (and a new replica's first one): this shard of the store's
        current version is on disk (its manifest and index file), i.e. a replica can load what it must serve.
        A shard whose files are gone stays down -- Serve keeps replacing the replica -- and every query gets
        503 naming it."""
        store = self.searcher.store
        current = store.current_version()
        if current is None:
            return
        shards = store.manifest(current).shards or []
        if self.position >= len(shards):
            return  # not a version this app can serve: the ingress refuses it, the replica is not at fault
        where = store.path(current) / shards[self.position]["name"]
        for name in (MANIFEST_NAME, INDEX_FILE):
            if not (where / name).is_file():
                raise RuntimeError(
                    f"{where / name} is missing: shard {self.position} of {current} cannot be loaded"
                )


class RemoteShard:
    """A shard searched through its Ray Serve deployment (called from the ingress's fan-out threads)."""

    def __init__(self, name: str, handle, version: str, timeout_s: float):
        self.name, self.handle, self.version, self.timeout_s = name, handle, version, timeout_s

    def __call__(self, q, k, taus, mask) -> ShardAnswer:
        try:
            return self.handle.search.remote(self.version, q, k, taus, mask).result(timeout_s=self.timeout_s)
        except Exception as err:  # noqa: BLE001 - down, restarting, timed out: this query cannot be exact
            raise ShardUnavailable(self.name, _reason(err)) from err


def _reason(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _light_version(path) -> ShardedVersion:
    """The ingress's view of a sharded version: every file checked against the manifest, the ids and mapped
    embeddings of each shard (item routes), no FAISS index (the shard deployments search)."""
    manifest = read_manifest(path)
    if not manifest.shards:
        raise ValueError(
            f"version {manifest.version} is not sharded: `serve --engine ray` serves sharded versions "
            "(`softsearch index reshard --shards N`); serve it with `softsearch serve`"
        )
    verify_files(path, manifest)
    shards = []
    for entry in manifest.shards:
        d = path / entry["name"]
        emb = np.load(d / EMBEDDINGS_FILE, mmap_mode="r", allow_pickle=False)
        ids = json.loads((d / IDS_FILE).read_text(encoding="utf-8"))
        shards.append(IndexVersion(d, read_manifest(d), None, ids, emb))
    return ShardedVersion(path, manifest, shards)


def _call_off_loop(fn, *args):
    """Run `fn(*args)` in a helper thread when this thread runs an event loop (Ray's blocking `.result()`
    refuses to run on one), else here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn(*args)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


class RaySearcher(Searcher):
    """The ingress's Searcher: a sharded version's searches fanned out to the shard deployments."""

    def __init__(self, root, handles: list, *, timeout_s: float = DEFAULT_SHARD_TIMEOUT_S, **kw):
        super().__init__(root, **kw)
        self.handles = list(handles)
        self.timeout_s = float(timeout_s)

    def prepare(self, version: str | None = None):
        old = self._state
        name = version or self.store.current_version()
        if name is None:
            raise FileNotFoundError(f"no current index version under {self.store.root}; build one first")
        if old is not None and name == old.version:
            return None
        loaded = _light_version(self.store.path(name))
        encoder, sha, fresh = self._encoder_for(loaded, old)
        return self._make_snapshot(encoder, sha, loaded, None if fresh or old is None else old.runner)

    def shard_searchers(self, version):
        names = list(version.names)
        if len(names) != len(self.handles):
            raise ValueError(
                f"version {version.version} has {len(names)} shards; this Ray app serves "
                f"{len(self.handles)} (restart `serve --engine ray` to change the shard count)"
            )

        def warm():  # every shard holds the new version before the ingress moves to it
            responses = [h.prepare.remote(version.version) for h in self.handles]
            for name, response in zip(names, responses):
                try:
                    response.result(timeout_s=max(self.timeout_s, 60.0))
                except Exception as err:  # noqa: BLE001
                    raise ShardUnavailable(name, _reason(err)) from err

        _call_off_loop(warm)
        return [
            RemoteShard(n, h, version.version, self.timeout_s) for n, h in zip(names, self.handles)
        ], names


def shard_unavailable_response(request: Request, err: ShardUnavailable) -> JSONResponse:
    """503 naming the shard: the answer would need every shard's log Z_s."""
    return JSONResponse(
        {"error": "shard_unavailable", "detail": str(err), "shard": err.shard},
        status_code=503,
        headers={"Retry-After": "5"},
    )


@serve.ingress()
class Ingress:
    """The ingress deployment: the softsearch FastAPI app over a RaySearcher (built once the replica
    starts)."""

    def __init__(self, settings: dict, handles: list, timeout_s: float = DEFAULT_SHARD_TIMEOUT_S):
        self.settings, self.handles, self.timeout_s = settings, handles, timeout_s

    async def __serve_build_asgi_app__(self):
        return await asyncio.to_thread(self._build)

    def _build(self):
        from api import swap
        from api.app import create_app
        from api.config import Settings

        settings = Settings(**self.settings)
        release = {"auto": None, "release": True, "keep": False}[settings.mapped_pages]
        searcher = RaySearcher(
            settings.index_root,
            self.handles,
            timeout_s=self.timeout_s,
            device=settings.device,
            normaliser=NormaliserConfig(method=settings.normaliser, release_pages=release),
        )
        swap.load_at_startup(searcher)
        app = create_app(settings, searcher)
        app.state.make_searcher = lambda: searcher
        app.add_exception_handler(ShardUnavailable, shard_unavailable_response)
        return app


def build_app(
    settings: dict,
    shards: int,
    *,
    shard_replicas: int = 1,
    timeout_s: float = DEFAULT_SHARD_TIMEOUT_S,
    ingress_replicas: int = 1,
    health_check_period_s: float = 10.0,
):
    """The Ray Serve application: `shards` shard deployments (health-checked every `health_check_period_s`:
    `ShardServer.check_health`) and the ingress bound to their handles."""
    from index.shards import shard_name

    root, normaliser = str(settings["index_root"]), settings.get("normaliser", "auto")
    shard_nodes = [
        serve.deployment(
            ShardServer,
            name=shard_name(i),
            num_replicas=shard_replicas,
            health_check_period_s=health_check_period_s,
            ray_actor_options={"num_cpus": 0},
        ).bind(root, i, normaliser)
        for i in range(shards)
    ]
    ingress = serve.deployment(
        Ingress, name="ingress", num_replicas=ingress_replicas, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(settings, shard_nodes, timeout_s)


def serve_on_ray(
    settings,
    *,
    address: str | None = None,
    shard_replicas: int = 1,
    timeout_s: float = DEFAULT_SHARD_TIMEOUT_S,
    block: bool = True,
) -> int:
    """`softsearch serve --engine ray`: start (or join, `address`) Ray, deploy the app for the store's current
    sharded version on settings.host:port and serve until interrupted. Exit 2 with one `error:` line when the
    store has no current sharded version or the settings do not fit."""
    import sys
    import time

    import ray

    from index.store import IndexStore

    if settings.index_root is None:
        print(
            "error: --engine ray needs --index ROOT (a store whose current version is sharded)",
            file=sys.stderr,
        )
        return 2
    if shard_replicas < 1 or not timeout_s > 0:
        print("error: --shard-replicas must be >= 1 and --shard-timeout-s > 0", file=sys.stderr)
        return 2
    store = IndexStore(settings.index_root)
    current = store.current_version()
    manifest = store.manifest(current) if current else None
    if manifest is None or not manifest.shards:
        what = f"version {current} is not sharded" if current else "there is no current version"
        print(
            f"error: --engine ray serves a sharded version and {what} under {settings.index_root}; "
            f"make one with `softsearch index reshard --root {settings.index_root} --shards N`",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    fields = settings.model_dump()
    fields["index_root"] = str(store.root.resolve())
    serve.run(
        build_app(fields, len(manifest.shards), shard_replicas=shard_replicas, timeout_s=timeout_s),
        name=APP_NAME,
        route_prefix="/",
    )
    print(
        f"serving {current} ({len(manifest.shards)} shards x {shard_replicas} replica(s)) on Ray Serve at "
        f"http://{settings.host}:{settings.port}/ (Ctrl-C to stop)",
        flush=True,
    )
    if not block:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
    return 0
