"""`softsearch serve`: run the HTTP service with uvicorn.

    softsearch serve --index ROOT [--host 127.0.0.1] [--port 8000] [--admin-token T] [--workers N] ...

Every option also reads from SOFTSEARCH_* environment variables (the CLI wins); invalid
settings stop the command before the server starts, with `error: ...` and exit code 2.

`--workers N` runs N uvicorn worker processes on one port. Each builds its own app from the
same settings (handed over as SOFTSEARCH_* variables) and memory-maps the same embedding file, index
codes and list-ordered rows (docs/results.md §30), so the page cache holds one copy for all of them;
they merge their Prometheus samples through PROMETHEUS_MULTIPROC_DIR (a fresh temporary directory
unless the operator sets one) and each follows the store's `current` pointer (api/swap.py).
"""

from __future__ import annotations

import argparse
import gc
import glob
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from training.cli_parser import CommandParser

logger = logging.getLogger(__name__)

#: uvicorn restarts a worker that has not answered its health ping within this many seconds; a
#: worker's start (torch import, index and encoder load) takes far longer than uvicorn's default 5 s.
WORKER_START_TIMEOUT_S = 300


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="softsearch serve", description="Serve the search API and web page.")
    p.add_argument("--index", dest="index_root", help="index store root (SOFTSEARCH_INDEX_ROOT)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    p.add_argument(
        "--admin-token",
        help="enables /v1/admin/* with this bearer token, at least 8 characters "
        "(SOFTSEARCH_ADMIN_TOKEN); admin requests with it are never rate limited",
    )
    p.add_argument("--max-k", type=int, help="largest k per request (default 100)")
    p.add_argument("--max-upload-bytes", type=int, help="largest upload in bytes (default 10 MiB)")
    p.add_argument("--max-image-pixels", type=int, help="largest width*height of an upload (default 20M)")
    p.add_argument("--batch-max-size", type=int, help="micro-batch size; 1 disables batching (default 32)")
    p.add_argument("--batch-max-wait-ms", type=float, help="micro-batch wait in ms (default 0: adaptive)")
    p.add_argument(
        "--batch-linger-ms",
        help="adaptive batching under concurrent load: a batch formed while queries queued waits up to this "
        "many ms for more (a lone client never waits), or auto: 3 with --workers > 1 over a version built "
        "from vectors, else 0 (default auto)",
    )
    p.add_argument(
        "--batch-workers",
        help="micro-batches in flight at once, or auto: 1 for a version built from vectors, 2 with an "
        "encoder (default auto)",
    )
    p.add_argument("--workers", type=int, help="serving processes on the same port (default 1)")
    p.add_argument(
        "--watch-interval-s",
        type=float,
        help="seconds between checks of the store's current pointer; 0 = admin reload only (default 1)",
    )
    p.add_argument("--rate-limit-rps", type=float, help="per-client requests/s; 0 = off (default)")
    p.add_argument("--rate-limit-burst", type=int, help="per-client burst (default 20)")
    p.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        help="comma-separated addresses / networks of trusted reverse proxies: only requests from them "
        "have X-Forwarded-For honoured (rate-limit key = the forwarded client). Default: none, "
        "proxy headers are ignored and clients are keyed by the TCP peer",
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        help="close a connection whose request head has not arrived within S seconds of it opening or "
        "of the head's first byte (default 10)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        help="answer 408 and close when a request body has not arrived within S seconds (default 60)",
    )
    p.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        help="close an idle keep-alive connection S seconds after its last response (default 5)",
    )
    p.add_argument("--report", dest="report_path", help="evaluation report linked from the web page")
    p.add_argument("--device", help="torch device for the encoder (default cpu)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--log-level", help="info, warning, debug, ...")
    p.add_argument(
        "--normaliser",
        choices=("exact", "bounded", "auto"),
        help="log Z per query: exact (scan every embedding), bounded (IVF lists + sampled tail, with a "
        "bound that contains the exact value) or auto (exact up to N*dim = 1.28e8; default)",
    )
    p.add_argument(
        "--balance-connections",
        choices=("on", "off"),
        help="with --workers > 1: a worker holding more than its share of the open connections answers "
        "with Connection: close, so the client reconnects elsewhere (on, default) or not (off)",
    )
    p.add_argument(
        "--normaliser-overlap",
        choices=("on", "off"),
        help="bounded normaliser, a lone query: the head lists' and the first sample's dot products on a "
        "helper thread while the index searches (on) or one after the other (off, default); same answer",
    )
    p.add_argument(
        "--mapped-pages",
        choices=("auto", "release", "keep"),
        help="embeddings pages once the normaliser has read them: release (the RSS stays ~index + "
        "model), keep (no refaults; read pages count in the RSS) or auto (release after the "
        "exact scan, keep bounded's scattered reads; default)",
    )
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this process (uvicorn, default); ray: a sharded version on Ray Serve, one deployment "
        'per shard and an ingress with the same routes (needs the [ray] extra; README "Past one '
        'machine")',
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="--engine ray: the Ray cluster to join (e.g. auto after `ray start --head`; default: start a "
        "local Ray)",
    )
    p.add_argument(
        "--shard-replicas", type=int, default=1, help="--engine ray: replicas per shard (default 1)"
    )
    p.add_argument(
        "--shard-timeout-s",
        type=float,
        default=10.0,
        help="--engine ray: seconds to wait for a shard before answering 503 naming it (default 10)",
    )
    return p


