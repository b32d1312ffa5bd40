"""`softsearch eval`: retrieval metrics, the cross-entropy gap, calibration, the 1/k law, diagnostics.

Database: an index version (`--index ROOT [--version V]`: its embeddings, ids, manifest and
checkpoint) or a checkpoint plus a dataset (`--checkpoint C --dataset NAME --split S`, embedded
here). Queries: a held-out split (`--queries-dataset`, default the database's dataset, split
`test`), subsampled to `--max-queries`. With the instance generator the queries are augmented
views of database items (q is a point mass on the source: an approximation, said in the report).
Writes OUT/report.json and one self-contained OUT/report.html, prints a short table.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from index.build import training_temperature
from index.manifest import CheckpointRef, Manifest, file_sha256
from index.models import load_version_encoder
from index.store import IndexStore, require_store
from search.evaluation.baselines import (
    RAW_PIXELS,
    baseline_comparison,
    centred_unit,
    per_query_precision,
    raw_pixel_features,
    recipe_description,
)
from search.evaluation.calibration import calibrate_temperature
from search.evaluation.eval_args import build_parser
from search.evaluation.gap import ideal_and_learned, softmax_gap
from search.evaluation.k_law import DEFAULT_KS, PoolSampler, k_law, plot_k_law
from search.evaluation.metrics import bootstrap_ci, ideal_topk, knn_search, retrieval_metrics
from search.evaluation.normality import gaussianity, plot_qq
from search.evaluation.report import plot_gap_vs_tau, plot_samples, summary_table, write_report
from search.evaluation.tail import plot_daic, plot_tail, plot_threshold_stability, tail_diagnostics
from training.checkpoint import load_checkpoint
from training.datasets import create_dataset
from training.distributed import default_device
from training.generators import create_generator
from training.image_cache import summarise_skipped

logger = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    """Everything `softsearch eval` takes; see `build_parser` for the meaning of each field."""

    index: str | None = None
    version: str | None = None
    checkpoint: str | None = None
    dataset: str | None = None
    split: str = "train"
    data_root: str | None = None
    size: int | None = None
    dataset_seed: int = 0
    queries_dataset: str | None = None
    queries_split: str = "test"
    queries_root: str | None = None
    queries_size: int | None = None
    max_queries: int = 1000
    generator: str | None = None
    kappa: float | None = None
    temperature: float | None = None
    out: str = "eval_report"
    k_law: bool = True
    k_law_queries: int = 256
    k_law_db: int = 4096
    k_law_samples: int = 2000
    k_law_ks: tuple[int, ...] = DEFAULT_KS
    compare: str | None = None
    n_boot: int = 1000
    seed: int = 0
    batch_size: int = 256
    device: str | None = None
    n_samples: int = 3
    n_projections: int = 64
    mardia_null: int = 199
    tail_queries: int = 256


@dataclass
class EvalData:
    """Database and query side, shared by the main encoder and a --compare encoder."""

    datasets: list  # database source datasets
    rows: np.ndarray  # (N, 2) int64: db row -> (source, item index)
    db_meta: np.ndarray
    db_labels: np.ndarray | None
    query_images: torch.Tensor  # (Q, 3, S, S) preprocessed
    query_meta: np.ndarray
    query_labels: np.ndarray | None
    query_exclude: np.ndarray | None  # db row of each query when the queries are database items
    generator: object
    database_description: str
    queries_description: str
    queries_same_as_db: bool
    notes: list[str] = field(default_factory=list)
    query_skipped: list[dict] = field(default_factory=list)  # held-out files that could not be decoded


def _tensors(ds, idx: np.ndarray) -> torch.Tensor:
    if hasattr(ds, "tensors"):
        return ds.tensors(idx)
    return torch.stack([ds[int(i)] for i in idx])


def encode(encoder, images: torch.Tensor, batch_size: int, device) -> tuple[np.ndarray, np.ndarray]:
    """(unit embeddings z (N, D) float32, the tower's pre-normalisation features h (N, D_tower) float32);
    z = h / |h|, or with a pixel anchor the encoder's served embedding (training/encoder.py)."""
    zs, hs = [], []
    encoder.eval()
    with torch.inference_mode():
        for b0 in range(0, images.shape[0], batch_size):
            z, h = encoder(
                images[b0 : b0 + batch_size].to(device=device, dtype=torch.float32), return_features=True
            )  # (B, D), (B, D_tower)
            hs.append(h.float().cpu())
            zs.append(z.float().cpu())
    if not zs:
        d, dh = encoder.embed_dim, getattr(encoder, "tower_dim", encoder.embed_dim)
        return np.zeros((0, d), np.float32), np.zeros((0, dh), np.float32)
    return torch.cat(zs).numpy(), torch.cat(hs).numpy()


def _meta(ds, idx, generator_name: str, rows: np.ndarray | None = None) -> np.ndarray:
    if generator_name == "latent":
        if ds.latents is None:
            raise ValueError(f"the latent generator needs latents; dataset {ds.name!r} has none")
        return np.asarray(ds.latents)[idx]
    if generator_name == "label":
        if ds.labels is None:
            raise ValueError(f"the label generator needs labels; dataset {ds.name!r} has none")
        return np.asarray(ds.labels)[idx]
    if generator_name == "instance":
        assert rows is not None, "instance metadata are database rows"
        return rows
    raise ValueError(f"no metadata rule for generator {generator_name!r}")


def _make_generator(cfg: EvalConfig, ds):
    name = cfg.generator or ds.default_generator().name
    if name == "latent":
        kappa = cfg.kappa if cfg.kappa is not None else getattr(ds, "kappa", None)
        return create_generator("latent", **({} if kappa is None else {"kappa": kappa}))
    if cfg.kappa is not None:
        raise ValueError(f"--kappa applies to the latent generator only, not {name!r}")
    if cfg.generator is None:
        return ds.default_generator()
    return create_generator(name)


def load_eval_data(cfg: EvalConfig, db_datasets: list, rows, queries=None) -> EvalData:
    """Database metadata and the held-out query images for `db_datasets` indexed by `rows`.

    `queries` (an ImageDataset) overrides the query dataset named by `cfg`."""
    rng = np.random.default_rng(cfg.seed)
    ds0 = db_datasets[0]
    gen = _make_generator(cfg, ds0)
    gname = gen.name
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)  # (N, 2) (source, item); a list of pairs works too
    src, item = rows[:, 0], rows[:, 1]
    n = len(rows)
    parts_meta, parts_lab = [], []
    for s, ds in enumerate(db_datasets):
        sel = src == s
        parts_meta.append((np.flatnonzero(sel), _meta(ds, item[sel], gname, np.flatnonzero(sel))))
        parts_lab.append(
            (np.flatnonzero(sel), None if ds.labels is None else np.asarray(ds.labels)[item[sel]])
        )
    first = parts_meta[0][1]
    db_meta = np.empty((n,) + first.shape[1:], dtype=first.dtype)
    for where, m in parts_meta:
        db_meta[where] = m
    db_labels = None
    if all(lab is not None for _, lab in parts_lab):
        db_labels = np.empty(n, dtype=np.int64)
        for where, lab in parts_lab:
            db_labels[where] = lab
    db_desc = ", ".join(f"{ds.name}/{ds.split}" for ds in db_datasets)
    notes: list[str] = []

    if gname == "instance":
        # queries: augmented views of random database items; the positive is the source row
        q_rows = np.sort(rng.choice(n, min(cfg.max_queries, n), replace=False))
        images = []
        for s, ds in enumerate(db_datasets):
            sel = q_rows[src[q_rows] == s]
            if sel.size:
                images.append((sel, gen.sample_pairs(ds, item[sel], rng)[1]))
        order = np.concatenate([sel for sel, _ in images])
        imgs = torch.cat([im for _, im in images])[np.argsort(order)]
        notes.append(
            "instance generator: queries are augmented views of database items; q is a point mass on "
            "the source item (approximation)"
        )
        return EvalData(
            db_datasets,
            rows,
            db_meta,
            db_labels,
            imgs,
            q_rows,
            None if db_labels is None else db_labels[q_rows],
            None,
            gen,
            db_desc,
            f"augmented views of {q_rows.size} database items",
            False,
            notes,
        )

    if queries is not None:
        qds = queries
    elif cfg.queries_dataset is None or cfg.queries_dataset == ds0.name:
        spec = dict(ds0.spec())
        spec.update(split=cfg.queries_split, size=cfg.queries_size)
        if cfg.queries_root is not None:
            spec["root"] = cfg.queries_root
    else:
        spec = {
            "name": cfg.queries_dataset,
            "split": cfg.queries_split,
            "root": cfg.queries_root,
            "size": cfg.queries_size,
            "seed": getattr(ds0, "seed", 0),
        }
    if queries is None:
        try:
            qds = create_dataset(**spec)
        except ValueError as err:
            if cfg.queries_dataset is not None:
                raise
            # e.g. a folder dataset has only the split "all": query with the database items themselves
            logger.warning(
                "no held-out %r split for %s (%s): using the database items as queries",
                cfg.queries_split,
                ds0.name,
                err,
            )
            notes.append(f"no held-out split {cfg.queries_split!r}: the queries are database items")
            qds = ds0
    same = [s for s, ds in enumerate(db_datasets) if ds.fingerprint() == qds.fingerprint()]
    q_idx = np.sort(rng.choice(len(qds), min(cfg.max_queries, len(qds)), replace=False))
    exclude = None
    if same:
        # the queries are database items: leave each query's own row out of its neighbour list
        row_of = np.full(len(db_datasets[same[0]]), -1, dtype=np.int64)  # item of that source -> db row
        where = np.flatnonzero(src == same[0])
        row_of[item[where]] = where
        exclude = row_of[q_idx]
        notes.append(
            "queries are items of the database: their own rows are excluded from the neighbour lists "
            "(the gap keeps them)"
        )
    q_meta = _meta(qds, q_idx, gname, exclude)
    q_labels = None if qds.labels is None else np.asarray(qds.labels)[q_idx]
    q_skipped = [] if same else list(getattr(qds, "skipped", None) or [])
    if q_skipped:
        notes.append(
            f"{len(q_skipped)} held-out file(s) skipped ({summarise_skipped(q_skipped)}); "
            "listed under queries.skipped_files"
        )
    return EvalData(
        db_datasets,
        rows,
        db_meta,
        db_labels,
        _tensors(qds, q_idx),
        q_meta,
        q_labels,
        exclude,
        gen,
        db_desc,
        f"{qds.name}/{qds.split} ({q_idx.size} of {len(qds)})",
        bool(same),
        notes,
        q_skipped,
    )


