"""What each indexed file looked like when it was embedded: `item_files.json` in a version directory.

For items that come from files (the `folder` dataset) a version records, per item id,
``[size, mtime_ns, sha256]`` of the file as it was read. `index sync` compares a folder's current
files with these records: same size and mtime -> unchanged (not even hashed); otherwise the
content hash decides between "touched" (same bytes, reused) and "modified" (re-embedded).
The records are taken *before* embedding, so a file that changes mid-build is recorded with its
older state and the next sync re-embeds it (never the reverse).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from index.manifest import file_sha256

logger = logging.getLogger(__name__)

ITEM_FILES = "item_files.json"
ITEM_FILES_FORMAT = 1


def has_files(dataset) -> bool:
    """True for datasets whose items are files on disk (they expose `path(i)`)."""
    return getattr(dataset, "name", None) == "folder" and callable(getattr(dataset, "path", None))


def file_record(path: str | os.PathLike) -> list | None:
    """[size, mtime_ns, sha256] of a file, or None when it cannot be read (it will be skipped anyway)."""
    try:
        st = os.stat(path)
        return [int(st.st_size), int(st.st_mtime_ns), file_sha256(path)]
    except OSError as err:
        logger.warning("cannot stat/read %s: %s", path, err)
        return None


def dataset_records(dataset, indices=None) -> dict[str, list]:
    """{item id: [size, mtime_ns, sha256]} for the items of a file-backed dataset (all by default)."""
    if not has_files(dataset):
        return {}
    indices = range(len(dataset)) if indices is None else indices
    out = {}
    for i in indices:
        record = file_record(dataset.path(int(i)))
        if record is not None:
            out[dataset.item_id(int(i))] = record
    return out


def encode_records(records: dict[str, list], ids) -> bytes:
    """The item_files.json bytes for the indexed `ids` that have a record (sorted by id)."""
    kept = {i: records[i] for i in sorted(ids) if i in records}
    return (json.dumps({"format": ITEM_FILES_FORMAT, "items": kept}, separators=(",", ":")) + "\n").encode()


def read_records(version_path: str | os.PathLike) -> dict[str, list]:
    """The records of a loaded version directory ({} for versions built before records existed)."""
    path = Path(version_path) / ITEM_FILES
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if (
        not isinstance(data, dict)
        or data.get("format") != ITEM_FILES_FORMAT
        or not isinstance(data.get("items"), dict)
    ):
        logger.warning("%s has an unknown layout; treating every file as changed", path)
        return {}
    return data["items"]


def read_id_lines(path, label: str = "ids file") -> list[str]:
    """The lines of a UTF-8 text file of item ids, kept exactly (only a final newline and CRs dropped);
    FileNotFoundError / ValueError name the file. Callers apply their own rules (blank lines, count)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{label} not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{label} {path} is not UTF-8 text ({err})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]
