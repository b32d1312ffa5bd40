"""index export / import (index/transfer.py): a version and its model in one checked archive."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile

import numpy as np
import pytest

from index.build import BuildOptions, QualityGateError, build_index
from index.cli import main
from index.manifest import file_sha256
from index.models import load_version_encoder, model_relpath
from index.options import CommitOptions
from index.store import LIST_STATS_FILE, IndexStore
from index.transfer import EXPORT_INDEX, export_version, import_version
from training.datasets import create_dataset
from training.encoder import embed


@pytest.fixture(scope="module")
def items():
    return create_dataset("synthetic", split="train", size=40, seed=0)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_checkpoint, items):
    """{root, version, archive}: one built version exported to a gzip archive (module-shared, read-only)."""
    base = tmp_path_factory.mktemp("export")
    root = base / "index"
    version = build_index(tiny_checkpoint, items, root, BuildOptions(progress=False))
    return {"root": root, "version": version, "archive": export_version(root, base / "v.tar.gz")}


def _tree(root):
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".lock" not in p.name}


def test_round_trip_gives_the_same_version_and_model(tmp_path, exported, items):
    src = IndexStore(exported["root"])
    version, existed = import_version(tmp_path / "new", exported["archive"])
    dst = IndexStore(tmp_path / "new")
    assert (version, existed) == (exported["version"], False) and dst.current_version() == version
    a, b = src.load(version), dst.load(version)
    assert LIST_STATS_FILE in a.manifest.files  # the normaliser's statistics travel with the version
    for name in a.manifest.files:
        assert file_sha256(a.path / name) == file_sha256(b.path / name)
    sa, sb = a.list_stats(), b.list_stats()
    for field in ("offsets", "order", "where", "means", "radius", "lam"):
        np.testing.assert_array_equal(getattr(sa, field), getattr(sb, field))
    assert a.manifest == b.manifest
    sha = a.manifest.checkpoint.sha256
    assert dst.models.shas() == [sha] and file_sha256(dst.root / model_relpath(sha)) == sha
    x = items.tensors(np.arange(6))
    enc_a, _, _ = load_version_encoder(a)
    enc_b, _, _ = load_version_encoder(b)
    np.testing.assert_array_equal(embed(enc_a, x, progress=False), embed(enc_b, x, progress=False))
    assert import_version(tmp_path / "new", exported["archive"]) == (version, True)  # idempotent
    assert not any((tmp_path / "new" / "staging").iterdir())  # nothing left behind


def test_import_goes_through_the_quality_gate(tmp_path, exported, other_checkpoint, items):
    root = tmp_path / "serving"
    serving = build_index(other_checkpoint, items, root, BuildOptions(progress=False))
    store = IndexStore(root)

    def worse(candidate, current):
        return {"metric": "score", "candidate": 0.1, "serving": 0.9}

    with pytest.raises(QualityGateError):
        import_version(root, exported["archive"], commit=CommitOptions(evaluator=worse))
    assert store.current_version() == serving and exported["version"] in store.versions()
    assert store.manifest(exported["version"]).quality_gate.passed is False

    root2 = tmp_path / "serving2"
    build_index(other_checkpoint, items, root2, BuildOptions(progress=False))

    def unavailable(candidate, current):
        raise FileNotFoundError("image folder /elsewhere not found")

    with pytest.raises(
        QualityGateError, match="cannot score this version here: .*elsewhere.* did not activate it"
    ):
        import_version(root2, exported["archive"], commit=CommitOptions(evaluator=unavailable))
    store2 = IndexStore(root2)
    assert store2.current_version() != exported["version"]
    assert store2.manifest(exported["version"]).quality_gate.passed is False  # 'activate' needs --force
    assert main(["activate", "--root", str(root2), exported["version"]]) == 1  # a gate refusal: exit 1
    assert main(["activate", "--root", str(root2), exported["version"], "--force"]) == 0

    root3 = tmp_path / "serving3"
    build_index(other_checkpoint, items, root3, BuildOptions(progress=False))
    import_version(root3, exported["archive"], commit=CommitOptions(evaluator=unavailable, force=True))
    assert IndexStore(root3).current_version() == exported["version"]


def test_a_rerun_finishes_the_activation_a_killed_import_did_not_reach(
    tmp_path, exported, other_checkpoint, items, capsys
):
    """A kill between an import's commit and its activation leaves the version committed with its gate
    result and `current` unmoved: the state activate=False writes (the same steps, minus the last).
    Rerunning the import finishes the activation; the recorded gate still decides."""
    root = tmp_path / "serving"
    serving = build_index(other_checkpoint, items, root, BuildOptions(progress=False))
    store = IndexStore(root)
    version = exported["version"]
    assert import_version(root, exported["archive"], commit=CommitOptions(activate=False)) == (version, False)
    assert store.current_version() == serving and version in store.versions()
    capsys.readouterr()
    assert main(["import", str(exported["archive"]), "--root", str(root), "--no-activate"]) == 0
    assert (
        "(already present), not activated" in capsys.readouterr().out and store.current_version() == serving
    )
    assert main(["import", str(exported["archive"]), "--root", str(root)]) == 0
    assert f"imported {version} into {root} (already present), activated" in capsys.readouterr().out
    assert store.current_version() == version
    entry = store.last_activation(version)
    assert entry["path"] == "index import" and entry["previous"] == serving and not entry["forced"]
    assert store.rollback() == serving  # the activation stack knows the import came after
    assert not any((root / "staging").iterdir())

    # a first run whose gate refused the version: the rerun refuses it too (exit 1), `current` stays
    root2 = tmp_path / "serving2"
    serving2 = build_index(other_checkpoint, items, root2, BuildOptions(progress=False))

    def worse(candidate, current):
        return {"metric": "score", "candidate": 0.1, "serving": 0.9}

    import_version(root2, exported["archive"], commit=CommitOptions(evaluator=worse, activate=False))
    with pytest.raises(QualityGateError):
        import_version(root2, exported["archive"], commit=CommitOptions(evaluator=worse))
    assert main(["import", str(exported["archive"]), "--root", str(root2)]) == 1
    assert IndexStore(root2).current_version() == serving2
    assert main(["import", str(exported["archive"]), "--root", str(root2), "--force"]) == 0
    assert IndexStore(root2).current_version() == version


def _members(archive) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(archive, "r:*") as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]


def _write(path, members) -> None:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            info = tarfile.TarInfo(info) if isinstance(info, str) else info
            if data is not None:
                info.size = len(data)
            tar.addfile(info, None if data is None else io.BytesIO(data))


def _link(name, target, kind):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _tampered(members, version, how):
    """The exported members changed in one malicious or damaging way."""
    out = list(members)
    ids = f"versions/{version}/ids.json"
    if how == "absolute":
        out.append(("/tmp/softsearch-evil.txt", b"x"))
    elif how == "dotdot":
        out.append((f"versions/{version}/../../evil.txt", b"x"))
    elif how == "symlink":
        out = [(m, d) for m, d in out if m.name != ids] + [(_link(ids, "/etc/passwd", tarfile.SYMTYPE), None)]
    elif how == "hardlink":
        out = [(m, d) for m, d in out if m.name != ids] + [(_link(ids, "/etc/passwd", tarfile.LNKTYPE), None)]
    elif how == "checksum":
        out = [(m, d if m.name != ids else d.replace(b'"', b"'", 1)) for m, d in out]
    elif how == "unlisted":
        out.append((f"versions/{version}/extra.bin", b"x"))
    elif how == "elsewhere":
        out.append(("models/../current", b"evil"))
    elif how == "layout":
        out.append(("history.json", b"{}"))
    elif how == "missing":
        out = [(m, d) for m, d in out if m.name != ids]
    elif how == "index":
        out = [(m, d if m.name != EXPORT_INDEX else b"{not json") for m, d in out]
    return out


@pytest.mark.parametrize(
    "how, message",
    [
        ("absolute", "absolute path"),
        ("dotdot", "escapes the store"),
        ("symlink", "is a link"),
        ("hardlink", "is a link"),
        ("checksum", "fails its checksum"),
        ("unlisted", "unlisted"),
        ("elsewhere", "escapes the store"),
        ("layout", "outside the export layout"),
        ("missing", "does not match its export index"),
        ("index", "not valid JSON"),
    ],
)
def test_import_refuses_bad_archives_and_writes_nothing(tmp_path, exported, how, message):
    bad = tmp_path / "bad.tar"
    _write(bad, _tampered(_members(exported["archive"]), exported["version"], how))
    root = tmp_path / "store"
    with pytest.raises(ValueError, match=message):
        import_version(root, bad)
    store = IndexStore(root)
    assert store.versions() == [] and store.current_version() is None and store.models.shas() == []
    assert _tree(root) == set()  # staging cleaned, nothing written anywhere
    assert not (tmp_path / "evil.txt").exists()


def test_truncated_archive_is_refused(tmp_path, exported):
    data = exported["archive"].read_bytes()
    for cut in (len(data) // 2, len(data) - 100):
        bad = tmp_path / f"cut{cut}.tar.gz"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="damaged or truncated|not a tar archive"):
            import_version(tmp_path / f"store{cut}", bad)
        assert IndexStore(tmp_path / f"store{cut}").versions() == []


def test_cli_export_import_and_user_errors(tmp_path, exported, capsys):
    out = tmp_path / "cli.tar"
    assert main(["export", "--root", str(exported["root"]), "--out", str(out)]) == 0
    assert f"exported {exported['version']}" in capsys.readouterr().out
    assert main(["import", "--root", str(tmp_path / "b"), str(out)]) == 0
    assert (
        "activated" in capsys.readouterr().out
        and IndexStore(tmp_path / "b").current_version() == exported["version"]
    )
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all")
    for argv, text in (
        (["import", "--root", str(tmp_path / "c"), str(tmp_path / "junk.tar")], "not a tar archive"),
        (["import", "--root", str(tmp_path / "c"), str(tmp_path / "nope.tar")], "archive not found"),
        (["export", "--root", str(tmp_path / "empty"), "--out", str(out)], "empty does not exist"),
        (["export", "--root", str(tmp_path), "--out", str(out)], "no current index version"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert text in err and err.count("\n") == 1 and "Traceback" not in err


def test_copied_store_needs_nothing_outside_it(tmp_path, exported):
    copy = tmp_path / "copy"
    shutil.copytree(exported["root"], copy, symlinks=True)
    index = IndexStore(copy).manifest(exported["version"]).to_json()
    assert str(exported["root"]) not in json.dumps({k: v for k, v in index.items() if k != "checkpoint"})
    load_version_encoder(IndexStore(copy).load())


def test_concurrent_imports_of_one_archive_serialise(tmp_path, exported):
    """Two imports of one archive at once (threads: each takes the store's flock on its own file
    descriptor, as two processes do): both succeed, one commits the version, and it is current."""
    import threading

    for round_ in range(4):
        root = tmp_path / f"r{round_}"
        start = threading.Barrier(2)
        results, errors = [], []

        def run():
            start.wait()
            try:
                results.append(import_version(root, exported["archive"]))
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], errors
        assert sorted(existed for _, existed in results) == [False, True]
        store = IndexStore(root)
        assert store.versions() == [exported["version"]] and store.current_version() == exported["version"]
        store.load(exported["version"], verify=True, gpu=False)
        assert not any((root / "staging").iterdir())


# ----------------------------------------------------------------------------- sizes while streaming


def _tar_block(info: tarfile.TarInfo, data: bytes | None = None) -> bytes:
    """One member as tar bytes: its header, then `data` padded to 512-byte blocks (None: header only)."""
    head = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
    if data is None:
        return head
    return head + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def _restated(members, change) -> list[tuple[tarfile.TarInfo, bytes]]:
    """The exported members with the export index's "files" passed through `change(files)`."""
    out = []
    for info, data in members:
        if info.name == EXPORT_INDEX:
            index = json.loads(data)
            change(index["files"])
            data = json.dumps(index).encode()
        out.append((info, data))
    return out


