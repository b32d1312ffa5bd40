"""Index quality gate: score a candidate index version against the serving one on held-out queries.

`evaluate_version(candidate, serving)` is the `evaluator` that `index.build.build_index` calls
(index/ cannot import search/, so `api/cli.py` injects it). Each version is scored with its own
encoder (the store's model the manifest names) and its own search temperature, on the same query images.
Scores (higher is better):
- "neg_gap": -mean KL(q || p) on the held-out queries, when the generator's r is exact
  (latent, label) -- the quantity softsearch is about (the server's normaliser is exact over every
  stored row, so this does not depend on the FAISS index);
- "recall_at_10": label recall@10 (or ideal-neighbour recall@10 without labels) of the neighbours
  the version SERVES: its own FAISS index at its tuned search parameters, through
  `IndexVersion.search` (the call the server makes), not exact kNN.
Both are always reported, with the exact-kNN figure beside the served one (`exact_recall_at_10`);
"metric" says which one the gate compares. `index_recall` is the recall@10 of each version's
FAISS index against exact kNN on the same held-out queries: the activation rule compares the
candidate's with the version's --target-recall (index.gate.recall_check).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from index import faiss_index
from index.manifest import DEFAULT_TEMPERATURE
from index.models import load_version_encoder
from search.evaluation.calibration import calibrate_temperature
from search.evaluation.evaluate import EvalConfig, encode, load_eval_data, version_database
from search.evaluation.gap import softmax_gap
from search.evaluation.metrics import hit_rate_at_k, ideal_topk, knn_search, relevance
from training.distributed import default_device

logger = logging.getLogger(__name__)


def _embedded_queries(version, cfg: EvalConfig, queries, device):
    """(eval data, query embeddings, database embeddings) of one IndexVersion, with its own encoder."""
    datasets, rows = version_database(version)
    data = load_eval_data(cfg, datasets, rows, queries=queries)
    encoder, _, _ = load_version_encoder(version, device=device)
    zq, _ = encode(encoder, data.query_images, cfg.batch_size, device)
    return data, zq, np.asarray(version.embeddings)


def _served_rows(version, zq: np.ndarray, k: int, exclude: np.ndarray | None) -> np.ndarray:
    """(Q, k) rows the version serves (its FAISS index at the tuned parameters, PQ candidates re-ranked
    exactly from the stored rows by the manifest's `rerank`, as the server does), -1 = none; a query's own
    row (`exclude[q]`, queries drawn from the database) is dropped as exact kNN drops it."""
    rerank = faiss_index.rerank_factor(version.kind, version.manifest.params)
    _, rows = faiss_index.search_reranked(
        version.index,
        version.embeddings,
        np.ascontiguousarray(zq, dtype=np.float32),
        k + (exclude is not None),
        rerank,
    )
    out = np.full((rows.shape[0], k), -1, np.int64)
    for q, r in enumerate(rows):
        kept = r[(r >= 0) & (r != (exclude[q] if exclude is not None else -2))][:k]
        out[q, : len(kept)] = kept
    return out


def _score_version(version, cfg: EvalConfig, queries, device) -> dict:
    """recall@10 (exact and through the served index), the index's own recall@10 and the gap at the
    version's search temperature for one IndexVersion."""
    data, zq, zdb = _embedded_queries(version, cfg, queries, device)
    tau = float(cfg.temperature or version.manifest.temperature or DEFAULT_TEMPERATURE)
    k = min(10, zdb.shape[0] - (1 if data.query_exclude is not None else 0))
    exclude = None if data.query_exclude is None else np.asarray(data.query_exclude, np.int64)
    _, exact = knn_search(zq, zdb, k, exclude=data.query_exclude, device=device)
    served = _served_rows(version, zq, k, exclude)
    if data.query_labels is not None and data.db_labels is not None:

        def recall_of(rows):
            rel = relevance(np.where(rows >= 0, rows, 0), data.query_labels, data.db_labels) & (rows >= 0)
            return float(hit_rate_at_k(rel, k).mean())

        recall_kind = "label recall@10"
    else:
        ideal = ideal_topk(data.query_meta, data.db_meta, data.generator, k, exclude=data.query_exclude)

        def recall_of(rows):
            return faiss_index.recall_at_k(rows, ideal, k)

        recall_kind = "ideal-neighbour recall@10"
    gap = softmax_gap(zq, zdb, data.query_meta, data.db_meta, data.generator, tau, device=device).summary()
    return {
        "version": version.version,
        "recall_at_10": recall_of(served),
        "exact_recall_at_10": recall_of(exact),
        "recall_kind": recall_kind,
        "index_recall_at_10": faiss_index.recall_at_k(served, exact, k),
        "kind": version.kind,
        "params": dict(version.manifest.params or {}),
        "gap": gap["kl"],
        "gap_se": gap["kl_se"],
        "cross_entropy": gap["cross_entropy"],
        "temperature": tau,
        "generator": data.generator.name,
        "exact": bool(data.generator.exact),
        "n_queries": int(zq.shape[0]),
        "skipped_queries": len(data.query_skipped),
    }


def evaluate_version(
    candidate,
    serving=None,
    queries=None,
    *,
    metric: str = "auto",
    max_queries: int = 500,
    generator: str | None = None,
    temperature: float | None = None,
    seed: int = 0,
    batch_size: int = 256,
    device=None,
) -> dict:
    """Quality-gate comparison of two IndexVersions -> {"metric", "candidate", "serving", "ok", ...}.

    `queries`: held-out ImageDataset (default: the candidate's first dataset, split "test", or its
    own items when that split does not exist). `metric`: "auto" | "neg_gap" | "recall_at_10".
    `temperature` overrides both versions' manifest search temperatures.
    """
    if metric not in ("auto", "neg_gap", "recall_at_10"):
        raise ValueError(f"metric must be 'auto', 'neg_gap' or 'recall_at_10', got {metric!r}")
    t0 = time.perf_counter()
    dev = default_device(device)
    cfg = EvalConfig(
        max_queries=max_queries,
        generator=generator,
        temperature=temperature,
        seed=seed,
        batch_size=batch_size,
        device=None if device is None else str(device),
    )
    if queries is None:
        queries = _default_queries(candidate, cfg)
    cand = _score_version(candidate, cfg, queries, dev)
    serv = _score_version(serving, cfg, queries, dev) if serving is not None else None
    if metric == "auto":
        metric = "neg_gap" if cand["exact"] and np.isfinite(cand["gap"]) else "recall_at_10"

    def score(r):
        return None if r is None else (-r["gap"] if metric == "neg_gap" else r["recall_at_10"])

    out = {
        "metric": metric,
        "candidate": score(cand),
        "serving": score(serv),
        "recall_at_10": {
            "candidate": cand["recall_at_10"],
            "serving": None if serv is None else serv["recall_at_10"],
        },
        "exact_recall_at_10": {
            "candidate": cand["exact_recall_at_10"],
            "serving": None if serv is None else serv["exact_recall_at_10"],
        },
        "index_recall": {
            role: None
            if r is None
            else {
                "recall": r["index_recall_at_10"],
                "n_queries": r["n_queries"],
                "kind": r["kind"],
                "params": r["params"],
            }
            for role, r in (("candidate", cand), ("serving", serv))
        },
        "gap": {"candidate": cand["gap"], "serving": None if serv is None else serv["gap"]},
        "details": {"candidate": cand, "serving": serv},
        "seconds": time.perf_counter() - t0,
    }
    out["ok"] = bool(serv is None or out["candidate"] >= out["serving"])
    logger.info(
        "quality gate (%s): candidate %.4g vs serving %s",
        metric,
        out["candidate"],
        "-" if serv is None else f"{out['serving']:.4g}",
    )
    return out


def calibrate_version(
    candidate,
    queries=None,
    *,
    max_queries: int = 500,
    generator: str | None = None,
    seed: int = 0,
    batch_size: int = 256,
    device=None,
) -> dict | None:
    """Search temperature for a new index version: argmin over tau of held-out H(q, p).

    `index.build` calls this (injected by `api/cli.py`) before the quality gate and stores
    `temperature` as the manifest's `search_temperature`, which the API uses for probabilities.
    Returns None when the generator gives no finite gap (nothing to calibrate against).
    """
    dev = default_device(device)
    cfg = EvalConfig(
        max_queries=max_queries,
        generator=generator,
        seed=seed,
        batch_size=batch_size,
        device=None if device is None else str(device),
    )
    if queries is None:
        queries = _default_queries(candidate, cfg)
    data, zq, zdb = _embedded_queries(candidate, cfg, queries, dev)
    train_tau = float(candidate.manifest.temperature or DEFAULT_TEMPERATURE)
    result = calibrate_temperature(
        zq, zdb, data.query_meta, data.db_meta, data.generator, train_temperature=train_tau, device=dev
    )
    if not np.isfinite(result.gap_at_calibrated["kl"]):
        return None
    return {
        "temperature": result.temperature,
        "train_temperature": train_tau,
        "gap_at_train": result.gap_at_train["kl"],
        "gap_at_calibrated": result.gap_at_calibrated["kl"],
        "generator": data.generator.name,
        "exact": bool(data.generator.exact),
        "n_queries": int(zq.shape[0]),
        "skipped_queries": len(data.query_skipped),
    }


def _default_queries(version, cfg: EvalConfig):
    """The held-out split of the version's first dataset, or None (-> its own items) when there is none."""
    from training.datasets import create_dataset

    datasets, _ = version_database(version)
    spec = dict(datasets[0].spec())
    if spec.get("split") == "test":
        return datasets[0]
    spec.update(split="test", size=None)
    try:
        return create_dataset(**spec)
    except (ValueError, FileNotFoundError) as err:
        logger.warning(
            "no held-out split for %s (%s): using the database items as queries", spec.get("name"), err
        )
        return datasets[0]