def _ideal_recall(zq, zdb, data: EvalData, ks=(1, 5, 10), n_boot=1000, seed=0, device=None) -> dict:
    """Overlap of the learned top-k with the ideal top-k (by log r), with bootstrap CIs."""
    kmax = min(max(ks), zdb.shape[0] - (1 if data.query_exclude is not None else 0))
    _, learned = knn_search(zq, zdb, kmax, exclude=data.query_exclude, device=device)
    ideal = ideal_topk(data.query_meta, data.db_meta, data.generator, kmax, exclude=data.query_exclude)
    out: dict = {"n_queries": int(zq.shape[0]), "alpha": 0.05, "n_boot": n_boot}
    for k in ks:
        kk = min(k, kmax)
        per_q = np.array([np.intersect1d(a[:kk], b[:kk]).size / kk for a, b in zip(learned, ideal)])
        mean, lo, hi = bootstrap_ci(per_q, n_boot, 0.05, seed)
        out[f"ideal_recall@{k}"] = {"mean": mean, "low": lo, "high": hi}
    return out


def evaluate_embeddings(
    cfg: EvalConfig,
    data: EvalData,
    zdb: np.ndarray,
    zq: np.ndarray,
    hq: np.ndarray | None,
    train_tau: float,
    serving_tau: float,
    full: bool = True,
) -> tuple[dict, dict]:
    """All numbers for one encoder's embeddings -> (report part, figures)."""
    dev = default_device(cfg.device)
    rep: dict = {}
    figs: dict = {}
    gen = data.generator
    t0 = time.perf_counter()
    if data.query_labels is not None and data.db_labels is not None:
        rep["metrics"] = retrieval_metrics(
            zq,
            zdb,
            data.query_labels,
            data.db_labels,
            exclude=data.query_exclude,
            n_boot=cfg.n_boot,
            seed=cfg.seed,
            device=dev,
        )
        rep["metrics_note"] = "relevance = same class label"
    else:
        rep["metrics"] = _ideal_recall(zq, zdb, data, n_boot=cfg.n_boot, seed=cfg.seed, device=dev)
        rep["metrics_note"] = (
            "no labels: ideal_recall@k = fraction of the ideal top-k (by log r) in the learned top-k"
        )
    gap_serving = softmax_gap(zq, zdb, data.query_meta, data.db_meta, gen, serving_tau, device=dev)
    cal = calibrate_temperature(
        zq, zdb, data.query_meta, data.db_meta, gen, train_temperature=train_tau, device=dev
    )
    rep["gap"] = {
        "serving": gap_serving.summary(),
        "training": cal.gap_at_train,
        "calibrated": cal.gap_at_calibrated,
    }
    rep["calibration"] = cal.to_dict()
    rep["temperatures"] = {"serving": serving_tau, "train": train_tau, "calibrated": cal.temperature}
    logger.info("metrics + gap + calibration in %.1f s", time.perf_counter() - t0)
    if not full:
        return rep, figs
    figs["gap_vs_tau"] = plot_gap_vs_tau(cal.curve_tau, cal.curve_kl, cal.temperature, train_tau, serving_tau)
    ns = min(cfg.n_samples, zq.shape[0])
    q, p = ideal_and_learned(zq[:ns], zdb, data.query_meta[:ns], data.db_meta, gen, serving_tau)
    figs["samples"] = plot_samples(q, p, [f"query {i}: KL={gap_serving.kl[i]:.3f}" for i in range(ns)])

    rng = np.random.default_rng(cfg.seed)
    kq = np.sort(rng.choice(zq.shape[0], min(cfg.k_law_queries, zq.shape[0]), replace=False))
    kd = np.sort(rng.choice(zdb.shape[0], min(cfg.k_law_db, zdb.shape[0]), replace=False))
    if not cfg.k_law:
        rep["k_law"], rep["k_law_note"] = None, "disabled (--no-k-law)"
    elif gen.name == "instance":
        rep["k_law"], rep["k_law_note"] = (
            None,
            (
                "not applicable to the instance generator: its point-mass r is "
                "zero on almost every random database"
            ),
        )
    else:
        sampler = PoolSampler(zq[kq], data.query_meta[kq], zdb[kd], data.db_meta[kd], gen, serving_tau)
        kl = k_law(sampler, ks=cfg.k_law_ks, n_queries=cfg.k_law_samples, seed=cfg.seed)
        rep["k_law"] = kl.to_dict()
        rep["k_law_note"] = (
            f"pool resampling: {kq.size} held-out queries x {kd.size} database items, "
            f"{cfg.k_law_samples} draws per k, tau={serving_tau:.4g}"
        )
        figs["k_law"] = plot_k_law(kl)

    if hq is not None and hq.shape[0] >= 8:
        rep["gaussianity"] = gaussianity(
            hq, n_projections=cfg.n_projections, n_null=cfg.mardia_null, seed=cfg.seed
        )
        proj = hq @ rng.normal(size=hq.shape[1])
        figs["qq"] = plot_qq(
            {
                "coordinate 0": hq[:, 0],
                "coordinate 1": hq[:, 1 % hq.shape[1]],
                "random projection": proj,
                "norm |h|": np.linalg.norm(hq, axis=1),
            }
        )
    tq = kq[: min(kq.size, cfg.tail_queries)]
    try:
        neg, rule = negative_pairs(
            gen,
            data.query_meta[tq],
            data.db_meta[kd],
            None if data.query_exclude is None else data.query_exclude[tq],
            kd,
        )
        tail = tail_diagnostics(zq[tq], zdb[kd], neg, n_boot=min(200, cfg.n_boot), seed=cfg.seed)
        figs["threshold_stability"] = plot_threshold_stability(tail["gpd"])
        figs["tail"] = plot_tail(tail)
        if tail["weibull_gumbel"]:
            figs["daic"] = plot_daic(tail["weibull_gumbel"]["daic_values"])
        rep["tail"] = {k: v for k, v in tail.items() if k != "exceedances"}
        rep["tail"]["negatives_rule"] = rule
    except ValueError as err:
        logger.warning("tail diagnostics skipped: %s", err)
        rep["tail"] = None
    return rep, figs