def _compressed_zeros(size: int) -> bytes:
    """`size` zero bytes as one gzip member; mtime=0 so the bytes are the same on every call (gzip
    stamps the current second into its header otherwise, and a test that looks for the block would flake)."""
    return gzip.compress(bytes(size), compresslevel=9, mtime=0)


def _gzip_bomb(path, members, bomb: str, size: int):
    """A gzip tar whose member `bomb` is `size` zero bytes, written as concatenated gzip members (one
    16 MiB block of zeros compressed once, repeated), so ~2 MB on disk holds 2 GiB -> compressed bytes."""
    block = 16 << 20
    assert size % block == 0
    zeros = _compressed_zeros(block)
    with open(path, "wb") as out:
        for info, data in members:
            if info.name == bomb:
                info = tarfile.TarInfo(bomb)
                info.size = size
                out.write(gzip.compress(_tar_block(info)))
                for _ in range(size // block):
                    out.write(zeros)
            else:
                info.size = len(data)
                out.write(gzip.compress(_tar_block(info, data)))
        out.write(gzip.compress(bytes(2 * tarfile.BLOCKSIZE)))  # end of archive
    return path.stat().st_size


def test_member_larger_than_stated_is_refused_at_its_header(tmp_path, exported):
    ids = f"versions/{exported['version']}/ids.json"

    def smaller(files):
        files[ids]["bytes"] -= 10

    bad = tmp_path / "bad.tar"
    _write(bad, _restated(_members(exported["archive"]), smaller))
    root = tmp_path / "store"
    with pytest.raises(
        ValueError, match=f"{ids} has .* bytes, the export index says .*refused before writing"
    ):
        import_version(root, bad)
    assert _tree(root) == set()


def test_gzip_bomb_stated_small_writes_nothing(tmp_path, exported):
    """2 GiB of zeros in a ~2 MB gzip, its export index stating the real (small) ids.json: refused at
    the member's header, before its data is decompressed or anything is written."""
    version = exported["version"]
    ids = f"versions/{version}/ids.json"
    bad = tmp_path / "bomb.tar.gz"
    compressed = _gzip_bomb(bad, _members(exported["archive"]), ids, 2 << 30)
    assert compressed < 4 << 20
    root = tmp_path / "store"
    with pytest.raises(ValueError, match=f"{ids} has {2 << 30} bytes, the export index says"):
        import_version(root, bad)
    assert _tree(root) == set()
    # the bomb's data is never read: cut right after its first compressed block, the refusal is the same
    # (an import that decompressed past the member would report a truncated archive instead)
    cut = tmp_path / "cut.tar.gz"
    data = bad.read_bytes()
    cut.write_bytes(data[: data.index(_compressed_zeros(16 << 20)) + 100])
    with pytest.raises(ValueError, match=f"{ids} has {2 << 30} bytes, the export index says"):
        import_version(root, cut)
    assert _tree(root) == set()


def test_extraction_stops_at_the_first_byte_past_the_stated_size(tmp_path, exported):
    """The streaming guard itself: a member whose data runs past what the export index states is cut
    off at that size, not written out (here a 2 GiB bomb stated as 1 MiB, past the header check)."""
    from index.transfer import extract_member

    ids = f"versions/{exported['version']}/ids.json"
    bomb = tmp_path / "bomb.tar.gz"
    _gzip_bomb(bomb, _members(exported["archive"]), ids, 2 << 30)
    target = tmp_path / "out" / "ids.json"
    with tarfile.open(bomb, "r:gz") as tar:
        member = next(m for m in tar if m.name == ids)
        with pytest.raises(ValueError, match="larger than the 1048576 bytes its export index states"):
            extract_member(tar, member, {"bytes": 1 << 20, "sha256": "0" * 64}, target)
    assert target.stat().st_size <= 1 << 20


def test_honestly_stated_bomb_is_held_to_the_total_limit_and_the_free_space(tmp_path, exported, capsys):
    """A bomb whose export index states its true size: refused by the total limit (exit 2) or, above the
    free space of the store's filesystem, as a full disk (exit 4) -- in both cases before any byte."""
    version = exported["version"]
    ids = f"versions/{version}/ids.json"
    size = 2 << 30
    digest = hashlib.sha256()
    for _ in range(size // (16 << 20)):
        digest.update(bytes(16 << 20))
    members = _restated(
        _members(exported["archive"]), lambda files: files[ids].update(bytes=size, sha256=digest.hexdigest())
    )
    bad = tmp_path / "honest.tar.gz"
    _gzip_bomb(bad, members, ids, size)
    root = tmp_path / "store"
    with pytest.raises(ValueError, match="over the import limit of 1073741824"):
        import_version(root, bad, max_bytes=1 << 30)
    assert _tree(root) == set()
    capsys.readouterr()
    assert main(["import", "--root", str(root), str(bad), "--max-bytes", "1G"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the archive states") and "--max-bytes" in err and err.count("\n") == 1
    assert _tree(root) == set()

    # stated beyond the free space (1 PiB in the export index; the member itself is never reached)
    huge = tmp_path / "huge.tar"
    _write(huge, _restated(_members(exported["archive"]), lambda files: files[ids].update(bytes=1 << 50)))
    assert main(["import", "--root", str(root), str(huge), "--max-bytes", "2048T", "--max-ratio", "0"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("error: no space left on device writing ") and "staging/import-" in err
    assert "needed" in err and err.count("\n") == 1
    assert _tree(root) == set()


def test_default_import_limit_is_the_documented_one():
    from index.cli import build_parser, parse_bytes
    from index.transfer import DEFAULT_MAX_IMPORT_BYTES

    args = build_parser().parse_args(["import", "a.tar"])
    assert parse_bytes(args.max_bytes) == DEFAULT_MAX_IMPORT_BYTES == 64 * 2**30


# ----------------------------------------------------------------------------- compression ratio


def _padded(exported, path, pad: int):
    """A consistent gzip export whose version carries one more file, `pad` zero bytes: every size and
    checksum honest (the export index, the version manifest), only the compression ratio is extreme."""
    version = exported["version"]
    manifest_name = f"versions/{version}/manifest.json"
    padding = bytes(pad)
    entry = {"sha256": hashlib.sha256(padding).hexdigest(), "bytes": pad}
    members = []
    for info, data in _members(exported["archive"]):
        if info.name == manifest_name:
            manifest = json.loads(data)
            manifest["files"]["padding.bin"] = entry
            data = (json.dumps(manifest, indent=2) + "\n").encode()
        members.append((info.name, data))
    members.append((f"versions/{version}/padding.bin", padding))
    index = json.loads(dict(members)[EXPORT_INDEX])
    index["files"] = {
        name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        for name, data in members
        if name != EXPORT_INDEX
    }
    members[0] = (EXPORT_INDEX, json.dumps(index).encode())
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sum(f["bytes"] for f in index["files"].values())


def test_compression_ratio_is_limited_before_anything_is_written(tmp_path, exported, capsys):
    """An honest archive (every size and checksum true) that inflates 32 MiB of zeros from ~0.1 MB is refused
    by the default ratio limit with one line, before the store is even created; --max-ratio 0 (no limit)
    imports the very same archive, so the ratio is what refused it."""
    from index.transfer import DEFAULT_MAX_RATIO

    bomb = tmp_path / "padded.tar.gz"
    stated = _padded(exported, bomb, 32 << 20)
    size = bomb.stat().st_size
    assert stated / size > 5 * DEFAULT_MAX_RATIO  # far past the limit (~300:1)
    root = tmp_path / "new" / "store"
    capsys.readouterr()
    assert main(["import", "--root", str(root), str(bomb)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: the archive states {stated} bytes (32.1 MiB) from {size} ({size / 1024:.1f} KiB) on disk, "
        f"a compression ratio of {stated / size:.0f}:1, over the import limit of 20:1; raise it with "
        "--max-ratio if it is expected\n"
    )
    assert not (tmp_path / "new").exists()  # nothing left behind, not even a directory
    # a limit just above the archive's ratio lets it through; just below refuses it
    with pytest.raises(ValueError, match="compression ratio"):
        import_version(root, bomb, max_ratio=stated / size * 0.99)
    assert import_version(root, bomb, max_ratio=stated / size * 1.01) == (exported["version"], False)
    assert IndexStore(root).load(exported["version"]).manifest.files["padding.bin"]["bytes"] == 32 << 20
    root0 = tmp_path / "store0"
    assert main(["import", "--root", str(root0), str(bomb), "--max-ratio", "0"]) == 0
    assert IndexStore(root0).current_version() == exported["version"]
    assert main(["import", "--root", str(root0), str(bomb), "--max-ratio", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
    # real exports are far under the limit: gzip and plain tar
    for archive in (exported["archive"], export_version(exported["root"], tmp_path / "plain.tar")):
        with tarfile.open(archive) as tar:
            index = json.load(tar.extractfile(tar.next()))
        assert sum(f["bytes"] for f in index["files"].values()) / archive.stat().st_size < 2


def test_default_ratio_limit_is_the_documented_one():
    from index.cli import build_parser
    from index.transfer import DEFAULT_MAX_RATIO

    args = build_parser().parse_args(["import", "a.tar"])
    assert args.max_ratio == DEFAULT_MAX_RATIO == 20
    help_text = build_parser()._subparsers._group_actions[0].choices["import"].format_help()
    assert "--max-ratio" in help_text and "default 20" in help_text
