"""Sharded versions in the store: `index build --shards`, `index reshard`, verify, export / import, refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from index.cli import main
from index.shards import ShardedRows, ShardedVersion, split_rows
from index.store import IndexStore
from index.transfer import export_version, import_version


def _build(root, checkpoint, *extra) -> list[str]:
    return ["build", "--root", str(root), "--checkpoint", str(checkpoint), "--dataset", "synthetic",
            "--size", "50", "--no-progress", *extra]


def test_split_rows_covers_every_row_once():
    for n, s in [(10, 1), (10, 3), (7, 7), (1000, 6)]:
        ranges = split_rows(n, s)
        assert len(ranges) == s and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    with pytest.raises(ValueError, match="at least one item"):
        split_rows(3, 4)
    with pytest.raises(ValueError, match="positive"):
        split_rows(3, 0)


def test_sharded_rows_read_like_the_concatenated_matrix():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 3)).astype(np.float32) for n in (10, 1, 7)]
    whole, rows = np.concatenate(parts), ShardedRows(parts)
    assert rows.shape == whole.shape and len(rows) == 18
    for key in (0, 10, 11, 17, -1, slice(3, 15), slice(None, None, 4), np.array([17, 0, 10, 11, -2, 5])):
        np.testing.assert_array_equal(rows[key], whole[key])
    np.testing.assert_array_equal(np.asarray(rows), whole)
    assert rows.locate(10) == (1, 0) and rows.locate(11) == (2, 0)
    with pytest.raises(IndexError):
        rows[18]
    with pytest.raises(IndexError):
        rows[np.array([3, 18])]


def test_build_with_shards_writes_one_gated_version(tmp_path, tiny_checkpoint, capsys):
    root = tmp_path / "idx"
    assert main(_build(root, tiny_checkpoint, "--shards", "3")) == 0
    out = capsys.readouterr().out
    store = IndexStore(root)
    assert store.versions() == [store.current_version()]          # the unsharded intermediate is gone
    m = store.manifest(store.current_version())
    assert [e["count"] for e in m.shards] == [16, 17, 17] and m.count == 50
    assert m.quality_gate is not None and m.recall.recall == 1.0
    assert "50 items" in out and "activated" in out
    loaded = store.load()
    assert isinstance(loaded, ShardedVersion)
    for entry, shard in zip(m.shards, loaded.shards):   # each shard a complete version of its rows
        assert shard.manifest.version == f"{m.version}.{entry['name']}" and len(shard.ids) == entry["count"]
        assert shard.index.ntotal == entry["count"]
    assert main(["verify", "--root", str(root)]) == 0
    assert f"{len(m.files)} files" in capsys.readouterr().out
    assert main(["list", "--root", str(root), "--json"]) == 0
    assert [v["shards"] for v in json.loads(capsys.readouterr().out)["versions"]] == [3]


def test_reshard_keeps_rows_and_verify_catches_a_damaged_shard(tmp_path, tiny_checkpoint, capsys):
    root = tmp_path / "idx"
    assert main(_build(root, tiny_checkpoint)) == 0
    store = IndexStore(root)
    whole = store.current_version()
    assert main(["reshard", "--root", str(root), "--shards", "2"]) == 0
    sharded = store.current_version()
    assert sharded != whole and store.manifest(sharded).parent == whole
    a, b = store.load(whole), store.load(sharded)
    assert a.ids == b.ids
    np.testing.assert_array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
    # rollback and activate move between the sharded version and its parent like any two versions
    assert main(["rollback", "--root", str(root)]) == 0 and store.current_version() == whole
    assert main(["activate", "--root", str(root), sharded]) == 0 and store.current_version() == sharded
    # resharding a sharded version: same rows again, in 4 shards
    assert main(["reshard", "--root", str(root), "--shards", "4", "--version", sharded]) == 0
    c = store.load()
    assert len(c.shards) == 4 and c.ids == a.ids
    np.testing.assert_array_equal(np.asarray(c.embeddings), np.asarray(a.embeddings))
    # a damaged shard file is caught by the top-level checksums
    target = store.path(sharded) / "shard-001" / "embeddings.npy"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0xFF
    target.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", "--root", str(root), sharded]) == 1
    assert "shard-001/embeddings.npy" in capsys.readouterr().out


def test_reshard_and_add_refusals_are_one_error_line(tmp_path, tiny_checkpoint, capsys):
    root = tmp_path / "idx"
    assert main(_build(root, tiny_checkpoint, "--size", "5", "--shards", "2")) == 0
    capsys.readouterr()
    assert main(["reshard", "--root", str(root), "--shards", "9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "9 shards" in err and err.count("\n") == 1
    assert main(["add", "--root", str(root), "--dataset", "synthetic", "--size", "3", "--seed", "4"]) == 2
    assert "sharded version" in capsys.readouterr().err
    assert main(_build(tmp_path / "b", tiny_checkpoint, "--shards", "0")) == 2


def test_export_import_of_a_sharded_version(tmp_path, tiny_checkpoint):
    root = tmp_path / "idx"
    assert main(_build(root, tiny_checkpoint, "--shards", "2")) == 0
    version = IndexStore(root).current_version()
    archive = export_version(root, tmp_path / "v.tar")
    imported, existed = import_version(tmp_path / "other", archive)
    assert imported == version and not existed
    a, b = IndexStore(root).load(), IndexStore(tmp_path / "other").load()
    assert isinstance(b, ShardedVersion) and a.ids == b.ids
    np.testing.assert_array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
    assert json.loads((IndexStore(tmp_path / "other").path(version) / "shard-001" / "manifest.json").read_text())[
        "count"] == 25
