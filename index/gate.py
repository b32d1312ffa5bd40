"""The activation rule -- "may this version serve?" -- in one place.

A version may become current (and a server may load it) when both checks pass:
  * the quality gate (`score_check`): the evaluator's score of the candidate is at least the serving
    version's minus `margin` (`score_passes`), recorded in its manifest's `quality_gate` by
    `gate_record` when the version is built, imported or first activated (`gate_version`);
  * the recall check (`recall_check`): recall@10 of its own FAISS index at its tuned parameters
    reaches the target it was built for.
`activation_checks(manifest)` gives both; `IndexStore.activate / rollback / serving_check` apply them
and raise `ActivationRefused` (exit 1 on the CLI, 409 on the admin reload) unless forced. The evaluator
(search.evaluation.quality) is injected by the caller: index/ cannot import search/.
`gate_for(store, evaluator)` is the gate every activation path (CLI, admin reload, follower, import)
uses for a version that has none yet.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable, ClassVar, Union

import numpy as np

from index import faiss_index
from index.defaults import DEFAULT_MARGIN  # re-exported here; defined without numpy for the parser
from index.manifest import Manifest, RecallCheck
from index.options import Calibrator, Evaluator  # noqa: F401  (re-exported: the gate's injected callables)
from index.paging import PagedRows, drop_index_pages, read_rows

if TYPE_CHECKING:  # the store imports this module; these are for annotations only
    from index.store import IndexStore, IndexVersion

logger = logging.getLogger(__name__)

#: How a refused activation is overridden, named in every refusal.
FORCE_HINT = 'override with --force (CLI) or {"force": true} (POST /v1/admin/reload)'
#: A gate for a version that has none: gate(version name) -> its quality_gate record (`gate_version`).
Gate = Callable[[str], dict]

#: Held-out stored rows the gate of a version without an encoder searches (`held_out_recall`).
GATE_QUERIES = 1000
GATE_SEED = 1


@dataclasses.dataclass(frozen=True)
class ScoreCheck:
    """The quality-gate half of the rule (`score_check`): the recorded comparison with the serving version."""

    name: ClassVar[str] = "quality gate"
    passed: bool | None  # None: the version has no gate result
    message: str
    record: dict | None = None  # the gate record's JSON (None: none recorded)


#: One check of the activation rule: both have `name`, `passed` (True, False, None: not recorded), `message`
#: (RecallCheck is index.manifest's: the gate record stores it).
Check = Union[ScoreCheck, RecallCheck]


@dataclasses.dataclass(frozen=True)
class Decision:
    """The activation rule applied to one version (`IndexStore.check_activation`)."""

    version: str
    checks: tuple[Check, ...]
    failed: tuple[Check, ...]
    forced: bool  # some check failed and `force` overrode it


class ActivationRefused(RuntimeError):
    """The activation rule refused a version (`failed`: the checks that failed); nothing changed.
    Every command exits 1 on it; the admin reload answers 409."""

    def __init__(self, version: str, failed, hint: str = FORCE_HINT):
        self.version, self.failed = version, tuple(failed)
        gate = next((c for c in self.failed if isinstance(c, ScoreCheck)), None)
        self.comparison = (gate.record if gate is not None else None) or {}
        super().__init__(
            f"activation of index version {version} refused: "
            + "; ".join(c.message for c in self.failed)
            + f"; {hint}"
        )


#: The name build/import callers catch: a refused activation (quality gate or recall below target).
QualityGateError = ActivationRefused


class GateUnavailable(Exception):
    """An evaluator could not score a version here (e.g. its dataset is not on this machine); the gate
    records the reason and the activation rule refuses the version unless forced."""


def score_passes(candidate: float, serving: float, margin: float) -> bool:
    """The quality gate's pass formula: candidate >= serving - margin (a little noise is tolerated)."""
    return bool(float(candidate) >= float(serving) - float(margin))


def _fmt(x) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else str(x)


