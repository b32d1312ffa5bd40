"""Bring your own vectors: `index build --embeddings FILE [--ids FILE] [--metadata FILE]` on real .npy files,
checked against numpy (normalisation, exact search), and the recall-check gate of versions without an
encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from index import faiss_index
from index.cli import main as index_main
from index.gate import held_out_recall
from index.store import IndexStore
from index.vectors import open_vectors, read_ids, unit_rows


def clustered(n: int, d: int, seed: int = 0, clusters: int = 40, spread: float = 0.35) -> np.ndarray:
    """Unnormalised clustered vectors (float64): a centre per cluster plus isotropic noise."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    return centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, d))


def test_unit_rows_match_numpy_for_every_dtype_and_shards(tmp_path):
    x = clustered(300, 12) * 7.0
    for dtype in (np.float16, np.float32, np.float64):
        np.save(tmp_path / f"one_{np.dtype(dtype).name}.npy", x.astype(dtype))
        got = unit_rows(open_vectors(tmp_path / f"one_{np.dtype(dtype).name}.npy"))
        ref = x.astype(dtype).astype(np.float64)
        ref /= np.linalg.norm(ref, axis=1, keepdims=True)
        assert got.dtype == np.float32 and got.shape == (300, 12)
        np.testing.assert_allclose(got, ref, atol=2e-7)
    shards = tmp_path / "shards"
    shards.mkdir()
    # name order, not creation order: b written first
    np.save(shards / "part-b.npy", x[100:].astype(np.float32))
    np.save(shards / "part-a.npy", x[:100].astype(np.float64))
    (shards / "notes.txt").write_text("ignored")
    src = open_vectors(shards)
    assert [f.name for f in src.files] == ["part-a.npy", "part-b.npy"] and src.count == 300
    np.testing.assert_allclose(unit_rows(src), x / np.linalg.norm(x, axis=1, keepdims=True), atol=1e-6)


def test_bad_rows_and_files_are_refused_naming_the_row(tmp_path):
    x = clustered(50, 8).astype(np.float32)
    x[17] = 0.0
    np.save(tmp_path / "zero.npy", x)
    with pytest.raises(ValueError, match=r"row 17 is a zero vector"):
        unit_rows(open_vectors(tmp_path / "zero.npy"))
    x = clustered(50, 8).astype(np.float32)
    x[33, 2] = np.nan
    shards = tmp_path / "s"
    shards.mkdir()
    np.save(shards / "0.npy", x[:30])
    np.save(shards / "1.npy", x[30:])
    with pytest.raises(ValueError, match=r"row 33 \(row 3 of 1.npy\) contains NaN or inf"):
        unit_rows(open_vectors(shards))
    np.save(tmp_path / "ints.npy", np.ones((4, 3), np.int32))
    with pytest.raises(ValueError, match="int32"):
        open_vectors(tmp_path / "ints.npy")
    np.save(tmp_path / "flat.npy", np.ones(5, np.float32))
    with pytest.raises(ValueError, match="shape"):
        open_vectors(tmp_path / "flat.npy")
    with pytest.raises(FileNotFoundError):
        open_vectors(tmp_path / "missing.npy")


def test_ids_file_count_and_duplicates(tmp_path):
    p = tmp_path / "ids.txt"
    p.write_text("a\nb b\nc\n")
    assert read_ids(p, 3) == ["a", "b b", "c"]
    with pytest.raises(ValueError, match="3 ids for 4 vectors"):
        read_ids(p, 4)
    p.write_text("a\nb\na\n")
    with pytest.raises(ValueError, match=r"'a' appears on lines 1 and 3"):
        read_ids(p, 3)


def _build(root, *argv) -> int:
    return index_main(["build", "--root", str(root), "--no-progress", *argv])


