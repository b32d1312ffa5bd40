"""training/image_cache.py: decode once, atomic under races, keyed by content and resolution."""

import json
import multiprocessing
import os
from pathlib import Path

import image_files as F
import numpy as np
import pytest
from PIL import Image

from training import image_cache
from training.image_cache import default_cache_root, file_digests, open_or_build
from training.images import DEFAULT_LIMITS, ImageLimits, load_square


def _folder(root: Path, n: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        h, w = rng.integers(20, 90, size=2)
        p = root / f"{i:03d}.png"
        F.save(p, Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
        paths.append(p)
    return paths


def _build(paths, cache_root, side=16, workers=1, limits=DEFAULT_LIMITS):
    names = [p.name for p in paths]
    digests = file_digests(paths[0].parent, names, cache_root)
    return open_or_build(
        paths, names, digests, side, limits, cache_root=cache_root, workers=workers, progress=False
    )


def test_default_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SOFTSEARCH_CACHE_DIR", str(tmp_path / "a"))
    assert default_cache_root() == tmp_path / "a"
    monkeypatch.delenv("SOFTSEARCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "softsearch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_root() == Path.home() / ".cache" / "softsearch"


def test_rows_are_the_decoded_squares_and_reopen_is_free(tmp_path):
    paths = _folder(tmp_path / "img", 5)
    F.text_png(tmp_path / "img" / "999.png")
    paths.append(tmp_path / "img" / "999.png")
    cache = _build(paths, tmp_path / "c")
    assert cache.built and cache.images.shape == (6, 16, 16, 3) and not cache.images.flags.writeable
    assert isinstance(cache.images, np.memmap)
    for i, p in enumerate(paths[:5]):
        np.testing.assert_array_equal(cache.images[i], load_square(p, 16))
    assert cache.ok.tolist() == [True] * 5 + [False]
    assert [(s["row"], s["file"], s["reason"]) for s in cache.skipped] == [(5, "999.png", "not_an_image")]
    np.testing.assert_array_equal(cache.images[5], np.full((16, 16, 3), 255, np.uint8))
    info = json.loads((cache.path / "index.json").read_text())
    assert info["count"] == 6 and info["resolution"] == 16 and info["max_pixels"] == DEFAULT_LIMITS.max_pixels
    again = _build(paths, tmp_path / "c")
    assert not again.built and again.path == cache.path
    # another resolution or limit is another cache; the same content elsewhere is the same one
    assert _build(paths, tmp_path / "c", side=8).path != cache.path
    assert _build(paths, tmp_path / "c", limits=ImageLimits(max_pixels=10_000)).path != cache.path
    assert sorted(p.name for p in (tmp_path / "c" / "images").iterdir() if p.is_dir()) == sorted(
        {
            cache.path.name,
            _build(paths, tmp_path / "c", side=8).path.name,
            _build(paths, tmp_path / "c", limits=ImageLimits(max_pixels=10_000)).path.name,
        }
    )


def test_worker_pool_equals_inline_decode(tmp_path):
    paths = _folder(tmp_path / "img", 70, seed=1)
    pooled = _build(paths, tmp_path / "pool", workers=2)
    inline = _build(paths, tmp_path / "inline", workers=1)
    assert pooled.info["workers"] == 2 and inline.info["workers"] == 1
    np.testing.assert_array_equal(np.asarray(pooled.images), np.asarray(inline.images))


def _race(args):
    paths, root = args
    cache = _build([Path(p) for p in paths], Path(root))
    return str(cache.path), cache.built, np.asarray(cache.images).tobytes()


def test_concurrent_builders_decode_once_and_agree(tmp_path):
    paths = [str(p) for p in _folder(tmp_path / "img", 40, seed=2)]
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.map(_race, [(paths, str(tmp_path / "c"))] * 3)
    assert len({r[0] for r in results}) == 1 and len({r[2] for r in results}) == 1
    assert sum(r[1] for r in results) == 1  # one process decoded, two opened its result
    leftovers = [p.name for p in (tmp_path / "c" / "images").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_stale_partial_build_is_replaced(tmp_path, monkeypatch):
    paths = _folder(tmp_path / "img", 4)
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(image_cache, "_decode_all", dying)
    with pytest.raises(KeyboardInterrupt):
        _build(paths, tmp_path / "c")
    monkeypatch.undo()
    images = tmp_path / "c" / "images"
    assert calls and not [p for p in images.iterdir() if p.is_dir()]  # nothing half-built is visible
    os.makedirs(images / "abc.tmp-1")  # as if a builder had been killed -9
    cache = _build(paths, tmp_path / "c")
    assert cache.built and cache.ok.all()
    (cache.path / "index.json").unlink()  # damaged by hand: rebuilt, not trusted
    assert _build(paths, tmp_path / "c").built


def test_digests_are_memoised_on_stat(tmp_path, monkeypatch):
    paths = _folder(tmp_path / "img", 3)
    names = [p.name for p in paths]
    first = file_digests(tmp_path / "img", names, tmp_path / "c")
    import hashlib

    assert first[0] == hashlib.sha256(paths[0].read_bytes()).hexdigest()
    hashed = []
    real = image_cache._sha256_file
    monkeypatch.setattr(image_cache, "_sha256_file", lambda p: hashed.append(p.name) or real(p))
    assert file_digests(tmp_path / "img", names, tmp_path / "c") == first and hashed == []
    F.save(paths[1], Image.new("RGB", (5, 5)))  # content (and stat) change
    second = file_digests(tmp_path / "img", names, tmp_path / "c")
    assert hashed == [paths[1].name] and second[1] != first[1] and second[0] == first[0]
    assert file_digests(tmp_path / "img", ["missing.png"], tmp_path / "c") == ["unreadable"]


@pytest.mark.slow
def test_spawned_workers_when_other_threads_run(tmp_path):
    """With another thread alive the pool spawns (no fork under threads); the result is the same."""
    import threading

    paths = _folder(tmp_path / "img", 70, seed=4)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="busy")
    t.start()
    try:
        assert image_cache._pool_context().get_start_method() == "spawn"
        spawned = _build(paths, tmp_path / "spawn", workers=2)
    finally:
        stop.set()
        t.join()
    np.testing.assert_array_equal(
        np.asarray(spawned.images), np.asarray(_build(paths, tmp_path / "one").images)
    )
