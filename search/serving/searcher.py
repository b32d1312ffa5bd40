"""Searcher: an encoder plus the active index version, with exact softmax probabilities and hot swap.

Probabilities are the learned softmax search over the WHOLE database (docs/theory.md §1, §6):

    p(j | x) = exp(s_j / tau) / sum_l exp(s_l / tau),     s_j = z_x . z_j

with the normaliser log Z = logsumexp_l(s_l / tau) from search/serving/normaliser.py: `exact` is a blocked,
streaming logsumexp over every stored embedding (never a Q x N matrix at once), one pass per batch of queries
that also yields the exact top-k (search/serving/exact_scan.py: no index search); `bounded` scans a
few lists of the index exactly and samples the rest, and every answer carries a bound that
contains the exact value; `auto` (the default) is exact up to N * D = 1.28e8 and bounded above.
tau is the request's temperature or the manifest's `search_temperature`.

Hot swap: the loaded (encoder, index version) pair lives in ONE attribute holding an immutable
`SearchSnapshot`. A query reads that attribute once and runs entirely on that snapshot, so
in-flight queries finish on the version they started with; `reload()` builds the new snapshot
off to the side and replaces the attribute under a lock. On any error the old snapshot stays.

Compatibility policy (decided here): each index version names its encoder by sha256; the
weights live in the store (`models/<sha256>.safetensors`, index/models.py). If that sha256
equals the loaded encoder's, the encoder is reused; otherwise the version's own model is loaded
from the store (its sha256 re-verified) and both are swapped in one step. A version is refused
when its model is missing or damaged, or when the encoder's embedding dimension, the manifest
`dim` and the stored embeddings disagree.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from index.faiss_index import rerank_factor
from index.manifest import DEFAULT_TEMPERATURE, Manifest
from index.metadata import MetadataColumns, read_metadata
from index.models import load_version_encoder
from index.store import IndexStore, IndexVersion
from search.serving.exact_scan import ExactScanner
from search.serving.filters import Filter
from search.serving.inference import InferenceEncoder
from search.serving.normaliser import DEFAULT_BLOCK, LogZ, Normaliser, NormaliserConfig, log_normaliser
from search.serving.queries import unit_queries
from search.serving.subset import subset_search
from training.encoder import Encoder
from training.transforms import preprocess

logger = logging.getLogger(__name__)

__all__ = [
    "Hit",
    "SearchAnswer",
    "SearchSnapshot",
    "Searcher",
    "NotReadyError",
    "NoEncoderError",
    "ReloadResult",
    "ItemInfo",
    "log_normaliser",
    "DEFAULT_TEMPERATURE",
]

#: Filter masks a snapshot keeps (N bytes each).
FILTER_CACHE = 64
#: The bounded normaliser's list-ordered copy of a version's rows, shared by its serving processes
#: (`NormaliserConfig.listed_shared`): derived from the version's files, written beside them on first use.
LISTED_FILE = ".listed-rows.npy"
#: What an image query on a version built from vectors is told (the API answers it with 409).
NO_ENCODER = "this index version has no encoder: search it with vectors"


class NotReadyError(RuntimeError):
    """No index version / encoder is loaded yet."""


class NoEncoderError(RuntimeError):
    """An image query on a version built from vectors computed elsewhere (`index build --embeddings`)."""

    def __init__(self, version: str):
        super().__init__(f"{NO_ENCODER} (index version {version} was built from vectors)")
        self.version = version


@dataclass(frozen=True)
class Hit:
    """One result: item id, its row in the index, cosine similarity, softmax probability over the db."""

    id: str
    row: int
    similarity: float
    probability: float


class SearchAnswer(list):
    """list[list[Hit]] (one list per query) that also names the version and temperatures that answered,
    and each query's log Z (`normalisers[i]`: value, bound, sampled interval, method)."""

    def __init__(
        self,
        hits: list[list[Hit]],
        version: str,
        temperatures: list[float],
        log_normalisers: list[float],
        normalisers: LogZ | None = None,
    ):
        super().__init__(hits)
        self.version = version
        self.temperatures = temperatures
        self.log_normalisers = log_normalisers
        self.normalisers = (
            normalisers if normalisers is not None else LogZ.exact(np.asarray(log_normalisers), 0)
        )


@dataclass(frozen=True)
class ItemInfo:
    """What the API tells about one indexed item."""

    id: str
    row: int
    version: str
    label: int | None = None
    class_name: str | None = None
    dataset: dict | None = None


