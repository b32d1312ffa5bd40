"""Sharded versions in the store: `index build --shards`, `index reshard`, verify, export / import,
refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from index.cli import main
from index.shards import ShardedRows, ShardedVersion, split_rows
from index.store import IndexStore
from index.transfer import export_version, import_version


def _build(root, checkpoint, *extra) -> list[str]:
    return [
        "build",
        "--root",
        str(root),
        "--checkpoint",
        str(checkpoint),
        "--dataset",
        "synthetic",
        "--size",
        "50",
        "--no-progress",
        *extra,
    ]


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
    assert store.versions() == [store.current_version()]  # the unsharded intermediate is gone
    m = store.manifest(store.current_version())
    assert [e["count"] for e in m.shards] == [16, 17, 17] and m.count == 50
    assert m.quality_gate is not None and m.recall.recall == 1.0
    assert "50 items" in out and "activated" in out
    loaded = store.load()
    assert isinstance(loaded, ShardedVersion)
    for entry, shard in zip(m.shards, loaded.shards):  # each shard a complete version of its rows
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


def test_reshard_refusals_are_one_error_line(tmp_path, tiny_checkpoint, capsys):
    root = tmp_path / "idx"
    assert main(_build(root, tiny_checkpoint, "--size", "5", "--shards", "2")) == 0
    capsys.readouterr()
    assert main(["reshard", "--root", str(root), "--shards", "9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "9 shards" in err and err.count("\n") == 1
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
    assert (
        json.loads(
            (IndexStore(tmp_path / "other").path(version) / "shard-001" / "manifest.json").read_text()
        )["count"]
        == 25
    )


def test_add_and_delete_on_a_sharded_version_equal_them_on_the_unsharded_one(
    tmp_path, tiny_checkpoint, capsys
):
    """`index delete` then `index add` on a 3-shard version give a 3-shard version with the ids, rows and
    served probabilities (to 1e-6) of the same commands on the unsharded version; the intermediates are
    gone."""
    import shutil

    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.cli import main as softsearch
    from api.config import Settings

    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    assert main(_build(plain, tiny_checkpoint, "--size", "40")) == 0
    shutil.copytree(plain, sharded)
    assert main(["reshard", "--root", str(sharded), "--shards", "3"]) == 0
    first = IndexStore(sharded).current_version()
    ids = IndexStore(plain).load().ids
    (tmp_path / "drop.txt").write_text("\n".join([ids[0], ids[5], ids[20], ids[39]]) + "\n")
    for root in (plain, sharded):
        assert (
            softsearch(
                ["index", "delete", "--root", str(root), "--ids-file", str(tmp_path / "drop.txt"), "--force"]
            )
            == 0
        )  # a random encoder: the gate may score the smaller set lower
        assert (
            softsearch(
                [
                    "index",
                    "add",
                    "--root",
                    str(root),
                    "--dataset",
                    "synthetic",
                    "--split",
                    "test",
                    "--size",
                    "6",
                    "--no-progress",
                    "--checkpoint",
                    str(tiny_checkpoint),
                    "--force",
                ]
            )
            == 0
        )
    out = capsys.readouterr().out
    assert "3 shards (42 items; 36 in" in out
    want, got = IndexStore(plain).load(), IndexStore(sharded).load(verify=True)
    assert isinstance(got, ShardedVersion) and len(got.manifest.shards) == 3 and len(got) == len(want) == 42
    assert got.ids == want.ids and ids[5] not in got.ids
    np.testing.assert_allclose(np.asarray(got.embeddings), np.asarray(want.embeddings), atol=1e-6, rtol=0)
    gate = (
        got.manifest.quality_gate
    )  # gated against the sharded version it replaced, scored like the plain one
    assert gate.serving_version != first and gate.candidate == pytest.approx(
        want.manifest.quality_gate.candidate, rel=1e-4, abs=1e-6
    )
    store = IndexStore(sharded)  # the original plain version, the first sharded one, after delete, after add
    assert len(store.versions()) == 4 and all(store.manifest(v).shards for v in store.versions()[1:])
    ref = TestClient(create_app(Settings(index_root=plain, watch_interval_s=0)))
    fan = TestClient(create_app(Settings(index_root=sharded, watch_interval_s=0)))
    with ref, fan:
        rng = np.random.default_rng(5)
        for body in (
            {"vector": rng.normal(size=16).tolist(), "k": 42, "temperature": 0.2},
            {"id": got.ids[-1], "k": 5, "temperature": 0.1},
        ):
            route = "/v1/search/item" if "id" in body else "/v1/search/vector"
            w, g = ref.post(route, json=body).json(), fan.post(route, json=body).json()
            assert [h["id"] for h in g["results"]] == [h["id"] for h in w["results"]]
            np.testing.assert_allclose(
                [h["probability"] for h in g["results"]],
                [h["probability"] for h in w["results"]],
                atol=1e-6,
                rtol=0,
            )
