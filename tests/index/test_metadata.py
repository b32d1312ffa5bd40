"""Per-item metadata (index/metadata.py): built-in folder fields, user files, carried through
add/sync/delete."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from PIL import Image

from index.build import BuildOptions, build_index
from index.cli import main
from index.metadata import ITEM_METADATA, Metadata, MetadataError, load_user_metadata, read_metadata
from index.options import EmbedOptions
from index.store import IndexStore
from index.sync import delete_items, sync_index
from training.datasets import create_dataset


def _folder_ds(folder):
    return create_dataset("folder", split="all", root=str(folder), image_size=32)


@pytest.fixture
def folder(tmp_path, make_image_folder):
    return make_image_folder(tmp_path / "photos", count=24, classes=3, size=40)


def test_folder_build_stores_file_facts_read_independently(tmp_path, folder, tiny_checkpoint):
    # one JPEG of another size among the PNGs: width/height/format come from each file's own header
    jpeg = folder / "class1" / "wide.jpg"
    Image.new("RGB", (70, 30), (200, 10, 10)).save(jpeg, quality=90)
    root = tmp_path / "index"
    version = build_index(tiny_checkpoint, _folder_ds(folder), root, BuildOptions(progress=False))
    meta = read_metadata(IndexStore(root).path(version))
    assert meta.types == {
        "path": "str",
        "class": "str",
        "size": "int",
        "mtime": "float",
        "width": "int",
        "height": "int",
        "format": "str",
    }
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    assert sorted(meta.items) == sorted(p.relative_to(folder).as_posix() for p in files)
    for p in files:
        rec = meta.items[p.relative_to(folder).as_posix()]
        with Image.open(p) as im:
            assert (rec["width"], rec["height"], rec["format"]) == (im.size[0], im.size[1], im.format.lower())
        assert rec["size"] == os.path.getsize(p) and rec["class"] == p.parent.name
        assert abs(rec["mtime"] - os.path.getmtime(p)) < 1e-3
    assert meta.items["class1/wide.jpg"]["format"] == "jpeg" and meta.items["class1/wide.jpg"]["width"] == 70
    # the file is listed (and checksummed) in the manifest like every other version file
    assert ITEM_METADATA in IndexStore(root).manifest(version).files


def test_user_metadata_jsonl_and_csv_types_and_errors(tmp_path):
    jl = tmp_path / "m.jsonl"
    jl.write_text('{"id": "a", "stars": 3, "tag": "red", "ok": true}\n\n{"id": "b", "stars": 4.5}\n')
    m = load_user_metadata(jl)
    assert m.types == {"stars": "float", "tag": "str", "ok": "bool"}
    assert m.items == {"a": {"stars": 3.0, "tag": "red", "ok": True}, "b": {"stars": 4.5}}
    cs = tmp_path / "m.csv"
    cs.write_text("id,stars,tag,ok\na,3,red,true\nb,,blue,FALSE\nc,12,7x,true\n")
    m = load_user_metadata(cs)
    assert m.types == {"stars": "int", "tag": "str", "ok": "bool"}
    assert m.items["b"] == {"tag": "blue", "ok": False} and m.items["c"]["stars"] == 12
    bad = tmp_path / "bad.jsonl"
    for text, needle in [
        ('{"id": "a", "x": 1}\n{"id": "b", "x": "one"}\n', "'x' is str here but int"),
        ('{"id": "a", "class": "mine"}\n', "'class' is built in"),
        ('{"x": 1}\n', 'needs a non-empty string "id"'),
        ('{"id": "a", "x": [1]}\n', "must be a string, number or boolean"),
        ('{"id": "a"\n', "not JSON"),
    ]:
        bad.write_text(text)
        with pytest.raises(MetadataError, match=needle):
            load_user_metadata(bad)
    nohead = tmp_path / "n.csv"
    nohead.write_text("name,x\na,1\n")
    with pytest.raises(MetadataError, match="'id' column"):
        load_user_metadata(nohead)


def test_metadata_follows_items_through_add_sync_delete_and_rebuild(
    tmp_path, folder, tiny_checkpoint, other_checkpoint, make_image_folder
):
    root = tmp_path / "index"
    user = tmp_path / "user.jsonl"
    ids = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))
    user.write_text(
        "".join(
            json.dumps({"id": i, "rating": n % 5, "album": f"al{n % 2}"}) + "\n" for n, i in enumerate(ids)
        )
        + json.dumps({"id": "not/indexed.png", "rating": 1})
        + "\n"
    )
    v1 = build_index(
        tiny_checkpoint,
        _folder_ds(folder),
        root,
        BuildOptions(progress=False, metadata=load_user_metadata(user)),
    )
    store = IndexStore(root)
    m1 = read_metadata(store.path(v1))
    assert m1.types["rating"] == "int" and m1.types["album"] == "str"
    assert "not/indexed.png" not in m1.items and m1.items[ids[3]]["rating"] == 3
    # sync: a file removed, one added; the kept items keep their user fields, the new one has file facts only
    (folder / ids[0]).unlink()
    extra = make_image_folder(tmp_path / "extra", count=1, classes=1, size=40)
    new = next(extra.rglob("*.png"))
    shutil.copy2(new, folder / "class0" / "added.png")
    v2, counts = sync_index(root, embed=EmbedOptions(progress=False))
    m2 = read_metadata(store.path(v2))
    assert ids[0] not in m2.items and m2.items["class0/added.png"]["class"] == "class0"
    assert "rating" not in m2.items["class0/added.png"] and m2.items[ids[5]]["rating"] == 0
    # sync with only new metadata writes a version with it
    more = tmp_path / "more.csv"
    more.write_text("id,rating\nclass0/added.png,4\n")
    v3, _ = sync_index(root, embed=EmbedOptions(progress=False), metadata=load_user_metadata(more))
    assert v3 != v2 and read_metadata(store.path(v3)).items["class0/added.png"]["rating"] == 4
    # delete: the dropped item's fields go with it
    v4, _ = delete_items(root, [ids[5]])
    assert ids[5] not in read_metadata(store.path(v4)).items
    # rebuild with a new encoder re-reads file facts and carries the user's fields
    from index.build import rebuild_index

    v5 = rebuild_index(root, other_checkpoint, BuildOptions(progress=False))
    m5 = read_metadata(store.path(v5))
    assert m5.items[ids[7]]["rating"] == 7 % 5 and m5.items["class0/added.png"]["rating"] == 4
    assert m5.items[ids[7]]["width"] == 40


def test_cli_metadata_option_and_bad_file_is_one_line(tmp_path, folder, tiny_checkpoint, capsys):
    root = tmp_path / "index"
    bad = tmp_path / "bad.csv"
    bad.write_text("name\nx\n")
    args = [
        "build",
        "--root",
        str(root),
        "--checkpoint",
        str(tiny_checkpoint),
        "--dataset",
        "folder",
        "--split",
        "all",
        "--data-root",
        str(folder),
        "--no-progress",
    ]
    assert main(args + ["--metadata", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "'id' column" in err[0]
    good = tmp_path / "good.csv"
    first = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png"))[0]
    good.write_text(f"id,starred\n{first},true\n")
    assert main(args + ["--metadata", str(good)]) == 0
    store = IndexStore(root)
    meta = read_metadata(store.path(store.current_version()))
    assert meta.types["starred"] == "bool" and meta.items[first]["starred"] is True


def test_merge_rejects_a_type_change():
    a = Metadata({"x": "str"}, {"i": {"x": "s"}})
    with pytest.raises(MetadataError, match="'x' is str in the index but int"):
        a.merge(Metadata({"x": "int"}, {"i": {"x": 1}}))
    assert a.merge(Metadata({"y": "int"}, {"j": {"y": 1}})).types == {"x": "str", "y": "int"}