def test_cli_build_from_vectors_serves_exact_neighbours_and_records_the_source(tmp_path, capsys):
    x = clustered(3000, 16, seed=3)
    np.save(tmp_path / "v.npy", x.astype(np.float64))
    ids = [f"item-{i:05d}" for i in range(3000)]
    (tmp_path / "ids.txt").write_text("\n".join(ids) + "\n")
    with open(tmp_path / "meta.jsonl", "w") as fh:
        for i in range(0, 3000, 2):
            fh.write(json.dumps({"id": ids[i], "even": True, "group": i % 7}) + "\n")
    root = tmp_path / "store"
    assert (
        _build(
            root,
            "--embeddings",
            str(tmp_path / "v.npy"),
            "--ids",
            str(tmp_path / "ids.txt"),
            "--metadata",
            str(tmp_path / "meta.jsonl"),
        )
        == 0
    )
    store = IndexStore(root)
    v = store.load()
    m = v.manifest
    assert m.checkpoint is None and m.encoder is None and m.kind == "flat"
    assert m.source["embeddings"] == str((tmp_path / "v.npy").resolve())
    from index.manifest import file_sha256

    assert m.source["sha256"] == file_sha256(tmp_path / "v.npy") and m.source["dtype"] == ["float64"]
    assert v.ids == ids
    z = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_allclose(v.embeddings, z, atol=1e-6)
    q = z[:20] + 0.1
    _, rows = v.search(q.astype(np.float32), 10)
    exact = np.argsort(-(q @ z.T), axis=1)[:, :10]
    assert faiss_index.recall_at_k(rows, exact, 10) == 1.0
    gate = m.quality_gate.to_json()
    assert gate["passed"] and gate["checks"]["score"] is None
    assert gate["checks"]["recall"]["served"] == 1.0 and "held-out" in gate["checks"]["recall"]["measured_on"]
    meta = json.loads((v.path / "item_metadata.json").read_text())
    assert "even" in json.dumps(meta) and "group" in json.dumps(meta)
    assert index_main(["verify", "--root", str(root)]) == 0
    assert "no encoder model" in capsys.readouterr().out