def recall_check(manifest: Manifest, served: dict | None = None) -> RecallCheck:
    """The recall half of the rule: recall@10 of the version's own FAISS index at its tuned search
    parameters (`faiss_index.search`, the call the server makes) against the target it was built for.

    The figure is the gate's measurement on held-out queries (`served` or the recorded gate's
    `checks.recall`) when there is one, else the build's tuning measurement on stored rows (each
    query's own row excluded)."""
    tuned = manifest.recall
    gate_recall = manifest.quality_gate.recall if manifest.quality_gate is not None else RecallCheck()
    target = tuned.target if tuned is not None and "target" in tuned.key_order else gate_recall.target
    kind, params = manifest.kind, dict(manifest.params or {})
    out = {"kind": kind, "params": params, "target": target, "tuned": None if tuned is None else tuned.recall}
    if served is not None and served.get("recall") is not None:
        out.update(
            served=float(served["recall"]),
            measured_on=served.get("measured_on") or f"{served.get('n_queries', '?')} held-out queries",
        )
    elif gate_recall.served is not None:
        out.update(
            served=float(gate_recall.served),
            measured_on=(
                gate_recall.measured_on if "measured_on" in gate_recall.key_order else "held-out queries"
            ),
        )
    elif tuned is not None and tuned.recall is not None:
        out.update(
            served=float(tuned.recall),
            measured_on=f"{tuned.sample if 'sample' in tuned.key_order else 'all'} stored rows (tuning)",
        )
    else:
        out.update(served=None, measured_on=None)
    if out["served"] is None or target is None:
        out.update(passed=None, message="recall: not recorded")
        return RecallCheck.from_json(out)
    out["passed"] = bool(out["served"] >= float(target) - 1e-9)
    described = f"{kind} ({', '.join(f'{k}={v}' for k, v in params.items()) or 'exact'})"
    if out["passed"]:
        out["message"] = (
            f"recall check: {described} reaches recall@10 {out['served']:.3f} >= target "
            f"{float(target):.3f} on {out['measured_on']}"
        )
    else:
        out["message"] = (
            f"recall check failed: {described} reaches recall@10 {out['served']:.3f} < target "
            f"{float(target):.3f} on {out['measured_on']}; "
            + faiss_index.suggest_kind(kind, params, int(manifest.count), int(manifest.dim), float(target))
        )
    return RecallCheck.from_json(out)


def score_check(manifest: Manifest) -> ScoreCheck:
    """The quality-gate half of the rule: the recorded comparison with the version that was serving."""
    gate = manifest.quality_gate
    record = None if gate is None else gate.to_json()
    if gate is None:
        return ScoreCheck(None, "quality gate: no result recorded", record)
    if gate.error:
        return ScoreCheck(False, f"quality gate could not score it: {gate.error}", record)
    # checks.score: None when nothing was serving or no evaluator; a record older than the rule with
    # no comparison carries only its verdict there (GateRecord.from_json)
    score = gate.score
    if score is None or score.candidate is None or score.serving is None:
        passed = score.passed if score is not None and score.key_order else True
        message = (
            "quality gate: nothing was serving to compare with"
            if passed is not False
            else "quality gate failed"
        )
        return ScoreCheck(passed, gate.note or message, record)
    margin = float(score.margin or 0.0)
    passed = score_passes(score.candidate, score.serving, margin)
    metric = score.metric if "metric" in score.key_order else "score"
    return ScoreCheck(
        passed,
        f"quality gate {'passed' if passed else 'failed'} ({metric}): "
        f"candidate {_fmt(score.candidate)} {'>=' if passed else '<'} serving "
        f"{_fmt(score.serving)} - margin {_fmt(margin)} (serving version {score.serving_version})",
        record,
    )


def activation_checks(manifest: Manifest) -> list[Check]:
    """Both checks of the activation rule for one manifest (see `recall_check`, `score_check`)."""
    return [score_check(manifest), recall_check(manifest)]


def gate_record(
    candidate: IndexVersion,
    serving: IndexVersion | None,
    evaluator: Evaluator | None,
    *,
    margin: float = DEFAULT_MARGIN,
    force: bool = False,
) -> dict:
    """The manifest's ``quality_gate`` for `candidate`: the evaluator's comparison with `serving` (when
    both exist) and the recall check of its own FAISS index (`recall_check`).

    The evaluator's keys stay at the top level (as it returned them); ``checks`` holds what the
    activation rule reads: ``score`` (None when nothing was compared) and ``recall``."""
    record: dict = {}
    score = None
    t0 = time.perf_counter()
    vectors_only = not candidate.manifest.has_encoder or (
        serving is not None and not serving.manifest.has_encoder
    )
    if vectors_only:
        # no encoder on one side: no query images to score both with, so the gate is the recall check
        # of the candidate's served search on stored rows it was not tuned on
        held_out = held_out_recall(candidate)
        record.update(
            index_recall={"candidate": held_out},
            note=(
                "quality gate: the recall check only (a version built from vectors has no encoder to embed "
                "held-out images with)"
            ),
            serving_version=None if serving is None else serving.version,
        )
    elif evaluator is not None and serving is not None:
        try:
            result = evaluator(candidate, serving)
        except GateUnavailable as err:
            recall = recall_check(candidate.manifest).to_json()
            return {
                "passed": False,
                "forced": bool(force),
                "serving_version": serving.version,
                "error": f"the quality gate cannot score this version here: {err}",
                "checks": {"score": None, "recall": recall},
            }
        if not isinstance(result, dict) or not {"candidate", "serving"} <= set(result):
            raise ValueError(
                f"evaluator must return a dict with 'candidate' and 'serving' scores, got {result!r}"
            )
        record.update(result)
        cand, serv = float(result["candidate"]), float(result["serving"])
        score = {
            "metric": result.get("metric", "score"),
            "candidate": cand,
            "serving": serv,
            "margin": float(margin),
            "serving_version": serving.version,
            "passed": score_passes(cand, serv, margin),
        }
        record.update(serving_version=serving.version, margin=float(margin), seconds=time.perf_counter() - t0)
    served = ((record.get("index_recall") or {}).get("candidate")) if record else None
    recall = recall_check(candidate.manifest, served)
    passed = (score is None or score["passed"]) and recall.passed is not False
    record.update(
        passed=bool(passed),
        forced=bool(force and not passed),
        checks={"score": score, "recall": recall.to_json()},
    )
    if score is not None:
        logger.info(
            "quality gate %s: candidate %.4g vs serving %.4g (margin %.3g)",
            "passed" if score["passed"] else "FAILED",
            score["candidate"],
            score["serving"],
            margin,
        )
    logger.info("%s", recall.message)
    return record


