"""index sync / delete (index/sync.py) over a real folder of PNG files that changes."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image, ImageOps

import index.build
from index.build import BuildOptions, build_index
from index.cli import main
from index.items import ITEM_FILES
from index.options import EmbedOptions
from index.store import IndexStore
from index.sync import delete_items, sync_index
from training.datasets import create_dataset

N = 80  # 10 % = 8 added, 8 removed; 5 % = 4 modified


@pytest.fixture
def folders(tmp_path, make_image_folder):
    """(folder with N images, spare images to add later)."""
    every = make_image_folder(tmp_path / "every", count=N + 8, classes=4, size=40)
    files = sorted(p for p in every.rglob("*.png"))
    folder, spare = tmp_path / "photos", tmp_path / "spare"
    for i, path in enumerate(files):
        dest = (folder if i < N else spare) / path.relative_to(every)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    return folder, spare


def _folder_ds(folder):
    return create_dataset("folder", split="all", root=str(folder), image_size=32)


@pytest.fixture
def embedded_ids(monkeypatch):
    """Every item id the encoder is given during the test (a wrapper around index.build.embed_shards)."""
    seen: list[str] = []
    real = index.build.embed_shards

    def counting(encoder, dataset, cache_dir, indices, **kw):
        seen.extend(dataset.item_id(int(i)) for i in indices)
        return real(encoder, dataset, cache_dir, indices, **kw)

    monkeypatch.setattr(index.build, "embed_shards", counting)
    return seen


def _change(folder, spare, rng):
    """Add 10 %, remove 10 %, modify 5 %, touch 5 % (new mtime, same bytes); returns the id sets."""
    ids = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))
    order = rng.permutation(len(ids))
    removed = [ids[i] for i in order[:8]]
    modified = [ids[i] for i in order[8:12]]
    touched = [ids[i] for i in order[12:16]]
    for item in removed:
        (folder / item).unlink()
    for item in modified:  # new content (inverted pixels), same name
        path = folder / item
        with Image.open(path) as im:
            ImageOps.invert(im.convert("RGB")).save(path)
    for item in touched:
        st = (folder / item).stat()
        os.utime(folder / item, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    added = []
    for path in sorted(spare.rglob("*.png")):
        item = path.relative_to(spare).as_posix()
        shutil.copy2(path, folder / item)
        added.append(item)
    return {"added": added, "removed": removed, "modified": modified, "touched": touched}


def test_sync_reembeds_exactly_the_changes_and_equals_a_fresh_build(
    tmp_path, folders, tiny_checkpoint, embedded_ids
):
    folder, spare = folders
    root = tmp_path / "index"
    v1 = build_index(tiny_checkpoint, _folder_ds(folder), root, BuildOptions(progress=False))
    store = IndexStore(root)
    assert len(json.loads((store.path(v1) / ITEM_FILES).read_text())["items"]) == N
    embedded_ids.clear()
    change = _change(folder, spare, np.random.default_rng(0))

    v2, counts = sync_index(root, embed=EmbedOptions(progress=False))
    assert v2 != v1 and store.current_version() == v2
    assert (counts["added"], counts["removed"], counts["modified"], counts["touched"]) == (8, 8, 4, 4)
    assert counts["unchanged"] == N - 8 - 4 - 4 and counts["embedded"] == 12 and counts["skipped"] == 0
    assert sorted(embedded_ids) == sorted(change["added"] + change["modified"])  # exactly those, nothing else
    synced = store.load(v2)
    assert synced.manifest.sync["embedded"] == 12 and synced.manifest.parent == v1

    scratch_root = tmp_path / "scratch"
    fresh = IndexStore(scratch_root).load(
        build_index(tiny_checkpoint, _folder_ds(folder), scratch_root, BuildOptions(progress=False))
    )
    assert synced.ids == fresh.ids  # same items, same (folder) order
    np.testing.assert_allclose(synced.embeddings, fresh.embeddings, atol=1e-6, rtol=0)
    assert not set(change["removed"]) & set(synced.ids) and set(change["added"]) <= set(synced.ids)
    old = store.load(v1)
    for item in change["touched"]:  # reused rows are the base's bytes
        assert np.array_equal(synced.embeddings[synced.ids.index(item)], old.embeddings[old.ids.index(item)])
    _, rows = synced.search(np.asarray(synced.embeddings[:5]), 1)
    assert rows[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert synced.manifest.dataset["fingerprint"] == _folder_ds(folder).fingerprint()

    embedded_ids.clear()
    assert (
        sync_index(root, embed=EmbedOptions(progress=False))[0] == v2 and embedded_ids == []
    )  # in step: nothing to do
    assert store.versions() == [v1, v2]


def test_sync_skips_and_reports_bad_files_and_retries_them(tmp_path, folders, tiny_checkpoint, embedded_ids):
    folder, _ = folders
    root = tmp_path / "index"
    build_index(tiny_checkpoint, _folder_ds(folder), root, BuildOptions(progress=False))
    victim = sorted(folder.rglob("*.png"))[3]
    good = victim.read_bytes()
    victim.write_bytes(good[: len(good) // 3])  # truncated in place
    (folder / "class0" / "notes.png").write_text("this is not an image")
    version, counts = sync_index(root, embed=EmbedOptions(progress=False))
    assert counts["modified"] == 1 and counts["added"] == 1 and counts["skipped"] == 2
    m = IndexStore(root).manifest(version)
    assert {s["id"] for s in m.skipped} == {victim.relative_to(folder).as_posix(), "class0/notes.png"}
    assert m.count == N - 1
    victim.write_bytes(good)  # repaired: embedded again ("retried")
    embedded_ids.clear()
    version, counts = sync_index(root, embed=EmbedOptions(progress=False))
    assert counts["retried"] == 2 and counts["embedded"] == 1 and counts["skipped"] == 1
    assert (
        IndexStore(root).manifest(version).count == N
        and embedded_ids.count(victim.relative_to(folder).as_posix()) == 1
    )


def test_sync_of_a_version_without_file_records_reembeds_what_it_cannot_vouch_for(
    tmp_path, folders, tiny_checkpoint
):
    folder, _ = folders
    root = tmp_path / "index"
    v1 = build_index(tiny_checkpoint, _folder_ds(folder), root, BuildOptions(progress=False))
    path = IndexStore(root).path(v1)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"][ITEM_FILES]  # as written before records existed
    (path / ITEM_FILES).unlink()
    (path / "manifest.json").write_text(json.dumps(manifest))
    next(iter(sorted(folder.rglob("*.png")))).unlink()
    _, counts = sync_index(root, embed=EmbedOptions(progress=False))
    assert (
        counts["removed"] == 1
        and counts["modified"] == counts["unrecorded"] == N - 1
        and counts["embedded"] == N - 1
    )


def test_delete_drops_items_and_keeps_the_rest(tmp_path, folders, tiny_checkpoint, capsys):
    folder, _ = folders
    root = tmp_path / "index"
    v1 = build_index(tiny_checkpoint, _folder_ds(folder), root, BuildOptions(progress=False))
    store = IndexStore(root)
    old = store.load(v1)
    drop = old.ids[5:8]
    v2, counts = delete_items(root, drop)
    new = store.load(v2)
    assert counts["deleted"] == 3 and new.ids == [i for i in old.ids if i not in drop]
    np.testing.assert_array_equal(
        new.embeddings, np.asarray(old.embeddings)[[i for i, x in enumerate(old.ids) if x not in drop]]
    )
    assert new.manifest.deleted["deleted"] == 3 and store.current_version() == v2

    ids_file = tmp_path / "ids.txt"
    ids_file.write_text(f"{new.ids[0]}\nno/such/item.png\n\n")
    assert main(["delete", "--root", str(root), "--ids-file", str(ids_file)]) == 2
    assert "1 of the 2 ids are not in" in capsys.readouterr().err and store.current_version() == v2
    assert main(["delete", "--root", str(root), "--ids-file", str(ids_file), "--ignore-missing"]) == 0
    assert "1 deleted, 1 ids not found" in capsys.readouterr().out
    assert new.ids[0] not in store.load().ids


def test_sync_cli_summary_and_user_errors(tmp_path, folders, tiny_checkpoint, capsys):
    folder, spare = folders
    root = tmp_path / "index"
    build_index(tiny_checkpoint, _folder_ds(folder), root, BuildOptions(progress=False))
    _change(folder, spare, np.random.default_rng(1))
    assert main(["sync", "--root", str(root), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "index sync: version" in out and "8 added, 8 removed, 4 modified" in out and "12 embedded" in out
    assert main(["sync", "--root", str(root), "--no-progress"]) == 0
    assert "already in step" in capsys.readouterr().out
    synthetic = tmp_path / "synthetic"
    build_index(
        tiny_checkpoint,
        create_dataset("synthetic", split="train", size=16),
        synthetic,
        BuildOptions(progress=False),
    )
    for argv, message in (
        (["sync", "--root", str(synthetic)], "not built from an image folder"),
        (["sync", "--root", str(root), "--data-root", str(tmp_path / "gone")], "not found"),
        (["sync", "--root", str(tmp_path / "empty")], "empty does not exist"),
        (["sync", "--root", str(tmp_path)], "no current index version"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_sync_of_a_sharded_version_reembeds_only_the_changes_and_stays_sharded(
    tmp_path, folders, tiny_checkpoint, embedded_ids, capsys
):
    """`index sync` on a 3-shard version: the file records survive the reshard, so exactly the added and
    modified files are embedded; the result is a 3-shard version with a fresh build's ids and rows; a second
    sync is in step and writes nothing."""
    from index.shards import ShardedVersion, reshard

    folder, spare = folders
    root = tmp_path / "index"
    build_index(tiny_checkpoint, _folder_ds(folder), root, BuildOptions(progress=False))
    v1 = reshard(root, 3)
    embedded_ids.clear()
    change = _change(folder, spare, np.random.default_rng(0))
    assert main(["sync", "--root", str(root), "--no-progress"]) == 0
    assert "3 shards" in capsys.readouterr().out
    assert sorted(embedded_ids) == sorted(change["added"] + change["modified"])
    store = IndexStore(root)
    synced = store.load(verify=True)
    assert isinstance(synced, ShardedVersion) and len(synced.manifest.shards) == 3
    fresh_root = tmp_path / "fresh"
    fresh = IndexStore(fresh_root).load(
        build_index(tiny_checkpoint, _folder_ds(folder), fresh_root, BuildOptions(progress=False))
    )
    assert synced.ids == fresh.ids
    np.testing.assert_allclose(np.asarray(synced.embeddings), fresh.embeddings, atol=1e-6, rtol=0)
    versions = store.versions()
    embedded_ids.clear()
    assert main(["sync", "--root", str(root), "--no-progress"]) == 0
    assert "already in step" in capsys.readouterr().out and embedded_ids == []
    assert store.versions() == versions and v1 in versions and len(versions) == 3  # whole, v1, synced