@dataclass(frozen=True)
class ReloadResult:
    previous: str | None
    version: str
    changed: bool
    encoder_reloaded: bool


def _index_recall(manifest) -> float | None:
    """The recall@10 an approximate index measured at build (None for an exact index or none recorded)."""
    record = getattr(manifest, "recall", None)  # a RecallRecord (index.manifest) or None
    if record is None or record.exact or record.recall is None:
        return None
    return float(record.recall)


def _manifest_temperature(manifest: Manifest) -> float:
    value = manifest.temperature
    if value is not None:
        return value
    logger.warning(
        "manifest of version %s has no search_temperature; using %g", manifest.version, DEFAULT_TEMPERATURE
    )
    return DEFAULT_TEMPERATURE


@dataclass(frozen=True, eq=False)
class SearchSnapshot:
    """An immutable (encoder, index version) pair; every query runs on exactly one snapshot."""

    encoder: Encoder | None  # None: built from vectors, vector queries only
    checkpoint_sha256: str | None
    index: IndexVersion
    temperature: float
    block: int = DEFAULT_BLOCK
    normaliser: Normaliser | None = None  # None: exact
    runner: InferenceEncoder | None = field(default=None, repr=False)  # the encoder's serving forward
    read_item_metadata: ClassVar = staticmethod(read_metadata)  # version directory -> its Metadata
    release_pages: bool = True  # exact scan: unmap the map's pages once read
    normaliser_info: dict | None = None  # how log Z is computed (`Normaliser.describe`)
    _rows: dict = field(default_factory=dict, repr=False)  # id -> row, filled on first use
    _cache: dict = field(default_factory=dict, repr=False)  # lazily built dataset
    _lock: Any = field(default_factory=threading.Lock, repr=False)

    @property
    def version(self) -> str:
        return self.index.version

    @property
    def dim(self) -> int:
        return int(self.index.embeddings.shape[1])

    @property
    def count(self) -> int:
        return int(self.index.embeddings.shape[0])

    @property
    def manifest(self) -> Manifest:
        return self.index.manifest

    @property
    def rerank(self) -> int:
        """Candidates per hit re-scored exactly from the stored vectors: the manifest's `rerank` parameter,
        else RERANK_PQ for compressed (PQ) indexes, whose code order is not the exact order, and 1."""
        return rerank_factor(str(self.manifest.kind), self.manifest.params)

    def encode(self, images: Sequence[Image.Image | np.ndarray]) -> np.ndarray:
        """PIL images or (H, W, 3) uint8 RGB arrays -> unit embeddings (B, D) float32, one encoder forward.
        NoEncoderError on a version built from vectors."""
        if self.encoder is None:
            raise NoEncoderError(self.version)
        if len(images) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        if all(isinstance(im, np.ndarray) for im in images) and len({im.shape for im in images}) == 1:
            x = preprocess(np.stack(images), self.encoder.image_size)  # one vectorised resize for the batch
        else:
            x = preprocess(
                [im if isinstance(im, Image.Image) else Image.fromarray(im) for im in images],
                self.encoder.image_size,
            )  # (B, 3, S, S)
        runner = self.runner if self.runner is not None else InferenceEncoder(self.encoder, optimise=False)
        return runner(x)

    def resolve_temperatures(self, n: int, temperature: float | Sequence[float | None] | None) -> np.ndarray:
        """Per-query tau: the given value(s), None -> the manifest's search temperature."""
        if temperature is None:
            return np.full(n, self.temperature, dtype=np.float64)
        if isinstance(temperature, (int, float, np.floating)):
            temps = [temperature] * n
        else:
            temps = list(temperature)
            if len(temps) != n:
                raise ValueError(f"got {len(temps)} temperatures for {n} queries")
        out = np.array([self.temperature if t is None else float(t) for t in temps], dtype=np.float64)
        if n and (not np.all(np.isfinite(out)) or np.any(out <= 0)):
            raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
        return out

    def query_rows(self, vectors, unit: bool = False) -> np.ndarray:
        """(Q, dim) float32 unit query rows (cosine similarity): `vectors` as they are when `unit` says
        `unit_queries` already gave them (float32, 2-d), else checked and normalised by it."""
        if unit and isinstance(vectors, np.ndarray) and vectors.dtype == np.float32 and vectors.ndim == 2:
            return np.ascontiguousarray(vectors)
        return unit_queries(vectors, self.dim, "query vector")

    def search(
        self,
        vectors: np.ndarray,
        k: int,
        temperature: float | Sequence[float | None] | None = None,
        mask: np.ndarray | None = None,
        unit: bool = False,
    ) -> SearchAnswer:
        """Top-k of each query vector (normalised to unit length) with softmax probabilities over the
        whole index (log Z from the snapshot's normaliser: exact, or bounded with its bound).

        With `mask` ((N,) bool, from `filter_mask`) the search is restricted to those rows inside FAISS
        and p(j | x, F) = exp(s_j / tau) / sum_{l in F} exp(s_l / tau), log Z summed exactly over F.
        With `unit`, `vectors` are (Q, dim) float32 rows that `unit_queries` already gave (not checked again).
        """
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        q = self.query_rows(vectors, unit)
        taus = self.resolve_temperatures(q.shape[0], temperature)
        population = self.count if mask is None else int(np.count_nonzero(mask))
        k_eff = min(int(k), population)
        if q.shape[0] == 0 or k_eff == 0:
            return SearchAnswer(
                [[] for _ in range(q.shape[0])], self.version, taus.tolist(), [float("-inf")] * q.shape[0]
            )
        wanted = min(population, k_eff * self.rerank)  # candidates re-scored exactly below
        if mask is not None:  # filtered: selector inside FAISS, exact normaliser over the subset
            rows, log_z_subset = subset_search(self.index.index, self.index.embeddings, q, wanted, mask, taus)
            norm = LogZ.exact(log_z_subset, population)
        elif self.normaliser is None:  # exact: one pass over the rows gives log Z AND the exact top-k
            scan = self.scanner()(q, taus, k_eff)  # (search/serving/exact_scan.py; no index search needed)
            rows = scan.rows
            norm = LogZ.exact(scan.log_z, self.count)
        else:  # one index search serves the hits and the normaliser's exactly-summed top rows
            n_top = max(wanted, min(self.normaliser.config.top_rows, self.count))
            norm, top = self.normaliser.search_and_normalise(
                q, self.index.embeddings, taus, lambda: self.index.search(q, n_top)[1], self.block
            )
            rows = top[:, :wanted]
        log_z = norm.value  # (Q,)
        ids = self.index.ids
        emb = self.index.embeddings
        emb = emb.view(np.ndarray) if isinstance(emb, np.memmap) else emb  # same pages, no subclass overhead
        hits: list[list[Hit]] = []
        for i in range(q.shape[0]):
            r = rows[i][rows[i] >= 0].astype(np.int64)
            # exact similarities (the index may be approximate, e.g. PQ scores); same values
            # the normaliser summed, so probabilities are consistent with log Z. The candidates are
            # ranked by them (re-ranking: PQ order is not the exact order), then cut to k.
            s = emb[r] @ q[i]  # (k',)
            order = np.argsort(-s, kind="stable")[:k_eff]
            r, s = r[order], s[order]
            p = np.exp(s.astype(np.float64) / taus[i] - log_z[i])
            hits.append([Hit(ids[j], j, sj, pj) for j, sj, pj in zip(r.tolist(), s.tolist(), p.tolist())])
        return SearchAnswer(hits, self.version, taus.tolist(), log_z.tolist(), norm)

    def scanner(self) -> ExactScanner:
        """The exact scan over this version's rows (made once per snapshot)."""
        scanner = self._cache.get("scanner")
        if scanner is None:
            with self._lock:
                scanner = self._cache.get("scanner")
                if scanner is None:
                    scanner = self._cache["scanner"] = ExactScanner(
                        self.index.embeddings, release=self.release_pages
                    )
        return scanner

    # ---------------------------------------------------------------- metadata and filters
    @property
    def metadata_columns(self) -> MetadataColumns:
        """The version's per-item fields as row-aligned columns (read once, on first use)."""
        with self._lock:
            if "columns" not in self._cache:
                self._cache["columns"] = MetadataColumns.build(
                    self.read_item_metadata(self.index.path), self.index.ids
                )
            return self._cache["columns"]

    @property
    def metadata_fields(self) -> dict[str, str]:
        """{field: type} a filter may use on this version."""
        return dict(self.metadata_columns.types)

    def metadata_categories(self, limit: int = 100) -> dict[str, list[str]]:
        """The distinct values of each string field that has at most `limit` of them (e.g. `class`); computed
        once per snapshot (GET /v1/index asks on every page load)."""
        key = ("categories", limit)
        if key in self._cache:
            return self._cache[key]
        cols = self.metadata_columns
        out = {}
        for name, kind in cols.types.items():
            if kind == "str":
                values = np.unique(cols.values[name][cols.present[name]])
                if values.size <= limit:
                    out[name] = values.tolist()
        self._cache[key] = out
        return out

    def item_fields(self, row: int) -> dict:
        """The metadata fields of the item at `row` ({field: value}, missing ones left out)."""
        cols = self.metadata_columns
        out = {}
        for name, kind in cols.types.items():
            if cols.present[name][row]:
                value = cols.values[name][row]
                out[name] = {"str": str, "int": int, "float": float, "bool": bool}[kind](value)
        return out

    def filter_mask(self, flt: Filter) -> np.ndarray:
        """(N,) bool rows passing `flt` (the last FILTER_CACHE masks are kept: repeated filters are free)."""
        columns = self.metadata_columns
        with self._lock:
            masks = self._cache.setdefault("masks", {})
            if flt.key in masks:
                masks[flt.key] = masks.pop(flt.key)  # most recently used last
                return masks[flt.key]
        mask = flt.mask(columns)
        mask.flags.writeable = False
        with self._lock:
            masks[flt.key] = mask
            while len(masks) > FILTER_CACHE:
                masks.pop(next(iter(masks)))
        return mask

    # ---------------------------------------------------------------- items
    def row_of(self, item_id: str) -> int:
        """Row of an item id in this version; KeyError if absent."""
        if not self._rows:
            with self._lock:
                if not self._rows:
                    self._rows.update({iid: i for i, iid in enumerate(self.index.ids)})
        return self._rows[item_id]

    @property
    def file_backed(self) -> bool:
        """The indexed items came from image files (decoded once into the image cache), so uploads
        should be decoded the same way (training.images.load_square) to meet their indexed twins."""
        from training.datasets import dataset_is_file_backed  # the dataset registry: loaded on first use only

        return any(dataset_is_file_backed(spec) for spec in self.manifest.source_specs)

    def dataset_spec(self) -> dict | None:
        """The spec of the (first) dataset the version was built from, None for versions without one."""
        specs = self.manifest.source_specs
        return specs[0] if specs else None

    def _sources(self) -> dict:
        """id -> (dataset, index in it, its spec) over every dataset this version was built from (cached).

        Datasets are rebuilt from the manifest's specs (`sources`, else `dataset`)."""
        with self._lock:
            if "index_of" not in self._cache:
                specs = self.manifest.source_specs
                if not specs:
                    raise FileNotFoundError(f"index version {self.version} has no dataset spec")
                from training.datasets import create_dataset

                index_of: dict = {}
                for spec in specs:
                    ds = create_dataset(**spec)
                    for i, iid in enumerate(ds.item_ids()):
                        index_of.setdefault(iid, (ds, i, spec))  # each item names its own source
                self._cache["index_of"] = index_of
            return self._cache["index_of"]

    def item(self, item_id: str) -> ItemInfo:
        """Metadata of an indexed item; KeyError if the id is not in this version."""
        row = self.row_of(item_id)
        label = class_name = None
        spec = self.dataset_spec()
        try:
            ds, i, spec = self._sources().get(item_id, (None, None, spec))
            if ds is not None and getattr(ds, "labels", None) is not None:
                label = int(ds.labels[i])
                names = getattr(ds, "class_names", None)
                class_name = names[label] if names and 0 <= label < len(names) else None
        except (FileNotFoundError, ValueError, KeyError, ImportError) as err:
            logger.info("no dataset metadata for %s: %s", item_id, err)
        return ItemInfo(item_id, row, self.version, label, class_name, spec)

    def item_source(self, item_id: str) -> tuple[Any, int]:
        """(dataset, index in it) an indexed item comes from; KeyError if no source dataset holds it."""
        self.row_of(item_id)
        ds, i, _ = self._sources()[item_id]
        return ds, i

    def item_image(self, item_id: str) -> Image.Image:
        """The stored image of an indexed item, recovered from the manifest's dataset spec."""
        self.row_of(item_id)  # KeyError if not indexed
        ds, i, _ = self._sources()[item_id]  # KeyError if no source dataset holds it
        show = getattr(ds, "display_image", None)  # folders: the file itself, not the cached square
        return show(i) if show is not None else ds.image(i)