def held_out_recall(
    version: IndexVersion, n_queries: int = GATE_QUERIES, k: int = 10, seed: int = GATE_SEED
) -> dict:
    """recall@k of what `version` serves (its FAISS index at the tuned parameters, candidates re-ranked
    exactly by the manifest's `rerank`: `faiss_index.search_reranked`, the server's search) against exact
    search, on stored rows the build did not tune on (`faiss_index.tuning_rows`), each query's own row
    excluded from both lists. {"recall", "n_queries", "k", "rerank", "measured_on", "seconds"}."""
    t0 = time.perf_counter()
    emb = version.embeddings
    n = int(emb.shape[0])
    k = min(k, n - 1)
    if k < 1:
        return {"recall": 1.0, "n_queries": 0, "k": 0, "measured_on": "a single item (nothing to miss)"}
    rows, where = held_out_rows(n, n_queries, seed)
    queries = read_rows(emb, rows).astype(np.float32)
    rerank = faiss_index.rerank_factor(version.kind, version.manifest.params)
    # exact search over row blocks and re-ranking gathers that drop the pages they read, the index searched in
    # query batches dropping the pages of on-disk lists: a version larger than RAM is checked in bounded RAM
    exact = faiss_index.exact_neighbours(emb, queries, k + 1)
    release = (lambda: drop_index_pages(version.index)) if faiss_index.on_disk_lists(version.index) else None
    _, found = faiss_index.search_reranked(
        version.index, PagedRows(emb), queries, k + 1, rerank, release=release
    )
    found = faiss_index.drop_rows(found, rows, k)
    exact = faiss_index.drop_rows(exact, rows, k)
    recall = faiss_index.recall_at_k(found, exact, k)
    logger.info(
        "held-out recall@%d of %s: %.4f on %d %s (re-rank %d)",
        k,
        version.version,
        recall,
        len(rows),
        where,
        rerank,
    )
    return {
        "recall": recall,
        "n_queries": int(len(rows)),
        "k": int(k),
        "rerank": int(rerank),
        "measured_on": f"{len(rows)} {where}, own row excluded",
        "seconds": time.perf_counter() - t0,
    }


def held_out_rows(n: int, n_queries: int = GATE_QUERIES, seed: int = GATE_SEED) -> tuple[np.ndarray, str]:
    """(sorted rows, what they are) the gate queries with: the first `n_queries` of a seeded draw of distinct
    rows that the build did not tune on (`faiss_index.tuning_rows`); all rows' draw when every row was tuned
    on. O(n_queries) memory at any N (no array of all N rows)."""
    tuned = faiss_index.tuning_rows(n)
    rng = np.random.default_rng(seed)
    if n - len(tuned) <= 0:
        return np.sort(rng.choice(n, size=min(n_queries, n), replace=False)), "stored rows (all tuned on)"
    draw = rng.choice(n, size=min(n, n_queries + len(tuned)), replace=False)
    spare = draw[~np.isin(draw, tuned)][:n_queries]
    return np.sort(spare), "held-out stored rows"


def gate_version(
    store: IndexStore, version: str, evaluator: Evaluator | None, margin: float = DEFAULT_MARGIN
) -> dict:
    """Gate a committed version against the store's current one (the `gate` of IndexStore.activate
    for versions that have no gate result yet)."""
    candidate = store.load(version, verify=False, gpu=False)
    current = store.current_version()
    serving = store.load(current, verify=False, gpu=False) if current not in (None, version) else None
    return gate_record(candidate, serving, evaluator, margin=margin)


def gate_for(store: "IndexStore", evaluator: Evaluator | None, margin: float = DEFAULT_MARGIN) -> Gate | None:
    """The gate `IndexStore.activate` / `rollback` run on a version that has no gate result yet."""
    if evaluator is None:
        return None
    return lambda version: gate_version(store, version, evaluator, margin)