def negative_pairs(gen, query_meta, db_meta, query_rows=None, db_rows=None) -> tuple[np.ndarray, str]:
    """(Q, N) bool mask of the pairs that are negatives for the tail statistics, and the rule in words.

    Generators with a support (label, instance, neighbour: r = 0 off it): negatives are the pairs with r = 0.
    The latent generator has r > 0 everywhere: negatives are the pairs with r <= 1, i.e. y is no likelier
    as x's positive than as a random draw. A query that is itself a database item never counts its own row."""
    log_r = np.asarray(gen.log_ratio(query_meta, db_meta), np.float64)
    if gen.name == "latent":
        mask, rule = log_r <= 0.0, "pairs with r(x, y) <= 1 (y no likelier as a positive of x than at random)"
    else:
        mask, rule = np.isneginf(log_r), "pairs with r(x, y) = 0 (outside the generator's positives)"
    if query_rows is not None and db_rows is not None:
        mask &= np.asarray(query_rows)[:, None] != np.asarray(db_rows)[None, :]
        rule += "; a query's own database row excluded"
    return mask, rule


def version_database(version) -> tuple[list, np.ndarray]:
    """Rebuild an index version's source datasets from its manifest -> (datasets, (N, 2) int64 array:
    db row -> (source, item)). When the version's ids are its one dataset's ids in order (every
    `index build` of one dataset), the rows are that order, without an id -> item table (at N = 10^6
    the table and its tuples alone held ~200 MB)."""
    sources = version.manifest.sources or []
    datasets = []
    for s in sources:
        ds = create_dataset(**s["spec"])
        if s.get("fingerprint") and ds.fingerprint() != s["fingerprint"]:
            raise ValueError(
                f"dataset {s['spec']} no longer matches the index's fingerprint {s['fingerprint'][:12]}"
            )
        datasets.append(ds)
    if len(datasets) == 1 and len(datasets[0]) == len(version.ids) and datasets[0].item_ids() == version.ids:
        rows = np.zeros((len(version.ids), 2), dtype=np.int64)
        rows[:, 1] = np.arange(len(version.ids))
        return datasets, rows
    lookup: dict[str, tuple[int, int]] = {}
    for si, ds in enumerate(datasets):
        for i, item_id in enumerate(ds.item_ids()):
            lookup.setdefault(item_id, (si, i))
    missing = [i for i in version.ids if i not in lookup]
    if missing:
        raise ValueError(f"{len(missing)} index ids are not in the manifest's datasets, e.g. {missing[0]!r}")
    return datasets, np.array([lookup[i] for i in version.ids], dtype=np.int64).reshape(-1, 2)


