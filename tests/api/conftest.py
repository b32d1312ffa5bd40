"""API test fixtures: a REAL small index (synthetic data, tiny untrained encoder checkpoint)
and TestClients over it. Shared helpers live in api_helpers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from api_helpers import ADMIN_TOKEN, INDEX_SIZE, make_checkpoint  # noqa: E402

from api.app import create_app  # noqa: E402
from api.config import Settings  # noqa: E402
from index.build import BuildOptions, build_index  # noqa: E402
from training.datasets import create_dataset  # noqa: E402


@pytest.fixture(scope="session")
def api_dataset():
    return create_dataset("synthetic", split="train", size=INDEX_SIZE, seed=0)


@pytest.fixture(scope="session")
def api_index(tmp_path_factory, api_dataset):
    """{root, checkpoint, version}: one flat index version over INDEX_SIZE synthetic items."""
    base = tmp_path_factory.mktemp("api_index")
    ck = make_checkpoint(base / "encoder.safetensors", seed=7)
    root = base / "index"
    version = build_index(ck, api_dataset, root, BuildOptions(progress=False))
    return {"root": root, "checkpoint": ck, "version": version, "base": base}


@pytest.fixture(scope="session")
def folder_index(tmp_path_factory, make_image_folder):
    """{root, folder, version, ids}: a flat index over 60 real PNG files in 3 class folders, with a user
    `rating` field (id n has rating n % 5) from a CSV metadata file."""
    from index.metadata import load_user_metadata
    from index.store import IndexStore

    base = tmp_path_factory.mktemp("filters_api")
    folder = make_image_folder(base / "photos", count=60, classes=3, size=40)
    ck = make_checkpoint(base / "encoder.safetensors", seed=5)
    ids = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))
    user = base / "user.csv"
    user.write_text("id,rating\n" + "".join(f"{i},{n % 5}\n" for n, i in enumerate(ids)))
    root = base / "index"
    ds = create_dataset("folder", split="all", root=str(folder), image_size=32)
    build_index(ck, ds, root, BuildOptions(progress=False, metadata=load_user_metadata(user)))
    version = IndexStore(root).load(verify=False, gpu=False)
    return {"root": root, "folder": folder, "version": version, "ids": ids}


@pytest.fixture
def make_client(api_index):
    """make_client(**settings) -> TestClient over the shared index (lifespan run, closed afterwards)."""
    clients = []

    def make(**overrides) -> TestClient:
        settings = Settings(**{"index_root": api_index["root"], "admin_token": ADMIN_TOKEN, **overrides})
        client = TestClient(create_app(settings))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def client(make_client):
    return make_client()
