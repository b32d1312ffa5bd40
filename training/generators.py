"""Positive generators: how a positive y ~ p(y | x) is drawn, and the ideal log r(x, y) it implies.

``log r(x, y) = log p(y | x) - log p(y)`` defines the ideal softmax search
``q(j | x) = r(x, y_j) / sum_l r(x, y_l)`` that search/evaluation/gap.py compares the learned one with.

* ``latent``  (synthetic): every latent angle perturbed by von Mises(0, kappa) and re-rendered;
  ``log r = sum_i [kappa cos(th'_i - th_i) - log I0(kappa)]`` (uniform marginal on the torus). Exact.
* ``label``   (class-conditional): ``log r = log(1[c = c'] / pi_c)``. Exact at the label level.
* ``instance`` (augmentations): q approximated by a point mass on the source item. Not exact.
* ``neighbour`` (augmented k nearest neighbours in grey pixels or the encoder, no labels): same
  approximation. Not exact.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from scipy.special import i0e

from training._registry import create_registered, make_register
from training.augment import AugmentConfig, random_augment

if TYPE_CHECKING:  # pragma: no cover
    from training.datasets import ImageDataset

logger = logging.getLogger(__name__)

__all__ = [
    "PositiveGenerator",
    "LatentGenerator",
    "LabelGenerator",
    "InstanceGenerator",
    "NeighbourGenerator",
    "GENERATORS",
    "register_generator",
    "create_generator",
    "log_i0",
]

GENERATORS: dict[str, type["PositiveGenerator"]] = {}


# class decorator, e.g. @register_generator("name") on a class
register_generator = make_register(GENERATORS, "generator")


def create_generator(name: str, **options: Any) -> "PositiveGenerator":
    """Build a registered generator, e.g. ``create_generator("latent", kappa=8.0)``."""
    return create_registered(GENERATORS, "generator", name, **options)


def log_i0(kappa: float) -> float:
    """log I0(kappa), stable for large kappa: I0(k) = i0e(k) * e^k."""
    return float(np.log(i0e(kappa)) + kappa)


def augmented_views(
    dataset: "ImageDataset", indices: np.ndarray, rng: np.random.Generator, config: AugmentConfig
) -> torch.Tensor:
    """Random augmentations of items, cropped from the dataset's augmentation source (its cache
    squares for file-backed datasets) and resized to the dataset's image_size: (B, 3, S, S)."""
    source = getattr(dataset, "augment_source", dataset.tensors)
    return random_augment(source(indices), rng, config, out_size=dataset.image_size)


def _indices(indices: np.ndarray, n: int) -> np.ndarray:
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"indices out of range for a dataset of {n} items")
    return idx


class PositiveGenerator:
    """Base class: see module docstring. Subclasses set name/exact/description."""

    name: str = "base"
    exact: bool = True
    description: str = ""

    def log_ratio(self, query_meta: np.ndarray, db_meta: np.ndarray) -> np.ndarray:
        """Dense (Q, N) float64 block of log r(x_q, y_n); -inf where r = 0."""
        raise NotImplementedError

    def sample_pairs(
        self, dataset: "ImageDataset", indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchor views, positive views), each (B, 3, S, S) preprocessed."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """JSON-able constructor options: create_generator(self.name, **self.options()) rebuilds it."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


