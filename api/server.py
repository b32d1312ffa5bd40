"""`softsearch serve`: run the HTTP service with uvicorn.

    softsearch serve --index ROOT [--host 127.0.0.1] [--port 8000] [--admin-token T] [--report PATH] ...

Every option also reads from SOFTSEARCH_* environment variables (the CLI wins); invalid
settings stop the command before the server starts, with `error: ...` and exit code 2.
"""
from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="softsearch serve", description="Serve the search API and web page.")
    p.add_argument("--index", dest="index_root", help="index store root (SOFTSEARCH_INDEX_ROOT)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0 = any free port)")
    p.add_argument("--admin-token", help="enables /v1/admin/* with this bearer token (SOFTSEARCH_ADMIN_TOKEN)")
    p.add_argument("--max-k", type=int, help="largest k per request (default 100)")
    p.add_argument("--max-upload-bytes", type=int, help="largest upload in bytes (default 10 MiB)")
    p.add_argument("--max-image-pixels", type=int, help="largest width*height of an upload (default 20M)")
    p.add_argument("--batch-max-size", type=int, help="micro-batch size; 1 disables batching (default 32)")
    p.add_argument("--batch-max-wait-ms", type=float, help="micro-batch wait in ms (default 0: adaptive)")
    p.add_argument("--batch-workers", type=int, help="micro-batches in flight at once (default 2)")
    p.add_argument("--rate-limit-rps", type=float, help="per-client requests/s; 0 = off (default)")
    p.add_argument("--rate-limit-burst", type=int, help="per-client burst (default 20)")
    p.add_argument("--report", dest="report_path", help="evaluation report linked from the web page")
    p.add_argument("--device", help="torch device for the encoder (default cpu)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--log-level", help="info, warning, debug, ...")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse options, validate settings, build the app and run uvicorn until interrupted."""
    args = build_parser().parse_args(argv)
    from api.config import load_settings

    try:
        settings = load_settings(vars(args))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    if settings.torch_threads is not None:
        import torch

        torch.set_num_threads(settings.torch_threads)

    from api.app import create_app

    app = create_app(settings)
    if app.state.searcher is None or not app.state.searcher.ready:
        logger.warning("serving without an index: /readyz answers 503 until an index is loaded")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False, timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
