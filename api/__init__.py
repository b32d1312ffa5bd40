"""softsearch.api: the FastAPI service (search by image or vector, items, manifest, health,
metrics, admin reload, web page) and the `softsearch` command line."""

from api.config import Settings, load_settings

__all__ = ["Settings", "create_app", "load_settings"]


def __getattr__(name: str):
    """`create_app` on first use: it imports torch, FAISS and the model code (~1 GB resident), which the
    supervisor process of `softsearch serve --workers N` never needs (only its workers do)."""
    if name == "create_app":
        from api.app import create_app

        return create_app
    raise AttributeError(f"module 'api' has no attribute {name!r}")