@register_generator("latent")
class LatentGenerator(PositiveGenerator):
    """Von Mises latent perturbation on the synthetic torus (exact log r)."""

    exact = True

    def __init__(self, kappa: float = 8.0):
        kappa = float(kappa)
        if not np.isfinite(kappa) or kappa <= 0:
            raise ValueError(f"kappa must be a positive finite number, got {kappa}")
        self.kappa = kappa
        self.description = (
            f"latent: every angle perturbed by von Mises(0, kappa={kappa:g}); "
            "exact log r = sum_i kappa cos(dtheta_i) - m log I0(kappa)"
        )

    def options(self) -> dict[str, Any]:
        return {"kappa": self.kappa}

    def log_ratio(self, query_meta: np.ndarray, db_meta: np.ndarray) -> np.ndarray:
        q = np.asarray(query_meta, dtype=np.float64)
        d = np.asarray(db_meta, dtype=np.float64)
        if q.ndim != 2 or d.ndim != 2 or q.shape[1] != d.shape[1]:
            raise ValueError(f"latent metadata must be (Q, m) and (N, m) angles, got {q.shape} and {d.shape}")
        m = q.shape[1]
        # sum_i cos(a_i - b_i) = sum_i (cos a_i cos b_i + sin a_i sin b_i): one matmul
        cos_sum = np.cos(q) @ np.cos(d).T + np.sin(q) @ np.sin(d).T  # (Q, N)
        return self.kappa * cos_sum - m * log_i0(self.kappa)

    def perturb(self, latents: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Positive latents: theta' = theta + von Mises(0, kappa) noise, wrapped to [0, 2pi)."""
        lat = np.asarray(latents, dtype=np.float64)
        return np.mod(lat + rng.vonmises(0.0, self.kappa, size=lat.shape), 2 * np.pi)

    def sample_pairs(
        self, dataset: "ImageDataset", indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if dataset.latents is None or not hasattr(dataset, "render_latents"):
            raise ValueError(
                f"the latent generator needs a dataset with latents (synthetic), got {dataset.name!r}"
            )
        idx = _indices(indices, len(dataset))
        anchors = dataset.tensors(idx)
        positives = dataset.render_latents(self.perturb(dataset.latents[idx], rng))
        return anchors, positives


@register_generator("label")
class LabelGenerator(PositiveGenerator):
    """Class-conditional positives: a random other item of the anchor's class.

    ``log r(x, y) = log(1[c(x) = c(y)] / pi_c)``; ``pi_c`` is the class frequency *in the
    database labels passed to log_ratio* (the empirical marginal of that database), so the ideal
    search q is uniform over the database items of the query's class. With ``augment=True`` both
    views are independently augmented (label-preserving nuisance; r is defined on labels).
    """

    exact = True

    def __init__(
        self,
        augment: bool = True,
        crop_scale: tuple[float, float] = (0.7, 1.0),
        flip_p: float = 0.5,
        brightness: float = 0.1,
        contrast: float = 0.1,
        translate: float = 0.05,
        saturation: float = 0.0,
        grey_p: float = 0.0,
        blur_p: float = 0.0,
        rotate: float = 0.0,
    ):
        self.augment = bool(augment)
        self.aug = AugmentConfig(
            crop_scale=tuple(crop_scale),
            flip_p=flip_p,
            brightness=brightness,
            contrast=contrast,
            translate=translate,
            saturation=saturation,
            grey_p=grey_p,
            blur_p=blur_p,
            rotate=rotate,
        )
        self.description = (
            "label: positive = random other item of the same class"
            + (" (augmented)" if self.augment else "")
            + "; exact log r = log(1[c=c'] / pi_c), pi_c from database labels"
        )
        self._cache: tuple[Any, ...] | None = None

    def options(self) -> dict[str, Any]:
        a = self.aug
        return {
            "augment": self.augment,
            "crop_scale": list(a.crop_scale),
            "flip_p": a.flip_p,
            "brightness": a.brightness,
            "contrast": a.contrast,
            "translate": a.translate,
            **{k: getattr(a, k) for k in ("saturation", "grey_p", "blur_p", "rotate") if getattr(a, k)},
        }

    def log_ratio(self, query_meta: np.ndarray, db_meta: np.ndarray) -> np.ndarray:
        q = np.asarray(query_meta).reshape(-1).astype(np.int64)
        d = np.asarray(db_meta).reshape(-1).astype(np.int64)
        if d.size == 0:
            raise ValueError("database labels are empty")
        classes, counts = np.unique(d, return_counts=True)
        # -log pi_c = log N - log n_c for the query's class; NaN-free because only same-class entries use it
        pos = np.searchsorted(classes, q).clip(0, classes.size - 1)
        present = classes[pos] == q
        neg_log_pi = np.where(present, np.log(d.size) - np.log(counts[pos].astype(np.float64)), -np.inf)
        same = q[:, None] == d[None, :]  # (Q, N)
        return np.where(same, neg_log_pi[:, None], -np.inf)

    def _class_index(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """order (items sorted by class), start and count of each item's class block, item rank in it."""
        if self._cache is not None and self._cache[0] is labels:
            return self._cache[1:]
        order = np.argsort(labels, kind="stable")
        sorted_labels = labels[order]
        classes, starts, counts = np.unique(sorted_labels, return_index=True, return_counts=True)
        cls_of_item = np.searchsorted(classes, labels)
        rank = np.empty(labels.size, dtype=np.int64)
        rank[order] = np.arange(labels.size) - starts[np.searchsorted(classes, sorted_labels)]
        out = (order, starts[cls_of_item], counts[cls_of_item], rank)
        self._cache = (labels, *out)
        return out

    def positive_indices(
        self, labels: np.ndarray, indices: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        """For each anchor, a uniformly random *other* item of its class (itself if it is alone)."""
        order, start, count, rank = self._class_index(labels)
        idx = _indices(indices, labels.size)
        n_c = count[idx]
        k = np.floor(rng.random(idx.size) * np.maximum(n_c - 1, 1)).astype(
            np.int64
        )  # uniform in [0, n_c - 2]
        k = np.where(n_c > 1, k + (k >= rank[idx]), rank[idx])  # skip the anchor itself
        return order[start[idx] + k]

    def sample_pairs(
        self, dataset: "ImageDataset", indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if dataset.labels is None:
            raise ValueError(f"the label generator needs a labelled dataset, {dataset.name!r} has no labels")
        idx = _indices(indices, len(dataset))
        pos = self.positive_indices(dataset.labels, idx, rng)
        if self.augment:
            return augmented_views(dataset, idx, rng, self.aug), augmented_views(dataset, pos, rng, self.aug)
        return dataset.tensors(idx), dataset.tensors(pos)


@register_generator("instance")
class InstanceGenerator(PositiveGenerator):
    """Augmentation positives: two random augmentations of the same image (approximate log r)."""

    exact = False
    description = (
        "instance: two random augmentations of the same image; APPROXIMATE: point-mass "
        "approximation of q (log r = 0 on the source item, -inf elsewhere)"
    )

    def __init__(
        self,
        crop_scale: tuple[float, float] = (0.5, 1.0),
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        translate: float = 0.1,
        brightness: float = 0.2,
        contrast: float = 0.2,
        saturation: float = 0.0,
        grey_p: float = 0.0,
        blur_p: float = 0.0,
        rotate: float = 0.0,
        overlay_p: float = 0.0,
    ):
        self.aug = AugmentConfig(
            crop_scale=tuple(crop_scale),
            crop_ratio=tuple(crop_ratio),
            flip_p=flip_p,
            translate=translate,
            brightness=brightness,
            contrast=contrast,
            saturation=saturation,
            grey_p=grey_p,
            blur_p=blur_p,
            rotate=rotate,
            overlay_p=overlay_p,
        )

    def options(self) -> dict[str, Any]:
        a = self.aug
        extra = {"overlay_p": a.overlay_p} if a.overlay_p else {}  # older configs' options read as before
        return {
            **extra,
            "crop_scale": list(a.crop_scale),
            "crop_ratio": list(a.crop_ratio),
            "flip_p": a.flip_p,
            "translate": a.translate,
            "brightness": a.brightness,
            "contrast": a.contrast,
            "saturation": a.saturation,
            "grey_p": a.grey_p,
            "blur_p": a.blur_p,
            "rotate": a.rotate,
        }

    def log_ratio(self, query_meta: np.ndarray, db_meta: np.ndarray) -> np.ndarray:
        q = np.asarray(query_meta).reshape(-1)
        d = np.asarray(db_meta).reshape(-1)
        return np.where(q[:, None] == d[None, :], 0.0, -np.inf)

    def sample_pairs(
        self, dataset: "ImageDataset", indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = _indices(indices, len(dataset))
        source = getattr(dataset, "augment_source", dataset.tensors)(idx)
        return (
            random_augment(source, rng, self.aug, out_size=dataset.image_size),
            random_augment(source, rng, self.aug, out_size=dataset.image_size),
        )


@register_generator("neighbour")
class NeighbourGenerator(InstanceGenerator):
    """Neighbour positives: the anchor and one of its k nearest neighbours, each randomly augmented
    (no labels). The neighbours come from ``space``:

    * ``"pixels"``: grey-pixel cosine, computed once on first use (training/neighbours.py);
    * ``"encoder"``: the encoder being trained (cosine of its embeddings), computed by ``refresh``
      before the first step (the untrained tower's neighbours) and again every ``refresh_every``
      steps (0: never again), NNCLR-style: the support follows what the encoder has learned;
    * ``"both"``: as ``"encoder"``, ranked by the mean of the grey-pixel and the embedding cosines,
      so a positive is close in both;
    * ``"served"``: as ``"encoder"``, in the served embedding (with the pixel anchor, if any).

    The ideal search is only defined among training items, so ``log_ratio`` keeps the instance
    point-mass approximation (``exact = False``); evaluate with the ``label`` generator.
    """

    exact = False
    SPACES = ("pixels", "encoder", "both", "served")

    def __init__(self, k: int = 5, space: str = "pixels", refresh_every: int = 0, **augment_options: Any):
        super().__init__(**augment_options)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if space not in self.SPACES:
            raise ValueError(f"space must be one of {', '.join(self.SPACES)}, got {space!r}")
        if (
            isinstance(refresh_every, bool)
            or not isinstance(refresh_every, (int, np.integer))
            or refresh_every < 0
        ):
            raise ValueError(f"refresh_every must be a non-negative integer, got {refresh_every!r}")
        self.k, self.space, self.refresh_every = int(k), space, int(refresh_every)
        where = (
            "grey-pixel"
            if space == "pixels"
            else {"encoder": "encoder", "both": "pixel+encoder", "served": "served-embedding"}[space]
            + (f", refreshed every {self.refresh_every} steps" if self.refresh_every else ", at step 0")
        )
        self.description = (
            f"neighbour: anchor and one of its {self.k} nearest {where} neighbours, both "
            "augmented; APPROXIMATE: point-mass approximation of q"
        )
        self._table: tuple[Any, np.ndarray] | None = None  # (weakref to the dataset, (N, k) rows)

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": self.k}
        if self.space != "pixels":  # the pixel default's options read as before
            out.update(space=self.space, refresh_every=self.refresh_every)
        return {**out, **super().options()}

    def neighbour_table(self, dataset: "ImageDataset") -> np.ndarray:
        """(N, k) neighbour rows of `dataset`, computed on first use (pixels) or by `refresh` (encoder)."""
        if self._table is not None and self._table[0]() is dataset:
            return self._table[1]
        if self.space != "pixels":
            raise RuntimeError(
                f"{self.space}-space neighbours need refresh(encoder, dataset, step) before sampling"
            )
        from training.neighbours import pixel_neighbours

        table = pixel_neighbours(dataset, self.k)
        self._table = (weakref.ref(dataset), table)
        return table

    def refresh(self, encoder: torch.nn.Module, dataset: "ImageDataset", step: int) -> bool:
        """Recompute the encoder-space table when it is due (first call, then every refresh_every
        steps); the trainer calls this before each step. Returns whether it recomputed."""
        if self.space == "pixels":
            return False
        have = self._table is not None and self._table[0]() is dataset
        if have and not (self.refresh_every and step % self.refresh_every == 0):
            return False
        from training.neighbours import encoder_neighbours

        self._table = (
            weakref.ref(dataset),
            encoder_neighbours(
                encoder, dataset, self.k, with_pixels=self.space == "both", served=self.space == "served"
            ),
        )
        return True

    def sample_pairs(
        self, dataset: "ImageDataset", indices: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = _indices(indices, len(dataset))
        table = self.neighbour_table(dataset)
        pos = table[idx, rng.integers(0, self.k, size=idx.size)]
        return augmented_views(dataset, idx, rng, self.aug), augmented_views(dataset, pos, rng, self.aug)

    def __getstate__(self) -> dict[str, Any]:  # weakrefs do not pickle (DataLoader workers, spawn)
        state = dict(self.__dict__)
        state["_table"] = None
        return state
