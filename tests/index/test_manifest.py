"""index/manifest.py's Manifest: today's layout round-trips byte for byte, every older layout migrates,
the record is frozen, and keys a newer softsearch wrote survive a rewrite."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from index_refs import unit_vectors

from index.build import BuildOptions, add_items, build_index, write_version
from index.gate import activation_checks, score_check
from index.manifest import (
    MANIFEST_NAME,
    GateRecord,
    IndexCorruptError,
    Manifest,
    create_manifest,
    json_default,
    read_manifest,
    read_manifest_json,
    update_manifest,
    write_manifest,
)
from index.options import EmbedOptions
from index.store import IndexStore

SPEC = {"name": "synthetic", "size": 64, "image_size": 32, "seed": 0, "split": "train"}


def _serialised(manifest: Manifest) -> bytes:
    """What write_manifest stores for `manifest` (the same dumps call)."""
    return (json.dumps(manifest.to_json(), indent=2, sort_keys=False, default=json_default) + "\n").encode()


def _today(**fields) -> dict:
    """A manifest in today's layout, as index.build writes it (required fields, then the build's own)."""
    data = {
        "format": "softsearch-index",
        "format_version": 1,
        "version": "20260101T000000000Z-abcdef12",
        "created": "2026-01-01T00:00:00+00:00",
        "count": 64,
        "dim": 16,
        "metric": "inner_product",
        "normalised": True,
        "kind": "flat",
        "params": {},
        "faiss_version": "1.8.0",
        "files": {"index.faiss": {"sha256": "0" * 64, "bytes": 10}},
        "timings": {"embed_s": 0.5, "build_s": 0.01},
        "checkpoint": {
            "sha256": "a" * 64,
            "model": f"models/{'a' * 64}.safetensors",
            "path": "/r/ck.safetensors",
            "step": 7,
        },
        "encoder": {"embed_dim": 16, "image_size": 32},
        "dataset": {"spec": SPEC, "fingerprint": "f" * 64},
        "sources": [{"spec": SPEC, "fingerprint": "f" * 64, "count": 64, "skipped": 0, "source": 0}],
        "lineage": {"objective": "infonce"},
        "search_temperature": 0.07,
        "search_temperature_source": "training: schedule_options.temperature",
        "skipped": [],
        "skipped_count": 0,
        "world_size": 1,
        "parent": None,
        "recall": {"k": 10, "recall": 1.0, "exact": True, "target": 0.95},
        "quality_gate": {
            "passed": True,
            "forced": False,
            "checks": {"score": None, "recall": {"served": 1.0, "target": 0.95, "passed": True}},
        },
    }
    data.update(fields)
    return data


# ----------------------------------------------------------------------------- round trip
def test_a_built_manifest_round_trips_byte_for_byte(
    tmp_path, tiny_checkpoint, tiny_synthetic, tiny_synthetic_test
):
    """Read and rewrite the manifests index.build and index add write: the same bytes (their sha256 in
    exported archives and the files themselves stay valid)."""
    root = tmp_path / "idx"
    v1 = build_index(tiny_checkpoint, tiny_synthetic, root, BuildOptions(progress=False))
    v2 = add_items(root, tiny_synthetic_test, embed=EmbedOptions(progress=False))
    store = IndexStore(root)
    for v in (v1, v2):
        raw = (store.path(v) / MANIFEST_NAME).read_bytes()
        manifest = read_manifest(store.path(v))
        assert _serialised(manifest) == raw
        assert manifest.to_json() == json.loads(raw)
        assert isinstance(manifest.quality_gate, GateRecord) and manifest.quality_gate.passed is True
        write_manifest(store.path(v), manifest)  # a rewrite changes no byte
        assert (store.path(v) / MANIFEST_NAME).read_bytes() == raw
    assert read_manifest(store.path(v2)).trained_on == 64 and read_manifest(store.path(v2)).parent == v1


def test_update_keeps_positions_and_appends_new_keys(tmp_path):
    """updated / update_manifest order keys as dict.update does (what the writers did before)."""
    store = IndexStore(tmp_path)
    version, staging = write_version(
        store,
        unit_vectors(40, 8, 0),
        [str(i) for i in range(40)],
        fields={"search_temperature": 0.1, "search_temperature_source": "x"},
    )
    before = read_manifest_json(staging)
    after = update_manifest(staging, search_temperature=0.2, calibration={"gap": 0.5})
    expected = dict(before)
    expected.update(search_temperature=0.2, calibration={"gap": 0.5})
    assert list(after.to_json()) == list(expected) and after.to_json() == expected
    assert read_manifest_json(staging) == expected and after.temperature == 0.2


def test_to_json_is_a_copy():
    m = Manifest.from_json(_today())
    m.to_json()["params"]["nprobe"] = 99
    assert m.params == {}


def test_create_manifest_puts_required_fields_first():
    m = create_manifest(
        version="v",
        count=3,
        dim=2,
        kind="flat",
        params={"a": 1},
        faiss_version="1",
        files={},
        timings={},
        parent=None,
    )
    assert list(m.to_json())[:12] == [
        "format",
        "format_version",
        "version",
        "created",
        "count",
        "dim",
        "metric",
        "normalised",
        "kind",
        "params",
        "faiss_version",
        "files",
    ]
    assert list(m.to_json())[12:] == ["timings", "parent"] and m.parent is None


# ----------------------------------------------------------------------------- older layouts
def test_today_layout_is_read_as_written():
    data = _today()
    m = Manifest.from_json(copy.deepcopy(data))
    assert m.to_json() == data and list(m.to_json()) == list(data)
    assert m.temperature == 0.07 and m.has_encoder and m.source_specs == [SPEC]
    assert m.checkpoint_record.to_json() == data["checkpoint"] and m.quality_gate.recall.served == 1.0


@pytest.mark.parametrize(
    "flat",
    [
        {"checkpoint": "/runs/a/ck.safetensors", "checkpoint_sha256": "b" * 64},
        {"checkpoint_path": "/runs/a/ck.safetensors", "checkpoint_sha256": "b" * 64},
    ],
)
def test_flat_encoder_reference_becomes_the_checkpoint_record(flat):
    data = _today()
    del data["checkpoint"]
    data.update(flat)
    m = Manifest.from_json(data)
    assert m.checkpoint.to_json() == {"sha256": "b" * 64, "path": "/runs/a/ck.safetensors"} and m.has_encoder
    out = m.to_json()
    assert (
        "checkpoint_path" not in out
        and "checkpoint_sha256" not in out
        and out["checkpoint"] == m.checkpoint.to_json()
    )


def test_vectors_version_names_no_encoder():
    m = Manifest.from_json(_today(checkpoint=None, encoder=None, dataset=None, sources=[]))
    assert not m.has_encoder and m.checkpoint_record.path is None and m.checkpoint_record.sha256 is None
    assert m.sources == [] and m.dataset is None and m.to_json()["checkpoint"] is None


def test_bare_dataset_spec_without_sources():
    """The oldest layout: `dataset` was the spec itself and there was no `sources`."""
    data = _today(dataset=dict(SPEC))
    del data["sources"]
    m = Manifest.from_json(data)
    assert m.dataset == {"spec": SPEC} and m.sources == [{"spec": SPEC}] and m.source_specs == [SPEC]


def test_dataset_record_without_sources():
    data = _today()
    del data["sources"]
    m = Manifest.from_json(data)
    assert m.sources == [{"spec": SPEC, "fingerprint": "f" * 64}]


@pytest.mark.parametrize(
    "stored, expected",
    [
        ({"search_temperature": {"temperature": 0.05, "gap": 0.1}}, 0.05),
        ({"search_temperature": {"tau": 0.2}}, 0.2),
        ({"search_temperature": None, "calibrated_temperature": 0.3}, 0.3),
        ({"calibrated_temperature": {"temperature": 0.4}}, 0.4),
        ({"search_temperature": {"tau": -1.0}}, None),
    ],
)
def test_older_temperature_shapes_become_a_number(stored, expected):
    data = _today()
    del data["search_temperature"]
    data.update(stored)
    m = Manifest.from_json(data)
    assert m.temperature == expected and m.search_temperature == expected
    assert "calibrated_temperature" not in m.to_json() and m.to_json()["search_temperature"] == expected


def test_a_non_positive_temperature_reads_as_none_and_is_kept():
    m = Manifest.from_json(_today(search_temperature=0))
    assert m.temperature is None and m.to_json()["search_temperature"] == 0


def test_versions_before_the_gate_and_before_add():
    data = _today()
    del data["quality_gate"], data["recall"]
    m = Manifest.from_json(data)
    assert m.quality_gate is None and m.recall is None and m.trained_on is None and m.added is None
    assert [c.passed for c in activation_checks(m)] == [None, None]


def test_gate_record_before_the_rule_with_a_comparison():
    """Records older than the activation rule held the comparison at the top level, without `checks`."""
    legacy = {
        "metric": "neg_gap",
        "candidate": -0.50,
        "serving": -0.45,
        "margin": 0.01,
        "serving_version": "v0",
        "passed": False,
        "ok": False,
    }
    m = Manifest.from_json(_today(quality_gate=legacy))
    gate = m.quality_gate
    assert gate.score.to_json() == {
        "metric": "neg_gap",
        "candidate": -0.50,
        "serving": -0.45,
        "margin": 0.01,
        "serving_version": "v0",
        "passed": False,
    }
    assert gate.extra["ok"] is False and gate.candidate == -0.50
    check = score_check(m)
    assert check.passed is False and "-0.5 < serving -0.45 - margin 0.01" in check.message
    assert check.record == gate.to_json()
    passing = Manifest.from_json(_today(quality_gate={**legacy, "candidate": -0.455}))
    assert score_check(passing).passed is True  # -0.455 >= -0.45 - 0.01


@pytest.mark.parametrize("verdict", [True, False, None])
def test_gate_record_before_the_rule_without_a_comparison_keeps_its_verdict(verdict):
    m = Manifest.from_json(_today(quality_gate={"passed": verdict, "note": "first version"}))
    assert score_check(m).passed is verdict


def test_gate_that_is_not_a_record_reads_as_none():
    assert Manifest.from_json(_today(quality_gate="pending")).quality_gate is None


def test_invalid_manifests_are_refused():
    data = _today()
    del data["files"]
    with pytest.raises(IndexCorruptError, match="lacks required fields"):
        Manifest.from_json(data, source="x/manifest.json")
    with pytest.raises(IndexCorruptError, match="format_version 2, newer"):
        Manifest.from_json(_today(format_version=2))
    with pytest.raises(IndexCorruptError, match="only normalised inner-product"):
        Manifest.from_json(_today(metric="l2"))


# ----------------------------------------------------------------------------- immutability, unknown keys
def test_frozen():
    m = Manifest.from_json(_today())
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.count = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.quality_gate.passed = False
    with pytest.raises(TypeError):
        m.extra["x"] = 1
    changed = m.updated(search_temperature=0.5)
    assert changed.temperature == 0.5 and m.temperature == 0.07
    assert (
        m.updated(quality_gate=m.quality_gate).quality_gate == m.quality_gate
    )  # a record, not only its JSON


def test_unknown_keys_of_a_newer_writer_are_preserved_in_place():
    """Keys this version does not know survive read + rewrite, at their position (a rewrite by an older
    softsearch must not drop what a newer one recorded)."""
    data = _today()
    items = list(data.items())
    items.insert(13, ("future_field", {"x": [1, 2]}))
    data = dict(items)
    data["quality_gate"]["future_gate_key"] = 3
    m = Manifest.from_json(data)
    assert m.extra == {"future_field": {"x": [1, 2]}} and m.quality_gate.extra == {"future_gate_key": 3}
    assert m.to_json() == data and list(m.to_json()) == list(data)
    assert list(m.updated(parent="p").to_json()) == list(data)
