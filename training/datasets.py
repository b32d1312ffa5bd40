"""Image datasets behind one map-style interface: synthetic torus, Fashion-MNIST, image folders.

Every dataset knows its positive generator (``default_generator``), the metadata that
generator's ``log_ratio`` consumes (``metadata``), stable caller-facing item ids, a JSON spec
that rebuilds it (``create_dataset(**ds.spec())``) and a content fingerprint for lineage.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from training import synthetic
from training._registry import create_registered, make_register
from training.generators import PositiveGenerator, create_generator
from training.idx import read_idx
from training.image_cache import content_key, file_digests, open_or_build, summarise_skipped
from training.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, ImageLimits, cache_resolution, load_rgb
from training.transforms import preprocess

logger = logging.getLogger(__name__)

__all__ = [
    "ImageDataset",
    "ArrayImageDataset",
    "SyntheticDataset",
    "FashionMNISTDataset",
    "FolderDataset",
    "DATASETS",
    "register_dataset",
    "create_dataset",
    "FASHION_MNIST_ROOT",
    "FASHION_MNIST_CLASSES",
    "IMAGE_EXTENSIONS",
    "dataset_is_file_backed",
]

DATASETS: dict[str, type["ImageDataset"]] = {}
DEFAULT_IMAGE_SIZE = 32


# class decorator, e.g. @register_dataset("name") on a class
register_dataset = make_register(DATASETS, "dataset")


def create_dataset(
    name: str,
    split: str = "train",
    root: str | None = None,
    size: int | None = None,
    seed: int = 0,
    **options: Any,
) -> "ImageDataset":
    """Build a registered dataset; ``create_dataset(**ds.spec())`` rebuilds ``ds``."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1):
        raise ValueError(f"size must be a positive integer or None, got {size!r}")
    return create_registered(
        DATASETS,
        "dataset",
        name,
        split=split,
        root=root,
        size=None if size is None else int(size),
        seed=int(seed),
        **options,
    )


def dataset_is_file_backed(spec: dict | None) -> bool:
    """Whether the dataset a spec names reads image files (and so the image cache and its options)."""
    name = spec.get("name") if isinstance(spec, dict) else None
    return bool(getattr(DATASETS.get(name), "file_backed", False))


def _check_image_size(image_size: Any) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    return int(image_size)