def _load_database(cfg: EvalConfig, device):
    """-> (encoder, info, checkpoint path, db embeddings or None, datasets, rows, index dict or None,
    manifest)."""
    if cfg.index is not None:
        if cfg.checkpoint is not None or cfg.dataset is not None:
            raise ValueError(
                "--index takes its checkpoint and dataset from the manifest; drop --checkpoint/--dataset"
            )
        store = IndexStore(require_store(cfg.index))
        version = store.load(cfg.version, verify=True, gpu=False)
        manifest = version.manifest
        datasets, rows = version_database(version)
        encoder, info, _ = load_version_encoder(version, device=device)  # the store's own copy of the weights
        ckpt = store.models.path(manifest.checkpoint_record.sha256)
        return (
            encoder,
            info,
            ckpt,
            version.embeddings,
            datasets,
            rows,
            {"root": display_path(cfg.index), "version": version.version},
            manifest,
        )
    if cfg.checkpoint is None or cfg.dataset is None:
        raise ValueError("give --index ROOT, or --checkpoint C with --dataset NAME")
    ckpt = Path(cfg.checkpoint)
    encoder, info = load_checkpoint(ckpt, device=device)
    ds = create_dataset(cfg.dataset, cfg.split, root=cfg.data_root, size=cfg.size, seed=cfg.dataset_seed)
    rows = np.stack([np.zeros(len(ds), np.int64), np.arange(len(ds), dtype=np.int64)], axis=1)  # (N, 2)
    return encoder, info, ckpt, None, [ds], rows, None, None


