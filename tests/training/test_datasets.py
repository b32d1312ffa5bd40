"""Datasets (synthetic, fashion-mnist, folder) and the shared preprocess path."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from training.datasets import (
    DATASETS,
    FASHION_MNIST_CLASSES,
    ImageDataset,
    create_dataset,
)
from training.idx import write_idx
from training.images import load_square
from training.synthetic import render, sample_latents
from training.transforms import denormalize, preprocess

FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not FASHION.is_dir(), reason="dataset-fashion-mnist not installed")


# --- preprocess ---------------------------------------------------------------------------


def test_preprocess_same_size_is_exact_affine():
    imgs = np.random.default_rng(0).integers(0, 256, size=(4, 8, 8, 3), dtype=np.uint8)
    x = preprocess(imgs, 8)
    assert x.shape == (4, 3, 8, 8) and x.dtype == torch.float32
    # x = (u / 255 - 0.5) / 0.5, channels first
    ref = (imgs.transpose(0, 3, 1, 2) / 255.0 - 0.5) / 0.5
    np.testing.assert_allclose(x.numpy(), ref, atol=1e-6)
    np.testing.assert_array_equal(denormalize(x), imgs)


def test_preprocess_grayscale_repeated_and_pil_path_matches_numpy():
    gray = np.random.default_rng(1).integers(0, 256, size=(3, 28, 28), dtype=np.uint8)
    x = preprocess(gray, 32)
    assert x.shape == (3, 3, 32, 32)
    torch.testing.assert_close(x[:, 0], x[:, 1])
    torch.testing.assert_close(x[:, 0], x[:, 2])
    pil = [Image.fromarray(g, mode="L") for g in gray]
    torch.testing.assert_close(preprocess(pil, 32), x, atol=0, rtol=0)
    torch.testing.assert_close(preprocess(pil[0], 32), x[:1], atol=0, rtol=0)
    # resize reference: bilinear upsampling of [0, 1] pixels
    ref = F.interpolate(
        torch.from_numpy(gray[:, None] / 255.0).float(), size=(32, 32), mode="bilinear", align_corners=False
    )
    torch.testing.assert_close(x[:, :1], (ref - 0.5) / 0.5, atol=1e-6, rtol=0)


def test_preprocess_mixed_sizes_and_centre_crop():
    wide = np.zeros((10, 20, 3), dtype=np.uint8)
    wide[:, 5:15] = 255  # the central 10x10 square is white, the sides black
    square = np.full((16, 16, 3), 128, dtype=np.uint8)
    x = preprocess([Image.fromarray(wide), Image.fromarray(square)], 10)
    assert x.shape == (2, 3, 10, 10)
    torch.testing.assert_close(x[0], torch.ones(3, 10, 10))  # centre crop keeps the white part
    torch.testing.assert_close(x[1], torch.full((3, 10, 10), 128 / 255 * 2 - 1), atol=1e-6, rtol=0)
    rgba = Image.fromarray(np.full((5, 5, 4), 200, dtype=np.uint8), mode="RGBA")
    assert preprocess(rgba, 5).shape == (1, 3, 5, 5)


def test_preprocess_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        preprocess(np.zeros((1, 4, 4), dtype=np.float32), 4)
    with pytest.raises(ValueError, match="shape"):
        preprocess(np.zeros((4, 4), dtype=np.uint8), 4)
    with pytest.raises(ValueError, match="image_size"):
        preprocess(np.zeros((1, 4, 4), dtype=np.uint8), 0)
    with pytest.raises(ValueError, match="PIL"):
        preprocess(["not an image"], 4)
    assert preprocess(np.zeros((0, 4, 4), dtype=np.uint8), 4).shape == (0, 3, 4, 4)


# --- registry and base contract -----------------------------------------------------------


def test_registry_and_errors(tmp_path):
    assert {"synthetic", "fashion-mnist", "folder"} <= set(DATASETS)
    with pytest.raises(ValueError, match="imagenet"):
        create_dataset("imagenet")
    with pytest.raises(ValueError, match="size"):
        create_dataset("synthetic", size=0)
    with pytest.raises(ValueError, match="valid"):
        create_dataset("synthetic", split="valid")
    with pytest.raises(ValueError, match="bad options"):
        create_dataset("synthetic", size=4, colour="red")


def _check_contract(ds: ImageDataset):
    """Checks every dataset must pass (used for each registered kind below)."""
    n = len(ds)
    assert isinstance(ds, torch.utils.data.Dataset)
    ids = ds.item_ids()
    assert len(ids) == n == len(set(ids)) and ids[0] == ds.item_id(0)
    im = ds.image(0)
    assert isinstance(im, Image.Image) and im.mode == "RGB"
    x = ds[0]
    assert x.shape == (3, ds.image_size, ds.image_size) and x.dtype == torch.float32
    torch.testing.assert_close(x, preprocess(im, ds.image_size)[0])
    batch = ds.tensors(np.array([0, n - 1]))
    torch.testing.assert_close(batch[1], ds[n - 1])
    torch.testing.assert_close(ds[-1], ds[n - 1])
    with pytest.raises(IndexError):
        ds[n]
    spec = ds.spec()
    again = create_dataset(**json.loads(json.dumps(spec)))
    assert again.item_ids() == ids and again.fingerprint() == ds.fingerprint()
    assert len(ds.fingerprint()) == 64
    gen = ds.default_generator()
    meta = ds.metadata()
    assert len(meta) == n
    lr = gen.log_ratio(meta[:2], meta)
    assert lr.shape == (2, n)
    a, b = gen.sample_pairs(ds, np.arange(min(n, 4)), np.random.default_rng(0))
    assert a.shape == b.shape == (min(n, 4), 3, ds.image_size, ds.image_size)


# --- synthetic ----------------------------------------------------------------------------


def test_synthetic_dataset(tiny_synthetic, tiny_synthetic_test):
    ds = tiny_synthetic
    _check_contract(ds)
    assert len(ds) == 64 and ds.split == "train" and ds.image_size == 32
    assert ds.item_id(17) == "synthetic/train/17"
    assert ds.labels is None and ds.class_names is None
    np.testing.assert_array_equal(ds.latents, sample_latents(64, seed=0, split="train"))
    np.testing.assert_array_equal(ds.images_batch([3, 5]), render(ds.latents[[3, 5]]))
    np.testing.assert_array_equal(np.asarray(ds.image(3)), render(ds.latents[3:4])[0])
    assert ds.default_generator().name == "latent" and ds.default_generator().kappa == 8.0
    assert ds.metadata() is ds.latents
    # splits and seeds give different content and fingerprints
    assert not np.allclose(ds.latents[:32], tiny_synthetic_test.latents)
    assert ds.fingerprint() != tiny_synthetic_test.fingerprint()
    other = create_dataset("synthetic", size=64, seed=1)
    assert other.fingerprint() != ds.fingerprint()
    assert create_dataset("synthetic", size=64, kappa=4.0).default_generator().kappa == 4.0
    assert len(create_dataset("synthetic", split="test")) == 512
    with pytest.raises(ValueError, match="render_version"):
        create_dataset("synthetic", size=2, render_version=0)


# --- fashion-mnist ------------------------------------------------------------------------


def _fake_fashion(root: Path, n_train=12, n_test=5, compress=True):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    data = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        imgs = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labs = (np.arange(n) % 10).astype(np.uint8)
        sfx = ".gz" if compress else ""
        write_idx(root / f"{prefix}-images-idx3-ubyte{sfx}", imgs, gzip=compress)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{sfx}", labs, gzip=compress)
        data[prefix] = (imgs, labs)
    return data


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_from_idx_files(tmp_path, compress):
    data = _fake_fashion(tmp_path / "fm", compress=compress)
    ds = create_dataset("fashion-mnist", split="train", root=str(tmp_path / "fm"))
    _check_contract(ds)
    assert len(ds) == 12 and ds.class_names == FASHION_MNIST_CLASSES
    np.testing.assert_array_equal(ds.images_batch(np.arange(12)), data["train"][0])
    np.testing.assert_array_equal(ds.labels, data["train"][1])
    assert ds.labels.dtype == np.int64
    assert ds.item_id(3) == "fashion-mnist/train/3"
    assert ds.default_generator().name == "label" and ds.metadata() is ds.labels
    img = np.asarray(ds.image(2))
    assert img.shape == (28, 28, 3)
    np.testing.assert_array_equal(img[..., 1], data["train"][0][2])
    test = create_dataset("fashion-mnist", split="test", root=str(tmp_path / "fm"), size=3)
    assert len(test) == 3 and test.spec()["size"] == 3
    np.testing.assert_array_equal(test.images_batch([0, 1, 2]), data["t10k"][0][:3])
    with pytest.raises(ValueError, match="size 99"):
        create_dataset("fashion-mnist", split="test", root=str(tmp_path / "fm"), size=99)


def test_fashion_missing_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        create_dataset("fashion-mnist", root=str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        create_dataset("fashion-mnist", root=str(tmp_path / "empty"))


@needs_fashion
def test_real_fashion_mnist():
    train = create_dataset("fashion-mnist", split="train")
    test = create_dataset("fashion-mnist", split="test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.images_batch([0]).shape == (1, 28, 28)
    assert len(train.class_names) == 10
    np.testing.assert_array_equal(np.bincount(train.labels, minlength=10), np.full(10, 6000))
    np.testing.assert_array_equal(np.bincount(test.labels, minlength=10), np.full(10, 1000))
    small = create_dataset("fashion-mnist", split="test", size=50)
    _check_contract(small)
    np.testing.assert_array_equal(small.labels, test.labels[:50])
    assert small.spec()["root"] == str(FASHION)


# --- folder -------------------------------------------------------------------------------


def _png(path: Path, arr: np.ndarray, mode=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, mode=mode).save(path)


@pytest.fixture
def image_folder(tmp_path):
    root = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    for cls, n in (("cat", 3), ("dog", 2)):
        for k in range(n):
            _png(root / cls / f"{k}.png", rng.integers(0, 256, size=(12 + k, 10, 3), dtype=np.uint8))
    _png(root / "dog" / "sub" / "gray.png", rng.integers(0, 256, size=(9, 9), dtype=np.uint8))
    (root / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (root / "cat" / "notes.txt").write_text("ignored: not an image extension")
    return root


def test_folder_dataset(image_folder):
    ds = create_dataset("folder", split="all", root=str(image_folder))
    ids = ds.item_ids()
    assert ids == ["cat/0.png", "cat/1.png", "cat/2.png", "dog/0.png", "dog/1.png", "dog/sub/gray.png"]
    assert [(s["id"], s["reason"]) for s in ds.skipped] == [("cat/broken.png", "not_an_image")]
    assert "broken.png" in ds.skipped[0]["error"]
    assert ds.class_names == ["cat", "dog"]
    np.testing.assert_array_equal(ds.labels, [0, 0, 0, 1, 1, 1])
    assert ds.default_generator().name == "label"
    # the stored image is the cached square (cache_resolution(32) = 64), decoded once from the file
    assert ds.image(1).size == (64, 64)
    np.testing.assert_array_equal(np.asarray(ds.image(1)), load_square(image_folder / "cat/1.png", 64))
    # what people see is the file itself
    np.testing.assert_array_equal(
        np.asarray(ds.display_image(1)), np.asarray(Image.open(image_folder / "cat/1.png"))
    )
    gray = np.asarray(ds.display_image(5))
    assert gray.shape == (9, 9, 3) and np.array_equal(gray[..., 0], gray[..., 2])
    # tensors: the cached squares resized to image_size, independently recomputed from the files
    ref = preprocess(np.stack([load_square(image_folder / f, 64) for f in ("cat/0.png", "dog/0.png")]), 32)
    torch.testing.assert_close(ds.tensors([0, 3]), ref, atol=0, rtol=0)
    assert ds.augment_source([0, 3]).shape == (2, 3, 64, 64)
    again = create_dataset(**ds.spec())
    assert again.fingerprint() == ds.fingerprint() and again.item_ids() == ids
    assert not again.cache.built and again.cache.path == ds.cache.path  # decoded once, opened after
    # content changes change the fingerprint and the cache
    _png(image_folder / "dog" / "0.png", np.zeros((5, 5, 3), dtype=np.uint8))
    changed = create_dataset(**ds.spec())
    assert changed.fingerprint() != ds.fingerprint() and changed.cache.path != ds.cache.path
    np.testing.assert_array_equal(np.asarray(changed.image(3)), np.zeros((64, 64, 3), np.uint8))


def test_folder_images_at_the_tower_size_stay_exact(tmp_path):
    """An image of exactly image_size reaches the encoder exactly as preprocess makes it from the
    file (the cache replicates pixels 2x, tensors averages 2 x 2 blocks back); a multiple, up to
    uint8 rounding."""
    rng = np.random.default_rng(5)
    imgs = {
        "a.png": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        "b.png": rng.integers(0, 256, (32, 48, 3), dtype=np.uint8),  # non-square: centre crop
        "c.png": rng.integers(0, 256, (128, 128, 3), dtype=np.uint8),
    }  # 4x: block means
    for name, arr in imgs.items():
        _png(tmp_path / "f" / name, arr)
    ds = create_dataset("folder", split="all", root=str(tmp_path / "f"), image_size=32)
    for i, name in enumerate(sorted(imgs)):
        # c.png: the cache holds the 2x block means rounded to uint8: within one grey level (2/255)
        tol = 2 / 255 if name == "c.png" else 1e-6
        torch.testing.assert_close(ds.tensors([i])[0], preprocess(imgs[name][None], 32)[0], atol=tol, rtol=0)


def test_folder_skips_bad_files_once_with_reasons(tmp_path):
    """Over the pixel limit, truncated and not-an-image files are not items; each is listed once."""
    import image_files as F

    root = tmp_path / "t"
    _png(root / "a.png", np.random.default_rng(0).integers(0, 256, size=(40, 40, 3), dtype=np.uint8))
    _png(root / "b.png", np.zeros((8, 8, 3), dtype=np.uint8))
    expected = F.bad_files(root)
    ds = create_dataset("folder", split="all", root=str(root))
    assert ds.item_ids() == ["a.png", "b.png"]
    assert {s["id"]: s["reason"] for s in ds.skipped} == expected and len(ds.skipped) == 3
    assert ds.labels is None and ds.default_generator().name == "instance"
    np.testing.assert_array_equal(ds.metadata(), [0, 1])
    # a lower limit is part of the dataset (spec, fingerprint, cache key)
    small = create_dataset("folder", split="all", root=str(root), max_pixels=1000)
    assert small.item_ids() == ["b.png"] and small.spec()["max_pixels"] == 1000
    assert small.fingerprint() != ds.fingerprint() and small.cache.path != ds.cache.path
    (root / "b.png").unlink()
    (root / "a.png").write_bytes(b"")
    with pytest.raises(ValueError, match="none of the 4 image files"):
        create_dataset("folder", split="all", root=str(root))
    _check_contract(_readable_only(tmp_path))


def _readable_only(tmp_path):
    root = tmp_path / "ok"
    for k in range(3):
        _png(root / f"{k}.jpg", np.full((6, 7, 3), 40 * k, dtype=np.uint8))
    return create_dataset("folder", root=str(root), image_size=8)  # split "train" falls back to "all"


def test_folder_splits_and_errors(tmp_path):
    root = tmp_path / "s"
    for split in ("train", "test"):
        for cls in ("a", "b"):
            _png(root / split / cls / "x.png", np.zeros((4, 4, 3), dtype=np.uint8))
    tr = create_dataset("folder", split="train", root=str(root))
    te = create_dataset("folder", split="test", root=str(root))
    assert tr.item_ids() == ["train/a/x.png", "train/b/x.png"] and tr.class_names == ["a", "b"]
    assert te.item_ids() == ["test/a/x.png", "test/b/x.png"]
    everything = create_dataset("folder", split="all", root=str(root))
    assert len(everything) == 4 and everything.labels is not None  # classes "test" and "train"
    assert create_dataset("folder", split="all", root=str(root), labels=False).labels is None
    with pytest.raises(ValueError, match="root"):
        create_dataset("folder")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        create_dataset("folder", root=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no image files"):
        create_dataset("folder", split="all", root=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="test"):
        create_dataset("folder", split="test", root=str(tmp_path / "empty"))
    flat = tmp_path / "flat"
    _png(flat / "a.png", np.zeros((4, 4, 3), dtype=np.uint8))
    _png(flat / "c" / "b.png", np.zeros((4, 4, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="class subfolders"):
        create_dataset("folder", split="all", root=str(flat), labels=True)


def test_synthetic_pixels_rendered_on_first_use_with_the_same_fingerprint():
    """Metadata and the fingerprint need no pixels; the streamed digest equals sha256 over the full
    rendered array (hashlib over the very bytes ArrayImageDataset hashes), across render blocks."""
    import hashlib

    from training import synthetic

    n = 2 * 16 * 2048 + 77  # more than one digest block, a ragged last one
    lazy = create_dataset("synthetic", split="train", size=n, seed=5, resolution=8, image_size=8)
    assert len(lazy) == n and lazy.latents.shape == (n, 3) and lazy._rendered is None
    fp = lazy.fingerprint()
    assert lazy._rendered is None  # hashed block by block, nothing kept

    images = synthetic.render(lazy.latents, 8)
    h = hashlib.sha256(json.dumps(lazy.spec(), sort_keys=True).encode())
    for arr in (images, lazy.latents):
        h.update(str(arr.shape).encode() + arr.dtype.str.encode())
        h.update(np.ascontiguousarray(arr).data)
    assert fp == h.hexdigest()

    eager = create_dataset("synthetic", split="train", size=n, seed=5, resolution=8, image_size=8)
    np.testing.assert_array_equal(eager.images_batch([0, n - 1]), images[[0, n - 1]])  # renders now
    assert eager._rendered is not None and eager.fingerprint() == fp