class ImageDataset(torch.utils.data.Dataset):
    """Base class: map-style dataset of RGB images; ``ds[i]`` is the (3, S, S) encoder input."""

    name: str = "base"
    file_backed: bool = False  # images come from files (decoded once into the image cache)
    split: str
    image_size: int
    labels: np.ndarray | None = None
    latents: np.ndarray | None = None
    class_names: list[str] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def _index(self, i: int) -> int:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"item index must be an integer, got {i!r}")
        if not -n <= i < n:
            raise IndexError(f"item index {i} out of range for {self.name}/{self.split} with {n} items")
        return int(i) % n

    def _indices(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"indices out of range for {self.name}/{self.split} with {len(self)} items")
        return idx

    def image(self, i: int) -> Image.Image:
        """The stored (or rendered) image as PIL RGB."""
        raise NotImplementedError

    def display_image(self, i: int, max_side: int = 256) -> Image.Image:
        """Item i for people to look at (thumbnails); the stored image unless a subclass has better."""
        return self.image(i)

    def try_image(self, i: int) -> Image.Image | None:
        """Like image(i) but None when the item cannot be read (index builds skip it)."""
        try:
            return self.image(i)
        except (OSError, ValueError) as exc:
            logger.warning("skipping unreadable item %s: %s", self.item_id(self._index(i)), exc)
            return None

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors([self._index(i)])[0]

    def tensors(self, indices: Any) -> torch.Tensor:
        """Preprocessed batch (B, 3, S, S) for item indices (subclasses vectorise this)."""
        idx = self._indices(indices)
        return preprocess([self.image(int(i)) for i in idx], self.image_size)

    def augment_source(self, indices: Any) -> torch.Tensor:
        """What augmentations crop from, (B, 3, R, R) with R >= image_size; they resize to image_size."""
        return self.tensors(indices)

    def item_id(self, i: int) -> str:
        return f"{self.name}/{self.split}/{self._index(i)}"

    def item_ids(self) -> list[str]:
        return [self.item_id(i) for i in range(len(self))]

    def spec(self) -> dict[str, Any]:
        raise NotImplementedError

    def _content_digest(self, h: "hashlib._Hash") -> None:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """sha256 hex over the JSON spec and the dataset content (cached)."""
        cached = getattr(self, "_fingerprint", None)
        if cached is None:
            h = hashlib.sha256()
            h.update(json.dumps(self.spec(), sort_keys=True).encode())
            self._content_digest(h)
            cached = self._fingerprint = h.hexdigest()
        return cached

    def default_generator(self) -> PositiveGenerator:
        raise NotImplementedError

    def metadata(self) -> np.ndarray:
        """What default_generator().log_ratio takes: latents, labels, or arange(N) (instance)."""
        gen = self.default_generator().name
        if gen == "latent":
            return self.latents
        if gen == "label":
            return self.labels
        return np.arange(len(self), dtype=np.int64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(split={self.split!r}, n={len(self)}, image_size={self.image_size})"


class ArrayImageDataset(ImageDataset):
    """Dataset whose images sit in one uint8 array (N, H, W) or (N, H, W, 3): vectorised batches."""

    _images: np.ndarray

    def __len__(self) -> int:
        return int(self._images.shape[0])

    def images_batch(self, indices: Any) -> np.ndarray:
        """Raw uint8 images for item indices, (B, H, W) or (B, H, W, 3)."""
        return self._images[self._indices(indices)]

    def image(self, i: int) -> Image.Image:
        arr = self._images[self._index(i)]
        return Image.fromarray(arr, mode="L" if arr.ndim == 2 else "RGB").convert("RGB")

    def tensors(self, indices: Any) -> torch.Tensor:
        return preprocess(self.images_batch(indices), self.image_size)

    def _content_digest(self, h: "hashlib._Hash") -> None:
        for arr in (self._images, self.labels, self.latents):
            if arr is not None:
                h.update(str(arr.shape).encode() + arr.dtype.str.encode())
                h.update(np.ascontiguousarray(arr).data)


@register_dataset("synthetic")
class SyntheticDataset(ArrayImageDataset):
    """Rendered torus images (see training/synthetic.py); metadata = latent angles (N, 3).

    The pixels are rendered on first use: users of the metadata alone (`softsearch eval` on an
    index, whose embeddings are stored) never hold them (N = 10^6 at 32 px: 3 GB). The fingerprint
    hashes the same bytes either way, rendering block by block when the images are not held."""

    def __init__(
        self,
        split: str = "train",
        root: str | None = None,
        size: int | None = None,
        seed: int = 0,
        kappa: float = 8.0,
        image_size: int = DEFAULT_IMAGE_SIZE,
        resolution: int = synthetic.RESOLUTION,
        render_version: int = synthetic.RENDER_VERSION,
    ):
        if render_version != synthetic.RENDER_VERSION:
            raise ValueError(
                f"synthetic render_version {render_version!r} does not match this renderer "
                f"(version {synthetic.RENDER_VERSION}); the images would differ"
            )
        if split not in synthetic.DEFAULT_SIZES:
            raise ValueError(
                f"unknown synthetic split {split!r}; expected one of {sorted(synthetic.DEFAULT_SIZES)}"
            )
        self.split = split
        self.seed = int(seed)
        self.kappa = float(kappa)
        create_generator("latent", kappa=self.kappa)  # validates kappa early
        self.image_size = _check_image_size(image_size)
        self.resolution = int(resolution)
        n = synthetic.DEFAULT_SIZES[split] if size is None else int(size)
        self.latents = synthetic.sample_latents(n, self.seed, split)  # (N, 3) float64
        self.latents.flags.writeable = False
        self._rendered: np.ndarray | None = None

    @property
    def _images(self) -> np.ndarray:
        """(N, R, R, 3) uint8, rendered on first access."""
        if self._rendered is None:
            images = synthetic.render(self.latents, self.resolution)
            images.flags.writeable = False
            self._rendered = images
            logger.debug("rendered synthetic/%s: %d images (seed %d)", self.split, len(images), self.seed)
        return self._rendered

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    def _content_digest(self, h: "hashlib._Hash") -> None:
        if self._rendered is not None:
            super()._content_digest(h)
            return
        # the bytes ArrayImageDataset hashes (image array, then latents), rendered in blocks that are a
        # multiple of render()'s own block, so every pixel is computed exactly as in one render() call
        n, r = len(self), self.resolution
        h.update(str((n, r, r, 3)).encode() + np.dtype(np.uint8).str.encode())
        step = 16 * 2048
        for start in range(0, n, step):
            h.update(np.ascontiguousarray(synthetic.render(self.latents[start : start + step], r)).data)
        h.update(str(self.latents.shape).encode() + self.latents.dtype.str.encode())
        h.update(np.ascontiguousarray(self.latents).data)

    def render_latents(self, latents: np.ndarray) -> torch.Tensor:
        """Render arbitrary latents with this dataset's settings -> (B, 3, S, S) preprocessed."""
        return preprocess(synthetic.render(latents, self.resolution), self.image_size)

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "split": self.split,
            "root": None,
            "size": len(self),
            "seed": self.seed,
            "kappa": self.kappa,
            "image_size": self.image_size,
            "resolution": self.resolution,
            "render_version": synthetic.RENDER_VERSION,
        }

    def default_generator(self) -> PositiveGenerator:
        return create_generator("latent", kappa=self.kappa)


FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
_FASHION_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@functools.lru_cache(maxsize=4)
def _read_idx_cached(path: str, mtime_ns: int, nbytes: int) -> np.ndarray:
    """read_idx memoised on (path, mtime, size); the array is returned read-only."""
    arr = read_idx(path)
    arr.flags.writeable = False
    return arr


def _find_idx(root: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(f"Fashion-MNIST file {stem}[.gz] not found in {root}")


@register_dataset("fashion-mnist")
class FashionMNISTDataset(ArrayImageDataset):
    """Fashion-MNIST from IDX files (plain or .gz); 28x28 grayscale, 10 classes; label positives.

    ``size`` keeps the first ``size`` items of the split (deterministic, no shuffling).
    """

    def __init__(
        self,
        split: str = "train",
        root: str | None = None,
        size: int | None = None,
        seed: int = 0,
        image_size: int = DEFAULT_IMAGE_SIZE,
    ):
        if split not in _FASHION_FILES:
            raise ValueError(f"unknown fashion-mnist split {split!r}; expected 'train' or 'test'")
        root_path = Path(root or FASHION_MNIST_ROOT).expanduser().resolve()
        if not root_path.is_dir():
            raise FileNotFoundError(
                f"Fashion-MNIST directory {root_path} not found; install it with "
                f"`apt-get update && apt-get install -y dataset-fashion-mnist` or pass --data-root"
            )
        self.split = split
        self.root = str(root_path)
        self.seed = int(seed)
        self.image_size = _check_image_size(image_size)
        img_path, lab_path = (_find_idx(root_path, stem) for stem in _FASHION_FILES[split])
        images = self._load(img_path)
        labels = self._load(lab_path)
        if images.ndim != 3 or images.dtype != np.uint8:
            raise ValueError(
                f"{img_path}: expected (N, H, W) uint8 images, got {images.shape} {images.dtype}"
            )
        if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
            raise ValueError(f"{lab_path}: expected {images.shape[0]} labels, got shape {labels.shape}")
        if size is not None:
            if size > images.shape[0]:
                raise ValueError(f"size {size} exceeds the {images.shape[0]} items of fashion-mnist/{split}")
            images, labels = images[:size], labels[:size]
        if labels.size and (labels.min() < 0 or labels.max() >= len(FASHION_MNIST_CLASSES)):
            raise ValueError(f"{lab_path}: labels outside 0..9")
        self._images = images  # (N, 28, 28) uint8, read-only view
        self.labels = labels.astype(np.int64)
        self.labels.flags.writeable = False
        self.class_names = list(FASHION_MNIST_CLASSES)
        self._size = size

    @staticmethod
    def _load(path: Path) -> np.ndarray:
        st = path.stat()
        return _read_idx_cached(str(path), st.st_mtime_ns, st.st_size)

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "split": self.split,
            "root": self.root,
            "size": self._size,
            "seed": self.seed,
            "image_size": self.image_size,
        }

    def default_generator(self) -> PositiveGenerator:
        return create_generator("label")