def _threads(settings) -> int:
    """Threads per library call in one serving process: --torch-threads, else the cores shared out over
    workers x batch threads (torch's default, all cores each, would oversubscribe the CPU)."""
    if settings.torch_threads is not None:
        return settings.torch_threads
    batch = 2 if settings.batch_workers == "auto" else settings.batch_workers  # auto: at most 2
    return max(1, (os.cpu_count() or 1) // (settings.workers * batch))


def _library_threads(settings) -> None:
    """FAISS's OpenMP and numpy's OpenBLAS read their thread counts once, when they load, and only from
    the environment (a call in this thread would not reach the batch threads): as many as torch's. Their
    idle threads spin after each call, which cost a bounded batch of 16 three times the CPU per query and
    made a lone query wait for a second thread the other batch held (docs/results.md §28). Set before
    numpy loads, and before worker processes start (they inherit it: docs/results.md §30)."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, str(_threads(settings)))


def _configure(settings) -> None:
    """Logging and torch threads of one serving process."""
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _library_threads(settings)
    import torch

    torch.set_num_threads(_threads(settings))


def _freeze_startup_objects() -> None:
    """Move everything alive after start-up (torch, the model, the index's ids: ~0.5 M objects) out of
    the cyclic garbage collector's view: a full collection over them costs ~0.25 s of CPU, a pause
    that would land on some request; they live as long as the process anyway."""
    gc.collect()
    gc.freeze()


def worker_app():
    """uvicorn factory for one worker process of `serve --workers N` (settings from SOFTSEARCH_*)."""
    from api.config import load_settings

    settings = load_settings()
    _configure(settings)  # before the app's imports load numpy and FAISS
    _set_head_timeout(settings)
    from api.app import create_app

    app = create_app(settings)
    app = _balanced(app, settings)
    _freeze_startup_objects()
    return app


def _balanced(app, settings):
    """`app` wrapped to even out connections across the workers (api/balance.py), when several serve and
    the supervisor made the shared count file; else `app`."""
    from api import balance
    from api.metrics import MULTIPROC_ENV

    path = Path(os.environ.get(MULTIPROC_ENV, "")) / balance.FILE_NAME
    if settings.workers < 2 or settings.balance_connections != "on" or not path.is_file():
        return app
    balance.SHARE = balance.ConnectionShare(path, settings.workers)
    return balance.BalanceConnections(app, balance.SHARE)


def _set_head_timeout(settings) -> None:
    """The request-head deadline of this process's connections (read by the protocol class per connection)."""
    from api.timeouts import HeadTimeoutH11Protocol, HeadTimeoutHttpToolsProtocol

    HeadTimeoutH11Protocol.head_timeout_s = settings.header_timeout_s
    HeadTimeoutHttpToolsProtocol.head_timeout_s = settings.header_timeout_s


def _settings_env(settings) -> dict[str, str]:
    """SOFTSEARCH_* variables that rebuild `settings` in a worker process."""
    from api.config import ENV_PREFIX

    return {
        ENV_PREFIX + name.upper(): str(value)
        for name, value in settings.model_dump().items()
        if value is not None
    }


def _metrics_dir() -> tuple[str, bool]:
    """(PROMETHEUS_MULTIPROC_DIR for the workers, whether we created it). An operator's directory is
    kept, but sample files of earlier runs are removed so their counts do not add up with ours."""
    from api.metrics import MULTIPROC_ENV

    given = os.environ.get(MULTIPROC_ENV)
    if not given:
        return tempfile.mkdtemp(prefix="softsearch-metrics-"), True
    os.makedirs(given, exist_ok=True)
    for stale in glob.glob(os.path.join(given, "*.db")):
        os.remove(stale)
    return given, False


def _port_problem(host: str, port: int) -> str | None:
    """Bind the address once, before the model loads (seconds), so a busy port fails at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is fine
        try:
            sock.bind((host, port))
        except OSError as err:
            return (
                f"cannot listen on {host}:{port}: {err.strerror or err} "
                "(another server on that port? try --port)"
            )
    return None


def _startup_problem(settings) -> str | None:
    """A setting no running server could recover from: a busy port, or an index path that is not there."""
    root = settings.index_root
    if root is not None and not root.exists():
        return (
            f"--index {root} does not exist; build a version there first "
            f"(softsearch index build --root {root} ...) or fix the path"
        )
    return _port_problem(settings.host, settings.port)


def main(argv: list[str] | None = None) -> int:
    """Parse options, validate settings, build the app(s) and run uvicorn until interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from api.config import load_settings

    engine = {k: vars(args).pop(k) for k in ("engine", "ray_address", "shard_replicas", "shard_timeout_s")}
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    try:
        settings = load_settings(vars(args), flags=flags)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    problem = _startup_problem(settings)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if engine["engine"] == "ray":
        try:
            from api.ray_serve import serve_on_ray
        except ImportError as err:
            print(
                f"error: --engine ray needs Ray Serve ({err}); install the extra: pip install -e '.[ray]'",
                file=sys.stderr,
            )
            return 2
        return serve_on_ray(
            settings,
            address=engine["ray_address"],
            shard_replicas=engine["shard_replicas"],
            timeout_s=engine["shard_timeout_s"],
        )
    import uvicorn

    # proxy headers are handled inside the app, only for --forwarded-allow-ips (uvicorn's own default
    # would trust X-Forwarded-For from loopback, letting any local client pick its rate-limit bucket)
    # slow and idle clients (api/timeouts.py): the head deadline lives in the protocol class, set in each
    # serving process (worker_app for --workers N); idle keep-alive is uvicorn's own timer
    from api.timeouts import head_timeout_protocol

    serve = dict(
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
        proxy_headers=False,
        http=head_timeout_protocol(),
        timeout_keep_alive=settings.keep_alive_timeout_s,
    )
    if settings.workers > 1:
        from api.metrics import MULTIPROC_ENV

        logging.basicConfig(
            level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        metrics_dir, created = _metrics_dir()
        os.environ[MULTIPROC_ENV] = metrics_dir
        from api.balance import ConnectionShare

        ConnectionShare.create(metrics_dir)
        os.environ.update(_settings_env(settings))
        _library_threads(settings)
        logger.info("starting %d workers (metrics merged through %s)", settings.workers, metrics_dir)
        try:
            uvicorn.run(
                "api.server:worker_app",
                factory=True,
                workers=settings.workers,
                timeout_worker_healthcheck=WORKER_START_TIMEOUT_S,
                **serve,
            )
        finally:
            if created:
                shutil.rmtree(metrics_dir, ignore_errors=True)
        return 0
    _configure(settings)
    _set_head_timeout(settings)
    from api.app import create_app

    app = create_app(settings)
    _freeze_startup_objects()
    if app.state.searcher is None or not app.state.searcher.ready:
        logger.warning("serving without an index: /readyz answers 503 until an index is loaded")
    uvicorn.run(app, **serve)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
