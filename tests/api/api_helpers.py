"""Helpers shared by the API tests (imported by name; conftest puts this folder on sys.path)."""
from __future__ import annotations

import io
import socket
import threading
import time
from pathlib import Path

import torch
import uvicorn

from training.checkpoint import save_checkpoint
from training.encoder import EncoderConfig, create_encoder

TINY = dict(image_size=32, width=32, layers=1, heads=2, patch_size=8, mlp_ratio=2.0)
ADMIN_TOKEN = "test-admin-token-123"
INDEX_SIZE = 120


def make_checkpoint(path: Path, seed: int, embed_dim: int = 16, temperature: float = 0.2) -> Path:
    """A tiny randomly initialised (seeded) encoder saved as a real checkpoint."""
    torch.manual_seed(seed)
    enc = create_encoder(EncoderConfig(embed_dim=embed_dim, **TINY))
    return save_checkpoint(path, enc, step=0, train_config={"seed": seed},
                           lineage={"objective": "infonce", "temperature": temperature})


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving an app on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="on", limit_concurrency=1000))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