def test_cli_user_mistakes_are_one_line(tmp_path, capsys):
    x = clustered(200, 8)
    x[5] = 0
    np.save(tmp_path / "bad.npy", x)
    np.save(tmp_path / "good.npy", clustered(200, 8))
    (tmp_path / "ids.txt").write_text("a\nb\n")
    root = tmp_path / "store"
    cases = [
        (["--embeddings", str(tmp_path / "bad.npy")], "row 5 is a zero vector"),
        (["--embeddings", str(tmp_path / "good.npy"), "--ids", str(tmp_path / "ids.txt")], "2 ids for 200"),
        (["--embeddings", str(tmp_path / "good.npy"), "--dataset", "synthetic"], "drop --dataset"),
        (["--embeddings", str(tmp_path / "nope.npy")], "embeddings not found"),
        ([], "--embeddings FILE"),
    ]
    for argv, message in cases:
        assert _build(root, *argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert _build(root, "--embeddings", str(tmp_path / "good.npy")) == 0
    capsys.readouterr()
    assert (
        index_main(
            ["add", "--root", str(root), "--embeddings", str(tmp_path / "good.npy"), "--dataset", "synthetic"]
        )
        == 2
    )
    assert "drop --dataset" in capsys.readouterr().err
    assert (
        index_main(
            [
                "add",
                "--root",
                str(root),
                "--embeddings",
                str(tmp_path / "good.npy"),
                "--ids",
                str(tmp_path / "ids.txt"),
            ]
        )
        == 2
    )
    assert "2 ids for 200" in capsys.readouterr().err
    assert (
        index_main(["add", "--root", str(root), "--dataset", "synthetic", "--size", "4", "--no-progress"])
        == 2
    )
    assert "has no encoder" in capsys.readouterr().err
    assert index_main(["export", "--root", str(root), "--out", str(tmp_path / "x.tar")]) == 2
    assert "built from vectors" in capsys.readouterr().err


def test_held_out_recall_matches_brute_force_and_excludes_tuning_rows(tmp_path):
    """The gate's figure, recomputed here with numpy: served = the index's top 10*r candidates re-scored
    exactly; reference = exact top 10; own row dropped from both; queries outside the tuning sample."""
    x = clustered(4000, 16, seed=5)
    np.save(tmp_path / "v.npy", x)
    root = tmp_path / "store"
    assert (
        _build(root, "--embeddings", str(tmp_path / "v.npy"), "--kind", "ivf-pq", "--param", "m=4", "--force")
        == 0
    )
    v = IndexStore(root).load()
    got = held_out_recall(v, n_queries=300)
    assert got["n_queries"] == 300
    # the rule of gate.held_out_rows: the first 300 of a seeded draw of 1300 distinct rows not tuned on
    tuned = set(faiss_index.tuning_rows(4000).tolist())
    draw = np.random.default_rng(1).choice(4000, size=1300, replace=False)
    rows = np.sort([r for r in draw if r not in tuned][:300])
    assert len(rows) == 300 and not set(rows.tolist()) & tuned
    z = np.asarray(v.embeddings, np.float64)
    r = got["rerank"]
    hits = 0
    for row in rows:
        _, cand = v.index.search(z[row : row + 1].astype(np.float32), 11 * r)
        cand = cand[0][cand[0] >= 0]
        served = cand[np.argsort(-(z[cand] @ z[row]), kind="stable")]
        served = [c for c in served if c != row][:10]
        exact = [c for c in np.argsort(-(z @ z[row]), kind="stable") if c != row][:10]
        hits += len(set(served) & set(exact))
    assert got["recall"] == pytest.approx(hits / (10 * len(rows)), abs=1e-9)
    recorded = v.manifest.quality_gate.recall
    assert recorded.measured_on.startswith("1000 held-out stored rows")


def test_cli_add_vectors_extends_the_version(tmp_path, capsys):
    """`index add --embeddings` onto a version built from vectors: rows appended (normalised), ids continue
    the row numbers or come from --ids, metadata merged, served search still exact; clashing ids refused."""
    x = clustered(1500, 16, seed=8)
    np.save(tmp_path / "a.npy", x[:1000])
    np.save(tmp_path / "b.npy", x[1000:1300].astype(np.float16))
    np.save(tmp_path / "c.npy", x[1300:])
    root = tmp_path / "store"
    assert _build(root, "--embeddings", str(tmp_path / "a.npy"), "--kind", "ivf-flat") == 0
    store = IndexStore(root)
    v1 = store.current_version()
    assert (
        index_main(["add", "--root", str(root), "--no-progress", "--embeddings", str(tmp_path / "b.npy")])
        == 0
    )
    v2 = store.load()
    assert v2.manifest.parent == v1 and v2.ids == [str(i) for i in range(1300)]
    (tmp_path / "ids.txt").write_text("".join(f"late-{i}\n" for i in range(200)))
    (tmp_path / "meta.jsonl").write_text(json.dumps({"id": "late-3", "tag": "x"}) + "\n")
    assert (
        index_main(
            [
                "add",
                "--root",
                str(root),
                "--no-progress",
                "--embeddings",
                str(tmp_path / "c.npy"),
                "--ids",
                str(tmp_path / "ids.txt"),
                "--metadata",
                str(tmp_path / "meta.jsonl"),
            ]
        )
        == 0
    )
    v3 = store.load()
    assert v3.ids[1300:] == [f"late-{i}" for i in range(200)] and len(v3.manifest.added_sources) == 2
    ref = np.concatenate([x[:1000], x[1000:1300].astype(np.float16).astype(np.float64), x[1300:]])
    z = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    np.testing.assert_allclose(v3.embeddings, z, atol=1e-6)
    assert v3.manifest.quality_gate.passed and v3.manifest.kind == "ivf-flat"
    q = z[[5, 1100, 1450]]
    _, rows = faiss_index.search_reranked(v3.index, v3.embeddings, q, 10, 1)
    exact = np.argsort(-(q @ z.T), axis=1, kind="stable")[:, :10]
    assert faiss_index.recall_at_k(rows, exact, 10) >= 0.9
    assert "late-3" in (v3.path / "item_metadata.json").read_text()
    capsys.readouterr()
    assert (
        index_main(
            [
                "add",
                "--root",
                str(root),
                "--no-progress",
                "--embeddings",
                str(tmp_path / "c.npy"),
                "--ids",
                str(tmp_path / "ids.txt"),
            ]
        )
        == 2
    )
    assert "'late-0' is already in" in capsys.readouterr().err


def test_cli_delete_from_a_vector_version(tmp_path):
    """`index delete` keeps a version built from vectors one (no model, its source record carried over)."""
    x = clustered(800, 8, seed=9)
    np.save(tmp_path / "v.npy", x)
    root = tmp_path / "store"
    assert _build(root, "--embeddings", str(tmp_path / "v.npy")) == 0
    (tmp_path / "del.txt").write_text("3\n700\n")
    assert index_main(["delete", "--root", str(root), "--ids-file", str(tmp_path / "del.txt")]) == 0
    v = IndexStore(root).load()
    keep = [i for i in range(800) if i not in (3, 700)]
    assert v.ids == [str(i) for i in keep] and v.manifest.checkpoint is None and v.manifest.encoder is None
    assert v.manifest.source["count"] == 800
    z = x[keep] / np.linalg.norm(x[keep], axis=1, keepdims=True)
    np.testing.assert_allclose(v.embeddings, z, atol=1e-6)