class Searcher:
    """Thread-safe search service core: encoder + active IndexVersion, hot-swappable.

    `Searcher(root)` opens the IndexStore at `root`; call `load()` (or pass `load=True`) to load
    the current version. Queries before that raise NotReadyError.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        device: str = "cpu",
        load: bool = False,
        block: int = DEFAULT_BLOCK,
        store: IndexStore | None = None,
        normaliser: NormaliserConfig | str | None = None,
        optimise_encoder: bool = True,
    ):
        if store is None and root is None:
            raise ValueError("Searcher needs an index root or an IndexStore")
        self.store = store if store is not None else IndexStore(root)
        self.device = device
        self.block = int(block)
        self.normaliser = NormaliserConfig.of(normaliser)  # exact | bounded | auto (default)
        self.optimise_encoder = bool(
            optimise_encoder
        )  # serve a traced copy of the encoder (search/serving/inference.py)
        self._state: SearchSnapshot | None = None
        self._swap_lock = threading.Lock()
        if load:
            self.load()

    @classmethod
    def from_parts(
        cls,
        encoder: Encoder,
        version: IndexVersion,
        *,
        checkpoint_sha: str | None = None,
        store: IndexStore | None = None,
        block: int = DEFAULT_BLOCK,
        normaliser: NormaliserConfig | str | None = None,
        optimise_encoder: bool = True,
    ) -> "Searcher":
        """A Searcher over an already-loaded encoder and index version (no disk reads)."""
        self = cls.__new__(cls)
        self.store, self.device, self.block = store, "cpu", int(block)
        self.normaliser = NormaliserConfig.of(normaliser)
        self.optimise_encoder = bool(optimise_encoder)
        self._swap_lock = threading.Lock()
        self._state = self._make_snapshot(encoder, checkpoint_sha, version)
        return self

    # ---------------------------------------------------------------- state
    @property
    def ready(self) -> bool:
        return self._state is not None

    @property
    def version(self) -> str | None:
        state = self._state
        return state.version if state is not None else None

    def snapshot(self) -> SearchSnapshot:
        """The current (encoder, version) pair; hold on to it for the whole query."""
        state = self._state  # one atomic read
        if state is None:
            raise NotReadyError("no index loaded yet")
        return state

    def _make_snapshot(
        self,
        encoder: Encoder | None,
        sha: str | None,
        version: IndexVersion,
        runner: InferenceEncoder | None = None,
    ) -> SearchSnapshot:
        if version.manifest.shards:  # a sharded version: fanned out to its shards, merged exactly
            return self._sharded_snapshot(encoder, sha, version, runner)
        dim = version.manifest.dim
        emb = version.embeddings
        if emb.ndim != 2 or (dim is not None and int(dim) != emb.shape[1]):
            raise ValueError(f"index version {version.version}: manifest dim {dim} != embeddings {emb.shape}")
        if encoder is not None and encoder.embed_dim != emb.shape[1]:
            raise ValueError(
                f"index version {version.version} has dimension {emb.shape[1]}, "
                f"the encoder produces {encoder.embed_dim}"
            )
        if len(version.ids) != emb.shape[0]:
            raise ValueError(
                f"index version {version.version}: {len(version.ids)} ids for {emb.shape[0]} rows"
            )
        # built off to the side like the rest of the snapshot (bounded: the version's stored list
        # statistics; one pass over the rows for a version written before they were stored)
        config = self.normaliser
        if "shard" in version.manifest.extra and config.probe:
            # a shard's `auto` goes by size alone: a timing probe could decide differently in each process
            # serving it (in process, each Ray replica), and their answers would then differ
            config = dataclasses.replace(config, probe=False)
        normaliser = Normaliser.for_version(
            emb,
            version.index,
            config,
            stored=getattr(version, "list_stats", None),
            index_recall=_index_recall(version.manifest),
            listed_path=version.path / LISTED_FILE if config.listed_shared else None,
        )
        if encoder is None:
            runner = None
        elif runner is None or runner.encoder is not encoder:
            runner = InferenceEncoder(encoder, optimise=self.optimise_encoder)
            logger.info("serving encoder: %s (built in %.2f s)", runner.kind, runner.build_s)
        return SearchSnapshot(
            encoder,
            sha,
            version,
            _manifest_temperature(version.manifest),
            self.block,
            normaliser if normaliser.method != "exact" else None,
            runner,
            release_pages=self.normaliser.releases("exact"),
            normaliser_info=normaliser.describe(),
        )

    def shard_searchers(self, version) -> tuple[list, list[str]]:
        """(callables (q, k, taus, mask) -> ShardAnswer, names), one per shard of a sharded version: in this
        process here; api/ray_serve.py fans out to Ray Serve deployments instead."""
        from search.serving.sharded import local_shards

        return local_shards(version, lambda shard: self._make_snapshot(None, None, shard))

    def _sharded_snapshot(
        self, encoder: Encoder | None, sha: str | None, version, runner: InferenceEncoder | None
    ) -> SearchSnapshot:
        from search.serving.sharded import sharded_snapshot

        if encoder is not None and encoder.embed_dim != version.manifest.dim:
            raise ValueError(
                f"index version {version.version} has dimension {version.manifest.dim}, "
                f"the encoder produces {encoder.embed_dim}"
            )
        if encoder is None:
            runner = None
        elif runner is None or runner.encoder is not encoder:
            runner = InferenceEncoder(encoder, optimise=self.optimise_encoder)
        shards, names = self.shard_searchers(version)
        return sharded_snapshot(
            dict(
                encoder=encoder,
                checkpoint_sha256=sha,
                temperature=_manifest_temperature(version.manifest),
                block=self.block,
                runner=runner,
            ),
            version,
            shards,
            names,
        )

    def _encoder_for(
        self, version: IndexVersion, old: SearchSnapshot | None
    ) -> tuple[Encoder | None, str | None, bool]:
        if not version.manifest.has_encoder:  # built from vectors: nothing to load
            return None, None, old is not None and old.encoder is not None
        sha = version.manifest.checkpoint_record.sha256
        if sha and old is not None and old.checkpoint_sha256 == sha:
            return old.encoder, sha, False
        encoder, _, sha = load_version_encoder(version, device=self.device)  # verified, from the store
        return encoder, sha, True

    def prepare(self, version: str | None = None) -> SearchSnapshot | None:
        """Load `version` (default: the store's current one) with its encoder into a snapshot that is
        not served yet (None when it is the one being served). Raises if it cannot be loaded."""
        old = self._state
        if self.store is None:
            raise ValueError("this Searcher has no IndexStore to reload from")
        if old is not None and (version or self.store.current_version()) == old.version:
            return None
        # serving processes that share the rows share the index's flat codes too (mapped, not copied)
        new_version = self.store.load(version, mmap_index=self.normaliser.listed_shared)
        if old is not None and new_version.version == old.version:
            return None
        encoder, sha, fresh = self._encoder_for(new_version, old)
        return self._make_snapshot(encoder, sha, new_version, None if fresh or old is None else old.runner)

    def install(self, state: SearchSnapshot | None) -> ReloadResult:
        """Serve a prepared snapshot (one attribute assignment; in-flight queries keep the old one)."""
        old = self._state
        if state is None:
            return ReloadResult(old.version, old.version, False, False)
        self._state = state  # the swap
        fresh = old is None or state.encoder is not old.encoder
        logger.info(
            "index version %s loaded (%d items, dim %d, tau %g, %s normaliser%s)",
            state.version,
            state.count,
            state.dim,
            state.temperature,
            "exact" if state.normaliser is None else state.normaliser.method,
            ", new encoder" if fresh else "",
        )
        return ReloadResult(old.version if old else None, state.version, True, fresh)

    def load(self, version: str | None = None) -> ReloadResult:
        """Load `version` (default: the store's current one) with its encoder and swap it in.

        Raises (keeping the old snapshot) if the version cannot be loaded or is incompatible.
        """
        with self._swap_lock:  # one reload at a time; queries never take this lock
            return self.install(self.prepare(version))

    reload = load

    # ---------------------------------------------------------------- queries
    def search_images(
        self, images: Sequence[Image.Image], k: int, temperature: float | Sequence[float | None] | None = None
    ) -> SearchAnswer:
        """Encode PIL images and search; one snapshot for the whole call."""
        state = self.snapshot()
        return (
            state.search(state.encode(images), k, temperature)
            if len(images)
            else SearchAnswer([], state.version, [], [])
        )

    def search_vectors(
        self, vectors: np.ndarray, k: int, temperature: float | Sequence[float | None] | None = None
    ) -> SearchAnswer:
        """Search with query embeddings (normalised to unit length here)."""
        return self.snapshot().search(vectors, k, temperature)

    def item(self, item_id: str) -> ItemInfo:
        return self.snapshot().item(item_id)

    def item_image(self, item_id: str) -> Image.Image:
        return self.snapshot().item_image(item_id)