def _embed_db(encoder, data: EvalData, cfg: EvalConfig, device) -> np.ndarray:
    out = np.empty((len(data.rows), encoder.embed_dim), dtype=np.float32)
    src, item = data.rows[:, 0], data.rows[:, 1]
    for s, ds in enumerate(data.datasets):
        where = np.flatnonzero(src == s)
        for b0 in range(0, where.size, 4096):
            sel = where[b0 : b0 + 4096]
            out[sel] = encode(encoder, _tensors(ds, item[sel]), cfg.batch_size, device)[0]
    return out


def run_evaluation(cfg: EvalConfig) -> tuple[dict, dict]:
    """Evaluate per `cfg` -> (report dict, figures {name: PNG bytes}); nothing is written."""
    if cfg.max_queries < 2:
        raise ValueError(f"--max-queries must be >= 2, got {cfg.max_queries}")
    if cfg.temperature is not None and not cfg.temperature > 0:
        raise ValueError(f"--temperature must be positive, got {cfg.temperature}")
    device = default_device(cfg.device)
    encoder, info, ckpt, zdb, datasets, rows, index_info, manifest = _load_database(cfg, device)
    data = load_eval_data(cfg, datasets, rows)
    if zdb is None:
        zdb = _embed_db(encoder, data, cfg, device)
    zq, hq = encode(encoder, data.query_images, cfg.batch_size, device)
    train_tau, train_src = training_temperature(info)
    if cfg.temperature is not None:
        serving_tau, serving_src = float(cfg.temperature), "command line"
    elif manifest is not None and manifest.temperature is not None:
        serving_tau = manifest.temperature
        serving_src = f"index manifest ({manifest.search_temperature_source or 'search_temperature'})"
    else:
        serving_tau, serving_src = train_tau, train_src
    part, figs = evaluate_embeddings(cfg, data, zdb, zq, hq, train_tau, serving_tau)
    gen = data.generator
    report = {
        "checkpoint": checkpoint_description(ckpt, info, manifest),
        "index": index_info,
        "settings": {
            "embed_dim": int(zdb.shape[1]),
            "n_boot": cfg.n_boot,
            "seed": cfg.seed,
            "n_projections": cfg.n_projections,
            "mardia_null": cfg.mardia_null,
            "k_law_samples": cfg.k_law_samples,
            "tail_queries": cfg.tail_queries,
        },
        "database": {
            "description": data.database_description,
            "count": int(zdb.shape[0]),
            "datasets": [ds.spec() for ds in datasets],
            "skipped": sum(len(getattr(ds, "skipped", None) or []) for ds in datasets),
        },
        "queries": {
            "description": data.queries_description,
            "count": int(zq.shape[0]),
            "same_as_database": data.queries_same_as_db,
            "skipped": len(data.query_skipped),
            "skipped_files": data.query_skipped,
        },
        "generator": {
            "name": gen.name,
            "exact": bool(gen.exact),
            "description": gen.description,
            "options": gen.options() if hasattr(gen, "options") else {},
        },
        "temperature_sources": {"serving": serving_src, "train": train_src},
        "notes": data.notes,
        **part,
    }
    compared = None
    if cfg.compare is not None:
        report["compare"] = _compare(cfg, data, part, device)
        compared = report["compare"].pop("embeddings")
    if data.query_labels is not None and data.db_labels is not None:
        report["baselines"] = _baselines(cfg, data, zdb, zq, compared, device, recipe_description(info))
    return report, figs


