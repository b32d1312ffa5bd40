"""Text-to-image evaluation: the exact cross-entropy gap and recall of caption queries.

For synthetic captions (training/captions.py) the ideal search is known exactly: q(j | c) is
uniform over the database items in the caption's cell. The learned search is the softmax over
the database of s(c, y_j) / tau, s = z_text . z_image. `text_gap` computes H(q, p), H(q) and
KL(q || p) per caption with the same streaming code as image queries (search/evaluation/gap.py).
Recall@k is the fraction of captions whose own image is among the k best; hit@k the fraction
with any image of the caption's cell there.

`softsearch eval --text --checkpoint C` embeds the held-out synthetic split with both towers of
an image-text checkpoint, calibrates the text temperature (argmin of H(q, p) on half the
captions) and reports gap and recall on the other half. `calibrate_text_version` does the same
for an index version being built, so its manifest carries the text temperature the API uses.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import numpy as np

from search.evaluation.calibration import calibrate_temperature
from search.evaluation.eval_args import build_text_parser
from search.evaluation.gap import GapResult, softmax_gap
from search.evaluation.metrics import knn_search
from training.captions import TEMPLATES, CaptionIdeal, CaptionScheme

logger = logging.getLogger(__name__)

__all__ = [
    "text_gap",
    "text_recall",
    "caption_queries",
    "evaluate_text",
    "calibrate_text_version",
    "main",
    "DEFAULT_SCHEME",
    "store_text_calibration",
]

DEFAULT_SCHEME = CaptionScheme()
_QUERY_TAG = 0x7E47  # separates the caption-template stream from other uses of the seed


def caption_queries(
    scheme: CaptionScheme, latents: np.ndarray, seed: int = 0
) -> tuple[list[str], np.ndarray]:
    """(captions, cells) of images with these latents, each caption's template drawn at random."""
    rng = np.random.default_rng([int(seed), _QUERY_TAG])
    templates = rng.integers(0, len(TEMPLATES), size=len(latents))
    return scheme.captions(latents, templates), scheme.cells(latents)


def text_gap(
    text_emb: np.ndarray,
    image_emb: np.ndarray,
    query_cells: np.ndarray,
    db_cells: np.ndarray,
    temperature: float,
    scheme: CaptionScheme = DEFAULT_SCHEME,
    device=None,
) -> tuple[GapResult, np.ndarray]:
    """(gap of the captions whose cell has an image in the database, (Q,) bool of those kept).

    A caption whose cell is empty in the database has no ideal search (q undefined): it is left out
    and counted by the caller."""
    qc = np.asarray(query_cells, dtype=np.int64).reshape(-1)
    present = np.isin(qc, np.asarray(db_cells, dtype=np.int64))
    result = softmax_gap(
        np.asarray(text_emb)[present],
        image_emb,
        qc[present],
        db_cells,
        CaptionIdeal(scheme),
        float(temperature),
        device=device,
    )
    return result, present


def text_recall(
    text_emb: np.ndarray,
    image_emb: np.ndarray,
    own_rows: np.ndarray,
    query_cells: np.ndarray,
    db_cells: np.ndarray,
    ks=(1, 5, 10),
) -> dict:
    """recall@k (own image in the top k) and hit@k (an image of the caption's cell in the top k)."""
    k_max = min(max(ks), image_emb.shape[0])
    _, rows = knn_search(
        np.asarray(text_emb, dtype=np.float32), np.asarray(image_emb, dtype=np.float32), k_max
    )
    own = rows == np.asarray(own_rows).reshape(-1, 1)
    same = np.asarray(db_cells)[rows] == np.asarray(query_cells).reshape(-1, 1)
    out = {}
    for k in ks:
        out[f"recall@{k}"] = float(own[:, :k].any(axis=1).mean())
        out[f"hit@{k}"] = float(same[:, :k].any(axis=1).mean())
    return out


def _synthetic_split(size: int | None, seed: int, image_size: int):
    from training.datasets import create_dataset

    return create_dataset("synthetic", split="test", size=size, seed=seed, image_size=image_size)


