"""`index export` on one machine, `index import` on another: two stores on different paths, the training
run deleted after the export, the target store already serving a version of another model. The import
goes through the real quality gate (the `softsearch` command's evaluator), activates, serves searches
that match exact search with the exporter's encoder, and verifies."""

from __future__ import annotations

import shutil

import numpy as np

from api.cli import main
from index.build import BuildOptions, build_index
from index.models import model_relpath
from index.store import IndexStore
from index.transfer import export_version
from search.serving.searcher import Searcher
from training.checkpoint import load_checkpoint, save_checkpoint
from training.datasets import create_dataset
from training.encoder import EncoderConfig, create_encoder, embed

TINY = dict(width=32, layers=1, heads=2, embed_dim=16, patch_size=8)


def _checkpoint(run_dir, seed: int):
    """A seeded random TINY encoder saved where a training run would leave it."""
    import torch

    torch.manual_seed(seed)
    run_dir.mkdir(parents=True)
    path = run_dir / "checkpoint.safetensors"
    save_checkpoint(
        path,
        create_encoder(EncoderConfig(**TINY)),
        step=3,
        train_config={"schedule": "fixed", "schedule_options": {"temperature": 0.25}},
        lineage={"objective": "infonce"},
        metrics={},
    )
    return path


def test_export_import_between_machines_without_the_training_run(tmp_path, capsys):
    items = create_dataset("synthetic", split="train", size=40, seed=0)
    # machine A: trains (seed 1), builds, exports; then its training run is deleted
    run_a = tmp_path / "machine-a" / "runs" / "r1"
    ckpt_a = _checkpoint(run_a, seed=1)
    encoder_a, _ = load_checkpoint(ckpt_a)
    root_a = tmp_path / "machine-a" / "store"
    version = build_index(ckpt_a, items, root_a, BuildOptions(progress=False))
    archive = export_version(root_a, tmp_path / "shipped" / "v.tar.gz")
    sha_a = IndexStore(root_a).manifest(version).checkpoint.sha256
    assert IndexStore(root_a).manifest(version).checkpoint.path == str(ckpt_a)  # recorded, about to vanish
    shutil.rmtree(run_a)
    # machine B: another model (seed 0) already serving, at another path
    root_b = tmp_path / "machine-b" / "srv" / "index"
    serving = build_index(
        _checkpoint(tmp_path / "machine-b" / "run", seed=0), items, root_b, BuildOptions(progress=False)
    )
    store_b = IndexStore(root_b)
    assert store_b.current_version() == serving and not store_b.models.has(sha_a)

    capsys.readouterr()
    assert main(["index", "import", str(archive), "--root", str(root_b)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == f"imported {version} into {root_b}, activated"
    assert store_b.current_version() == version and store_b.versions() == sorted([serving, version])
    gate = store_b.manifest(version).quality_gate
    assert gate.passed and gate.error is None and gate.score.serving_version == serving  # really scored
    assert store_b.models.has(sha_a) and (root_b / model_relpath(sha_a)).is_file()
    assert not any((root_b / "staging").iterdir())

    # serves: the served neighbours of item images are the exact ones under the exporter's encoder
    z = embed(encoder_a, items.tensors(np.arange(len(items))), progress=False)
    searcher = Searcher(root_b, load=True)
    assert searcher.version == version
    queries = [0, 7, 19, 33]
    answer = searcher.search_images([items.image(i) for i in queries], k=5)
    assert answer.version == version
    ids = store_b.load(version, verify=False, gpu=False).ids
    for q, hits in zip(queries, answer):
        exact = np.argsort(-(z @ z[q]), kind="stable")[:5]
        assert [h.row for h in hits][0] == q == exact[0]
        assert sorted(h.row for h in hits) == sorted(exact.tolist())
        assert [h.id for h in hits] == [ids[h.row] for h in hits]
        np.testing.assert_allclose([h.similarity for h in hits], (z[[h.row for h in hits]] @ z[q]), atol=1e-4)

    # verifies: every file and the encoder model against their sha256
    capsys.readouterr()
    assert main(["index", "verify", "--all", "--root", str(root_b)]) == 0
    out = capsys.readouterr().out
    assert (
        f"ok {version}: 40 items" in out
        and f"encoder model {sha_a[:12]} match" in out
        and "CORRUPT" not in out
    )
    assert not run_a.exists()  # nothing brought the training run back