def _raw_pixel_db(data: EvalData) -> np.ndarray:
    """Raw-pixel features of every database item, in database row order."""
    src, item = data.rows[:, 0], data.rows[:, 1]
    out = None
    for s, ds in enumerate(data.datasets):
        where = np.flatnonzero(src == s)
        for b0 in range(0, where.size, 4096):
            sel = where[b0 : b0 + 4096]
            feats = raw_pixel_features(_tensors(ds, item[sel]))
            if out is None:
                out = np.empty((len(data.rows), feats.shape[1]), np.float32)
            out[sel] = feats
    return out


def _baselines(cfg: EvalConfig, data: EvalData, zdb, zq, compared, device, recipe: str | None = None) -> dict:
    """The trained encoder against raw pixels (and the --compare checkpoint): paired label precision; the
    verdict names the training recipe."""
    ks = (10, 1)

    def precisions(q, db):
        return tuple(
            per_query_precision(q, db, data.query_labels, data.db_labels, k, data.query_exclude, device)
            for k in ks
        )

    pix_db, pix_q = centred_unit(_raw_pixel_db(data), raw_pixel_features(data.query_images))
    rows = {RAW_PIXELS: precisions(pix_q, pix_db)}
    if compared is not None:
        rows["compared checkpoint (--compare)"] = precisions(compared[1], compared[0])
    return baseline_comparison(
        rows, precisions(zq, zdb), ks=ks, n_boot=cfg.n_boot, seed=cfg.seed, recipe=recipe
    )