def evaluate_text(
    checkpoint: str | Path,
    size: int | None = None,
    seed: int = 0,
    temperature: float | None = None,
    scheme: CaptionScheme = DEFAULT_SCHEME,
    device: str = "cpu",
) -> dict:
    """Gap and recall of held-out synthetic captions against the held-out images, for a checkpoint with a
    text tower. Half the captions calibrate tau (unless `temperature` is given), the other half are scored."""
    from training.checkpoint import load_checkpoint
    from training.encoder import embed
    from training.text import load_text_encoder

    encoder, meta = load_checkpoint(checkpoint, device=device)
    text = load_text_encoder(checkpoint, device=device)
    if text is None:
        raise ValueError(f"{checkpoint} has no text tower; train one with a [text] table (softsearch train)")
    ds = _synthetic_split(size, seed, encoder.image_size)
    zdb = embed(encoder, ds.tensors(np.arange(len(ds))), progress=False)
    captions, cells = caption_queries(scheme, ds.latents, seed)
    zt = text.encode(captions)
    db_cells = scheme.cells(ds.latents)
    own = np.arange(len(ds))
    half = np.zeros(len(ds), dtype=bool)
    half[np.random.default_rng([seed, _QUERY_TAG, 1]).permutation(len(ds))[: len(ds) // 2]] = True
    train_tau = _train_temperature(meta)
    calibration = None
    if temperature is None:
        cal = calibrate_temperature(
            zt[half], zdb, cells[half], db_cells, CaptionIdeal(scheme), train_temperature=train_tau
        )
        temperature = cal.temperature
        calibration = {
            "temperature": cal.temperature,
            "train_temperature": train_tau,
            "gap_at_train": cal.gap_at_train["kl"] if cal.gap_at_train else None,
            "n_queries": int(half.sum()),
        }
    test = ~half
    gap, _ = text_gap(zt[test], zdb, cells[test], db_cells, temperature, scheme)
    return {
        "checkpoint": str(checkpoint),
        "database": ds.spec(),
        "n_images": len(ds),
        "n_queries": int(test.sum()),
        "temperature": float(temperature),
        "calibration": calibration,
        "gap": gap.summary(),
        "retrieval": text_recall(zt[test], zdb, own[test], cells[test], db_cells),
        "generator": CaptionIdeal(scheme).description,
    }


def _train_temperature(meta: dict) -> float | None:
    opts = (meta.get("train_config") or {}).get("schedule_options") or {}
    for key in ("tau", "tau_min", "tau_end"):
        if isinstance(opts.get(key), (int, float)) and opts[key] > 0:
            return float(opts[key])
    return None


def calibrate_text_version(
    candidate, *, max_queries: int = 500, seed: int = 0, scheme: CaptionScheme = DEFAULT_SCHEME
) -> dict | None:
    """The manifest `text` record of an index version whose checkpoint has a text tower, else None.

    Synthetic database: captions of fresh latents (the held-out stream), exact ideal (uniform over the
    database items of the caption's cell). Any other database: the stored captions of up to
    `max_queries` items (captions.jsonl or sidecar .txt), ideal approximated by a point mass on the
    captioned item. tau = argmin of mean H(q, p) over those captions."""
    from index.models import ModelStore, store_root_of
    from training.synthetic import sample_latents
    from training.text import load_text_encoder

    if not candidate.manifest.has_encoder:
        return None
    path = ModelStore(store_root_of(candidate.path)).resolve(
        candidate.manifest.checkpoint_record, candidate.version
    )
    text = load_text_encoder(path)
    if text is None:
        return None
    from search.evaluation.evaluate import version_database

    datasets, rows = version_database(candidate)
    zdb = np.asarray(candidate.embeddings, dtype=np.float32)
    record = {"tower": text.metadata()["config"], "model_sha256": candidate.manifest.checkpoint_record.sha256}
    if len(datasets) == 1 and datasets[0].name == "synthetic":
        ds = datasets[0]
        db_cells = scheme.cells(ds.latents[np.asarray(rows)[:, 1]])  # db row -> (source 0, item)
        latents = sample_latents(max_queries, seed + 1, "test")
        captions, cells = caption_queries(scheme, latents, seed)
        zt = text.encode(captions)
        present = np.isin(cells, db_cells)
        generator, qmeta, dmeta = CaptionIdeal(scheme), cells[present], db_cells
        zt = zt[present]
        record.update(ideal=generator.description, exact=True, skipped_queries=int((~present).sum()))
    else:
        from training.generators import InstanceGenerator

        ids = list(candidate.ids)
        caps = _version_captions(datasets, ids)
        have = np.flatnonzero([c is not None for c in caps])
        if have.size == 0:
            return {**record, "temperature": None, "source": "no stored captions to calibrate on"}
        pick = np.random.default_rng([seed, _QUERY_TAG, 2]).permutation(have)[:max_queries]
        zt = text.encode([caps[i] for i in pick])
        generator, qmeta, dmeta = InstanceGenerator(), pick, np.arange(len(ids))
        record.update(ideal=generator.description, exact=False, skipped_queries=int(len(ids) - have.size))
    if zt.shape[0] == 0:
        return {**record, "temperature": None, "source": "no held-out captions"}
    cal = calibrate_temperature(zt, zdb, qmeta, dmeta, generator)
    if not math.isfinite(cal.gap_at_calibrated["kl"]):
        return {**record, "temperature": None, "source": "no finite gap"}
    record.update(
        temperature=float(cal.temperature),
        source="calibrated: argmin of held-out caption H(q,p)",
        n_queries=int(zt.shape[0]),
        gap_at_calibrated=float(cal.gap_at_calibrated["kl"]),
        cross_entropy_at_calibrated=float(cal.gap_at_calibrated["cross_entropy"]),
    )
    return record


def store_text_calibration(candidate) -> dict | None:
    """Write `calibrate_text_version`'s record into the candidate version's manifest as `text` (nothing
    for a version without a text tower); returns the record."""
    import time

    from index.manifest import update_manifest

    t0 = time.perf_counter()
    record = calibrate_text_version(candidate)
    if record is None:
        return None
    record["seconds"] = time.perf_counter() - t0
    update_manifest(candidate.path, text=record)
    if record.get("temperature"):
        logger.info(
            "calibrated text temperature %.4g on %d held-out captions",
            record["temperature"],
            record.get("n_queries", 0),
        )
    else:
        logger.warning("no text temperature calibrated (%s)", record.get("source"))
    return record


def _version_captions(datasets: list, ids: list[str]) -> list[str | None]:
    """The stored caption of each indexed item (folder datasets: captions.jsonl or sidecar .txt)."""
    from training.captions import read_captions

    by_id: dict[str, str | None] = {}
    for ds in datasets:
        if getattr(ds, "root", None) and hasattr(ds, "item_ids"):
            item_ids = ds.item_ids()
            for i, c in zip(item_ids, read_captions(ds.root, item_ids)):
                by_id.setdefault(i, c)
    return [by_id.get(i) for i in ids]


def main(argv: list[str] | None = None) -> int:
    args = build_text_parser().parse_args(argv)
    if args.size is not None and args.size < 2:
        raise ValueError(f"--size must be at least 2, got {args.size}")
    if args.temperature is not None and not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise ValueError(f"--temperature must be a positive number, got {args.temperature}")
    result = evaluate_text(args.checkpoint, size=args.size, seed=args.seed, temperature=args.temperature)
    text = json.dumps(result, indent=2, default=float)
    if args.out:
        Path(args.out).write_text(text + "\n")
    g, r = result["gap"], result["retrieval"]
    print(
        f"text queries {result['n_queries']} vs {result['n_images']} images, "
        f"tau {result['temperature']:.4g}: "
        f"gap {g['kl']:.4f} +- {g['kl_se']:.4f} nats, H(q,p) {g['cross_entropy']:.4f}, "
        f"recall@1/5/10 {r['recall@1']:.3f}/{r['recall@5']:.3f}/{r['recall@10']:.3f}, "
        f"hit@10 {r['hit@10']:.3f}"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
