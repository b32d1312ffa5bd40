"""softsearch.api: the FastAPI service (search by image or vector, items, manifest, health,
metrics, admin reload, web page) and the `softsearch` command line."""
from api.app import create_app
from api.config import Settings, load_settings

__all__ = ["Settings", "create_app", "load_settings"]
