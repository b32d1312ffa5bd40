"""The one step that turns a staged version into a served one: `commit` (stage -> gate -> commit -> activate).

Every path that makes a version (build, rebuild, add, sync, delete, vectors, reshard, import) first writes
it completely into `staging/<version>/` (`index.build.write_version`, `index.stream.write_streamed_version`,
`index.shards.write_sharded`, an import's extraction), then hands it here as a `Staged`. `commit` stamps
the total time, makes sure the encoder model is in the store, calibrates the search temperature (when
`CommitOptions.calibrator` is given), records the quality gate (index/gate.py) in the staged manifest,
renames it into versions/ and activates it through the store's one activation rule (refused:
`ActivationRefused`), then prunes. Anything failing before the rename removes the staging directory.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path

from index.disk import writing
from index.gate import gate_record
from index.manifest import MANIFEST_NAME, read_manifest, update_manifest, updated_bytes
from index.options import Calibrator, CommitOptions
from index.store import IndexStore, IndexVersion

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Staged:
    """A version written completely into staging, not yet in versions/."""

    version: str
    path: Path
    #: the staged version already loaded (a streamed build's mapped lists, a reshard's source rows) for the
    #: gate; None: loaded from `path`
    candidate: IndexVersion | None = None


def commit(
    store: IndexStore,
    staged: Staged,
    options: CommitOptions,
    *,
    path: str,
    t_start: float | None = None,
    model: tuple = (),
) -> str:
    """Gate, commit and activate `staged` (see the module docstring) -> its version name.

    `path` names the command in the activation history ("index build", ...); `t_start` (perf_counter)
    stamps timings.total_s; `model` is (sha256[, file]) of the encoder the store must hold."""
    version, staging, candidate = staged.version, staged.path, staged.candidate
    try:
        if t_start is not None:
            _stamp_total(staging, t_start)
        if model:
            store.models.ensure(*model)
        if options.calibrator is not None:
            _calibrate(staging, options.calibrator, candidate)
            if candidate is not None:  # the gate reads the calibrated temperature
                candidate.manifest = read_manifest(staging)
        serving_name = store.current_version()
        if candidate is None:
            candidate = IndexVersion.load(staging, verify=False, gpu=False)
        serving = (
            store.load(serving_name, verify=False, gpu=False) if serving_name and options.evaluator else None
        )
        if (
            serving is not None and serving.index is None
        ):  # a sharded version: scored as its rows, one flat index
            from index.shards import flat_view

            serving = flat_view(serving)
        record = gate_record(
            candidate, serving, options.evaluator, margin=options.margin, force=options.force
        )
        # an import's version arrived whole: on a full disk here nothing of it is committed (a build's
        # staged files are removed as after any failed write: the default message)
        outcome = (
            None
            if path != "index import"
            else (
                f"the import of {version} stopped before its commit: nothing of it is in versions/ and "
                + (
                    f"`current` still points at {serving_name}, which keeps serving"
                    if serving_name
                    else "no version is current, as before"
                )
                + "; free some space and rerun the import"
            )
        )
        needed = updated_bytes(staging, quality_gate=record) + store.switch_bytes(
            version
        )  # then its activation
        with writing(staging / MANIFEST_NAME, needed, outcome):
            update_manifest(staging, quality_gate=record)
        store.commit(staging, version)
    except BaseException:
        candidate = None  # unmaps its files (else their blocks stay taken until the error is dropped)
        discard_staging(staging)
        raise
    if options.activate:
        store.activate(
            version, force=options.force, path=path, verify=False
        )  # ActivationRefused when refused
        if options.keep is not None:
            store.prune(options.keep)
    return version


def discard_staging(staging: Path) -> None:
    """Remove a version's staging directory after a failed build (never embedding caches)."""
    if Path(staging).is_dir():
        shutil.rmtree(staging, ignore_errors=True)
        logger.info("removed the staging directory of the failed build: %s", staging)


def _calibrate(staging: Path, calibrator: Calibrator, candidate: IndexVersion | None = None) -> None:
    """Store the calibrated search temperature in the staged manifest (unless one was given explicitly),
    calibrated on `candidate` when the staged version is already loaded (a sharded build's flat view)."""
    if read_manifest(staging).search_temperature_source == "command line":
        return
    t0 = time.perf_counter()
    if candidate is None:
        candidate = IndexVersion.load(staging, verify=False, gpu=False)
    result = calibrator(candidate)
    if result is None:
        return
    update_manifest(
        staging,
        calibration={**result, "seconds": time.perf_counter() - t0},
        search_temperature=float(result["temperature"]),
        search_temperature_source="calibrated: argmin of held-out H(q,p)",
    )
    logger.info(
        "calibrated search temperature %.4g (training %.4g)",
        result["temperature"],
        result.get("train_temperature", float("nan")),
    )


def _stamp_total(staging: Path, t_start: float) -> None:
    timings = read_manifest(staging).timings or {}
    update_manifest(staging, timings={**timings, "total_s": time.perf_counter() - t_start})