def _compare(cfg: EvalConfig, data: EvalData, this: dict, device) -> dict:
    """Evaluate a second checkpoint on the same database items and queries: a before/after table."""
    enc2, info2 = load_checkpoint(cfg.compare, device=device)
    zdb2 = _embed_db(enc2, data, cfg, device)
    zq2, _ = encode(enc2, data.query_images, cfg.batch_size, device)
    tau2, _ = training_temperature(info2)
    serving2 = float(cfg.temperature) if cfg.temperature is not None else tau2
    other, _ = evaluate_embeddings(cfg, data, zdb2, zq2, None, tau2, serving2, full=False)
    rows = {}
    for name, v in this["metrics"].items():
        if isinstance(v, dict) and "mean" in v:
            rows[name] = {"this": v["mean"], "other": other["metrics"][name]["mean"]}
    for label in ("serving", "training", "calibrated"):
        rows[f"KL @ {label} tau"] = {"this": this["gap"][label]["kl"], "other": other["gap"][label]["kl"]}
        rows[f"H(q,p) @ {label} tau"] = {
            "this": this["gap"][label]["cross_entropy"],
            "other": other["gap"][label]["cross_entropy"],
        }
    rows["calibrated tau"] = {
        "this": this["temperatures"]["calibrated"],
        "other": other["temperatures"]["calibrated"],
    }
    rows["training tau"] = {"this": this["temperatures"]["train"], "other": other["temperatures"]["train"]}
    return {
        "checkpoint": checkpoint_description(cfg.compare, info2),
        "rows": rows,
        "other": other,
        "embeddings": (zdb2, zq2),
    }


def display_path(path) -> str:
    """A path for a report: as given when relative, relative to the working directory when under it, else its
    name."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return p.name


def checkpoint_description(path, info: dict, manifest: Manifest | None = None) -> dict:
    """The encoder as a report names it: file name, sha256, step and the training settings that shape the
    statistics (loss, temperature schedule, Gaussianity regulariser weight); never an absolute path."""
    record = manifest.checkpoint_record if manifest is not None else CheckpointRef()
    tc = info.get("train_config") or {}
    return {
        "file": Path(record.path or path).name,
        "sha256": record.sha256 or file_sha256(path),
        "step": info.get("step", record.step),
        "training": {
            k: tc.get(k)
            for k in (
                "loss",
                "schedule",
                "schedule_options",
                "steps",
                "batch_size",
                "gaussian_reg",
                "gaussian_reg_decay",
            )
            if k in tc
        },
    }


def main(argv: list[str] | None = None) -> int:
    """`softsearch eval ...`: writes OUT/report.json and OUT/report.html, prints a summary table."""
    args = build_parser().parse_args(argv)
    cfg = EvalConfig(**vars(args))
    report, figs = run_evaluation(cfg)
    jpath, hpath = write_report(cfg.out, report, figs)
    print(summary_table(report))
    print(f"wrote {jpath} and {hpath}")
    return 0
