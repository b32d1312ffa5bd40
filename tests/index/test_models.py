"""Encoder weights inside the store (index/models.py): content-addressed, verified, shared, pruned,
and migrated from stores written before the layout existed."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from index_refs import copy_checkpoint

from index.build import BuildOptions, add_items, build_index, rebuild_index
from index.manifest import IndexCorruptError, file_sha256
from index.models import load_version_encoder, model_relpath
from index.options import EmbedOptions
from index.store import IndexStore
from training.checkpoint import load_checkpoint
from training.encoder import embed


@pytest.fixture(scope="module")
def items(tiny_synthetic):
    return tiny_synthetic


@pytest.fixture(scope="module")
def more_items(tiny_synthetic_test):
    return tiny_synthetic_test


def test_build_stores_the_weights_and_needs_no_training_dir(tmp_path, tiny_checkpoint, items, more_items):
    run = tmp_path / "run"
    ck = copy_checkpoint(tiny_checkpoint, run)
    root = tmp_path / "index"
    v1 = build_index(ck, items, root, BuildOptions(progress=False))
    store = IndexStore(root)
    sha = file_sha256(ck)
    m = store.manifest(v1)
    assert m.checkpoint.sha256 == sha and m.checkpoint.model == model_relpath(sha)
    assert m.checkpoint.path == str(ck.resolve())  # provenance only
    assert file_sha256(root / model_relpath(sha)) == sha  # a byte-exact copy
    reference, _ = load_checkpoint(ck)
    shutil.move(run, tmp_path / "moved-away")  # the training directory is gone
    encoder, _, got_sha = load_version_encoder(store.load())
    assert got_sha == sha
    x = items.tensors(np.arange(8))
    np.testing.assert_array_equal(embed(encoder, x, progress=False), embed(reference, x, progress=False))
    v2 = add_items(
        root, more_items, embed=EmbedOptions(progress=False)
    )  # grows without the original checkpoint
    assert store.manifest(v2).checkpoint.sha256 == sha and store.models.shas() == [sha]


def test_versions_share_one_model_and_prune_drops_unused_ones(
    tmp_path, tiny_checkpoint, other_checkpoint, items
):
    root = tmp_path / "index"
    build_index(tiny_checkpoint, items, root, BuildOptions(progress=False))
    build_index(tiny_checkpoint, items, root, BuildOptions(progress=False))
    store = IndexStore(root)
    first = file_sha256(tiny_checkpoint)
    assert store.models.shas() == [first]  # written once, shared
    v3 = rebuild_index(root, other_checkpoint, BuildOptions(progress=False, force=True))
    second = file_sha256(other_checkpoint)
    assert sorted(store.models.shas()) == sorted([first, second])
    assert store.prune(2) and store.models.shas() == sorted([first, second])  # grace period: both young
    store.prune(1, model_grace_s=0.0)
    assert store.versions() == [v3] and store.models.shas() == [second]  # only the model v3 uses is left
    assert store.load().manifest.checkpoint.sha256 == second


def test_damaged_model_is_refused_or_repaired_from_its_source(tmp_path, tiny_checkpoint, items):
    run = tmp_path / "run"
    ck = copy_checkpoint(tiny_checkpoint, run)
    root = tmp_path / "index"
    build_index(ck, items, root, BuildOptions(progress=False))
    store = IndexStore(root)
    sha = file_sha256(ck)
    model = root / model_relpath(sha)
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    encoder, _, _ = load_version_encoder(store.load())  # the source still matches: restored
    assert file_sha256(model) == sha
    model.write_bytes(bytes(data))
    os.utime(model, ns=(1, 1))  # new identity: no remembered hash
    shutil.rmtree(run)
    with pytest.raises(IndexCorruptError, match="damaged"):
        load_version_encoder(store.load())


def _make_old_store(root, ck, items):
    """A store as written before models/ existed: no models dir, manifests without checkpoint.model."""
    version = build_index(ck, items, root, BuildOptions(progress=False))
    shutil.rmtree(root / "models")
    path = root / "versions" / version / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["checkpoint"]["model"]
    path.write_text(json.dumps(manifest))
    return version


def test_old_store_migrates_on_first_use(tmp_path, tiny_checkpoint, items):
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "run")
    root = tmp_path / "index"
    _make_old_store(root, ck, items)
    store = IndexStore(root)
    assert store.models.shas() == []
    load_version_encoder(store.load())  # first use copies the checkpoint in
    sha = file_sha256(ck)
    assert store.models.shas() == [sha]
    shutil.rmtree(tmp_path / "run")
    load_version_encoder(store.load())  # and from then on it is self-contained


def test_old_store_without_its_checkpoint_says_what_to_copy_where(tmp_path, tiny_checkpoint, items):
    ck = copy_checkpoint(tiny_checkpoint, tmp_path / "run")
    root = tmp_path / "index"
    version = _make_old_store(root, ck, items)
    sha = file_sha256(ck)
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(FileNotFoundError) as err:
        load_version_encoder(IndexStore(root).load())
    message = str(err.value)
    assert version in message and str(root / model_relpath(sha)) in message and "index rebuild" in message
    (root / "models").mkdir()
    shutil.copyfile(tiny_checkpoint, root / model_relpath(sha))  # doing what the message says works
    load_version_encoder(IndexStore(root).load())


def test_a_version_an_import_stages_reads_its_model_from_the_store_only(tmp_path, tiny_checkpoint, items):
    """An import stages the archive in root/staging/import-<id>/versions/<v> and moves the model into
    root/models before the gate: the gate's encoder is the store's file by its sha256, never the training
    path the manifest records (on another machine that path is gone, or is some other file)."""
    from index.models import IMPORT_STAGING_PREFIX, store_root_of
    from index.store import IndexVersion

    run = tmp_path / "run"
    ck = copy_checkpoint(tiny_checkpoint, run)
    root = tmp_path / "index"
    version = build_index(ck, items, root, BuildOptions(progress=False))
    sha = file_sha256(ck)
    staged = root / "staging" / f"{IMPORT_STAGING_PREFIX}0123abcd" / "versions" / version
    shutil.copytree(root / "versions" / version, staged)
    assert store_root_of(staged) == root and store_root_of(root / "versions" / version) == root
    loaded = IndexVersion.load(staged, verify=True, gpu=False)
    encoder, _, got = load_version_encoder(loaded)
    assert got == sha
    reference, _ = load_checkpoint(ck)
    x = items.tensors(np.arange(4))
    np.testing.assert_array_equal(embed(encoder, x, progress=False), embed(reference, x, progress=False))
    # the store's copy gone, the recorded training checkpoint still there: refused, nothing copied from it
    (root / model_relpath(sha)).unlink()
    assert ck.is_file() and file_sha256(ck) == sha
    with pytest.raises(FileNotFoundError, match=f"needs encoder model {sha[:12]}.*not in {root / 'models'}"):
        load_version_encoder(loaded)
    assert not (root / model_relpath(sha)).exists()
    # a committed version still migrates from its recorded path (stores older than models/)
    load_version_encoder(IndexVersion.load(root / "versions" / version, verify=False, gpu=False))
    assert file_sha256(root / model_relpath(sha)) == sha