IMAGE_EXTENSIONS = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}
)


@register_dataset("folder")
class FolderDataset(ImageDataset):
    """Every image file under a directory (recursive, sorted by path), decoded once into the
    memory-mapped image cache (training/image_cache.py) and read from there.

    Splits: ``"all"`` is every image under ``root``; ``"train"`` / ``"test"`` use ``root/train`` /
    ``root/test`` when that subdirectory exists (``"train"`` falls back to ``"all"`` otherwise, so
    the CLI default works on a plain folder). Item ids are POSIX paths relative to ``root``.
    Labels: when every image sits in a first-level subfolder (of the split directory) and there
    are at least two such subfolders, the subfolder names are the classes (sorted) and the
    default generator is ``label``; otherwise there are no labels and it is ``instance``.
    ``labels=True/False`` forces the choice. ``size`` keeps the first ``size`` files.

    Files over ``max_pixels`` / ``max_bytes`` (checked from the header) or unreadable are not
    items: ``skipped`` lists each once with its reason, and one log line counts them. The cache
    holds a ``cache_resolution(image_size)`` square per file; ``tensors`` resizes it to
    ``image_size``, ``augment_source`` hands augmentations the full square. ``cache_dir``,
    ``cache_workers`` and ``progress`` are runtime options (not part of ``spec``).
    """

    file_backed = True

    def __init__(
        self,
        split: str = "all",
        root: str | None = None,
        size: int | None = None,
        seed: int = 0,
        image_size: int = DEFAULT_IMAGE_SIZE,
        labels: bool | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        cache_dir: str | None = None,
        cache_workers: int | None = None,
        progress: bool = True,
    ):
        if root is None:
            raise ValueError("the folder dataset needs a root directory (--data-root)")
        root_path = Path(root).expanduser().resolve()
        if not root_path.is_dir():
            raise FileNotFoundError(f"image folder {root_path} not found")
        if split not in ("all", "train", "test"):
            raise ValueError(f"unknown folder split {split!r}; expected 'all', 'train' or 'test'")
        base = root_path
        if split in ("train", "test"):
            if (root_path / split).is_dir():
                base = root_path / split
            elif split == "train":
                logger.info("%s has no train/ subfolder; using every image (split 'all')", root_path)
                split = "all"
            else:
                raise ValueError(f"split 'test' needs a subfolder {root_path / 'test'}")
        self.split = split
        self.root = str(root_path)
        self.seed = int(seed)
        self.image_size = _check_image_size(image_size)
        self.limits = ImageLimits(max_pixels=max_pixels, max_bytes=max_bytes)
        files = sorted(
            p.relative_to(base).as_posix()
            for p in base.rglob("*")
            if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
        )
        if size is not None:
            files = files[:size]
        if not files:
            raise ValueError(f"no image files ({', '.join(sorted(IMAGE_EXTENSIONS))}) under {base}")
        self._base = base
        self._prefix = base.relative_to(root_path).as_posix()  # "." or "train"/"test"
        self._size = size
        self._labels_option = labels
        self._files = files  # every candidate file, cached or skipped
        cache_root = None if cache_dir is None else Path(cache_dir).expanduser()
        self._digests = file_digests(base, files, cache_root, progress=progress)
        self.cache = open_or_build(
            [base / f for f in files],
            [self._id_of(f) for f in files],
            self._digests,
            cache_resolution(self.image_size),
            self.limits,
            cache_root=cache_root,
            workers=cache_workers,
            progress=progress,
            label=f"folder/{split} images",
        )
        self._rows = np.flatnonzero(self.cache.ok)  # cache row of each item
        self._rel = [files[int(r)] for r in self._rows]
        self.skipped = [
            {"id": s["file"], "reason": s["reason"], "error": s["error"]} for s in self.cache.skipped
        ]
        if self.skipped:  # info: each command that uses the dataset reports the skipped files its own way
            logger.info(
                "folder/%s: %d of %d files skipped (%s); listed in %s",
                split,
                len(self.skipped),
                len(files),
                summarise_skipped(self.skipped),
                self.cache.path / "index.json",
            )
        if not self._rel:
            raise ValueError(
                f"none of the {len(files)} image files under {base} could be read "
                f"({summarise_skipped(self.skipped)}), e.g. {self.skipped[0]['error']}"
            )
        tops = [f.split("/")[0] if "/" in f else None for f in files]
        nested = all(t is not None for t in tops)
        classes = sorted(set(tops)) if nested else []
        use_labels = (nested and len(classes) >= 2) if labels is None else bool(labels)
        if use_labels:
            if not nested:
                raise ValueError(f"labels=True but some images under {base} are not in class subfolders")
            index = {c: k for k, c in enumerate(classes)}
            self.class_names = classes  # from every file: ids do not depend on decodes
            self.labels = np.array([index[tops[int(r)]] for r in self._rows], dtype=np.int64)
            self.labels.flags.writeable = False

    def _id_of(self, rel: str) -> str:
        return rel if self._prefix == "." else f"{self._prefix}/{rel}"

    def __len__(self) -> int:
        return len(self._rel)

    def path(self, i: int) -> Path:
        """Absolute path of item i."""
        return self._base / self._rel[self._index(i)]

    def item_id(self, i: int) -> str:
        return self._id_of(self._rel[self._index(i)])

    def relative_path(self, i: int) -> str:
        """Item i's POSIX path under the split's folder (its first folder is the class folder)."""
        return self._rel[self._index(i)]

    def images_batch(self, indices: Any) -> np.ndarray:
        """The cached (B, R, R, 3) uint8 squares of items (R = cache_resolution(image_size))."""
        return self.cache.images[self._rows[self._indices(indices)]]

    def image(self, i: int) -> Image.Image:
        """The stored image: the cached (R, R) RGB square of item i."""
        return Image.fromarray(np.asarray(self.cache.images[self._rows[self._index(i)]]), mode="RGB")

    def display_image(self, i: int, max_side: int = 256) -> Image.Image:
        """Item i decoded from its file for people to look at (shorter side ~ max_side, same policy)."""
        rgb = load_rgb(self.path(i), self.limits, min_side=max_side)
        im = Image.fromarray(rgb, mode="RGB")
        im.thumbnail((max_side, max_side), reducing_gap=2.0)
        return im

    def tensors(self, indices: Any) -> torch.Tensor:
        return preprocess(self.images_batch(indices), self.image_size)

    def augment_source(self, indices: Any) -> torch.Tensor:
        """(B, 3, R, R) normalised cache squares: augmentations crop these, then resize to image_size."""
        return preprocess(self.images_batch(indices), self.cache.resolution)

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "split": self.split,
            "root": self.root,
            "size": self._size,
            "seed": self.seed,
            "image_size": self.image_size,
            "labels": self._labels_option,
            "max_pixels": self.limits.max_pixels,
            "max_bytes": self.limits.max_bytes,
        }

    def _content_digest(self, h: "hashlib._Hash") -> None:
        # name and sha256 of every candidate file (skipped ones too: fixing a file changes the data)
        h.update(content_key(self._files, self._digests).encode())

    def default_generator(self) -> PositiveGenerator:
        return create_generator("label" if self.labels is not None else "instance")
