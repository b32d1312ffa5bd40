"""Per-item metadata of an index version (`item_metadata.json`): what filters select on.

Every version stores, per item id, typed fields: built-in ones read while indexing (for image
folders the relative ``path``, the first-level ``class`` folder, file ``size`` in bytes, ``mtime`` in
Unix seconds, ``width``, ``height`` and ``format``; for labelled built-in datasets the ``class``) and
user fields from ``index build | add | sync --metadata FILE`` (JSON Lines or CSV keyed by ``id``).
Field types are ``str``, ``int``, ``float`` or ``bool``; a value may be missing for some items.
Later versions (add, sync, delete) carry the fields of the items they keep.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

ITEM_METADATA = "item_metadata.json"
METADATA_FORMAT = 1
FIELD_TYPES = ("str", "int", "float", "bool")
FOLDER_FIELDS = {
    "path": "str",
    "class": "str",
    "size": "int",
    "mtime": "float",
    "width": "int",
    "height": "int",
    "format": "str",
}
BUILTIN_FIELDS = frozenset(FOLDER_FIELDS)


class MetadataError(ValueError):
    """A metadata file or value that cannot be used (names the file, line and field)."""


@dataclass(frozen=True)
class Metadata:
    """Typed per-item fields: ``types`` {field: type}, ``items`` {item id: {field: value}}."""

    types: dict[str, str]
    items: dict[str, dict]

    @classmethod
    def empty(cls) -> "Metadata":
        return cls({}, {})

    def merge(self, other: "Metadata") -> "Metadata":
        """Fields of `other` added to (and, per item, overriding) these; a field's type must agree."""
        for name, kind in other.types.items():
            mine = self.types.get(name)
            if _wider(mine, kind) is None:
                raise MetadataError(f"field {name!r} is {mine} in the index but {kind} in the new metadata")
        types = {**self.types, **{n: _wider(self.types.get(n), t) for n, t in other.types.items()}}
        items = {i: dict(v) for i, v in self.items.items()}
        for item, values in other.items.items():
            items.setdefault(item, {}).update(values)
        return Metadata(types, items)

    def restrict(self, ids) -> "Metadata":
        """Only the items in `ids` (fields that no kept item has are dropped)."""
        items = {i: self.items[i] for i in ids if i in self.items}
        used = {f for values in items.values() for f in values}
        return Metadata({f: t for f, t in self.types.items() if f in used}, items)

    def encode(self, ids) -> bytes:
        """The item_metadata.json bytes for the indexed `ids` (sorted by id)."""
        kept = self.restrict(sorted(ids))
        body = {"format": METADATA_FORMAT, "fields": kept.types, "items": kept.items}
        return (json.dumps(body, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _wider(old: str | None, new: str) -> str | None:
    """The type a field has after values of type `new` join ones of type `old` (None: not yet typed):
    int and float make float; any other mix is None (refused)."""
    if old is None or old == new:
        return new
    return "float" if {old, new} == {"int", "float"} else None


def read_metadata(version_path: str | os.PathLike) -> Metadata:
    """The metadata of a version directory (empty for versions built before metadata existed)."""
    path = Path(version_path) / ITEM_METADATA
    if not path.is_file():
        return Metadata.empty()
    data = json.loads(path.read_text(encoding="utf-8"))
    if (
        not isinstance(data, dict)
        or data.get("format") != METADATA_FORMAT
        or not isinstance(data.get("fields"), dict)
        or not isinstance(data.get("items"), dict)
    ):
        logger.warning("%s has an unknown layout; this version has no metadata", path)
        return Metadata.empty()
    return Metadata(dict(data["fields"]), data["items"])


# ----------------------------------------------------------------- built-in fields
def dataset_metadata(dataset, indices=None) -> Metadata:
    """Built-in fields of a dataset's items: file facts for folders, the class for labelled datasets."""
    indices = range(len(dataset)) if indices is None else [int(i) for i in indices]
    names = getattr(dataset, "class_names", None)
    labels = getattr(dataset, "labels", None)
    path_of = getattr(dataset, "path", None)
    is_folder = getattr(dataset, "name", None) == "folder" and callable(path_of)
    items: dict[str, dict] = {}
    for i in indices:
        values: dict = {}
        if is_folder:
            values.update(
                file_metadata(path_of(i), dataset.relative_path(i), getattr(dataset, "limits", None))
            )
        if labels is not None:  # the class name, or the label number where the dataset has no names
            label = int(labels[i])
            values["class"] = str(names[label]) if names and 0 <= label < len(names) else str(label)
        items[dataset.item_id(i)] = values
    types = {f: t for f, t in FOLDER_FIELDS.items() if any(f in v for v in items.values())}
    return Metadata(types, items)


def file_metadata(path: str | os.PathLike, rel: str, limits=None) -> dict:
    """path (`rel`, relative to the folder), class (its first folder), size, mtime, and width/height/format
    from the image header."""
    from training.images import DEFAULT_LIMITS, ImageError, open_checked

    path = Path(path)
    values: dict = {"path": rel}
    if "/" in rel:
        values["class"] = rel.split("/", 1)[0]
    try:
        st = path.stat()
        values.update(size=int(st.st_size), mtime=round(st.st_mtime_ns / 1e9, 6))
        with open_checked(path, limits or DEFAULT_LIMITS) as image:  # header only: no pixels decoded
            values.update(width=int(image.size[0]), height=int(image.size[1]))
            if image.format:
                values["format"] = str(image.format).lower()
    except (OSError, ImageError) as err:
        logger.info("no image header for %s: %s", path, err)
    return values


# ----------------------------------------------------------------- user fields
def load_user_metadata(path: str | os.PathLike) -> Metadata:
    """User fields from JSON Lines (one object with "id" per line) or CSV (a header with an "id" column).

    Types come from the values: JSON types as given (int and float together are float); CSV cells
    are int, float or bool (true/false) when every cell of the column parses so, else str; an empty
    cell is a missing value."""
    path = Path(path)
    if not path.is_file():
        raise MetadataError(f"metadata file not found: {path}")
    text = path.read_text(encoding="utf-8-sig")
    first = next((line for line in text.splitlines() if line.strip()), "")
    rows = _jsonl_rows(path, text) if first.lstrip().startswith("{") else _csv_rows(path, text)
    return _typed(path, rows)


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise MetadataError(f"{path}:{n}: not JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise MetadataError(f'{path}:{n}: expected a JSON object with an "id"')
        rows.append((n, obj))
    return rows


def _csv_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    reader = csv.DictReader(text.splitlines())
    if not reader.fieldnames or "id" not in reader.fieldnames:
        raise MetadataError(f"{path}: neither JSON Lines nor a CSV with an 'id' column in its header")
    raw = [(n, row) for n, row in enumerate(reader, 2)]
    columns = [f for f in reader.fieldnames if f != "id"]
    kinds = {c: _csv_kind([row.get(c) or "" for _, row in raw]) for c in columns}
    rows = []
    for n, row in raw:
        if None in row:
            raise MetadataError(f"{path}:{n}: more cells than header columns")
        out: dict = {"id": row["id"]}
        for c in columns:
            cell = (row.get(c) or "").strip()
            if cell:
                out[c] = _csv_value(cell, kinds[c])
        rows.append((n, out))
    return rows


def _csv_kind(cells: list[str]) -> str:
    present = [c.strip() for c in cells if c and c.strip()]
    for kind, parse in (("int", int), ("float", float)):
        try:
            if present and all(math.isfinite(parse(c)) for c in present):
                return kind
        except ValueError:
            pass
    if present and all(c.lower() in ("true", "false") for c in present):
        return "bool"
    return "str"


def _csv_value(cell: str, kind: str):
    return {"int": int, "float": float, "bool": lambda c: c.lower() == "true", "str": str}[kind](cell)


def _kind_of(value) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float" if math.isfinite(value) else None
    if isinstance(value, str):
        return "str"
    return None


def _typed(path: Path, rows: list[tuple[int, dict]]) -> Metadata:
    types: dict[str, str] = {}
    items: dict[str, dict] = {}
    for n, obj in rows:
        item = obj.get("id")
        if not isinstance(item, str) or not item:
            raise MetadataError(f'{path}:{n}: every record needs a non-empty string "id"')
        values = {}
        for name, value in obj.items():
            if name == "id" or value is None:
                continue
            if not isinstance(name, str) or not name or name in BUILTIN_FIELDS:
                raise MetadataError(f"{path}:{n}: field {name!r} is built in (or empty); rename it")
            kind = _kind_of(value)
            if kind is None:
                raise MetadataError(
                    f"{path}:{n}: field {name!r} must be a string, number or boolean, "
                    f"got {json.dumps(value)[:40]}"
                )
            old = types.get(name)
            if _wider(old, kind) is None:
                raise MetadataError(f"{path}:{n}: field {name!r} is {kind} here but {old} on an earlier line")
            types[name] = _wider(old, kind)
            values[name] = value
        items.setdefault(item, {}).update(values)
    for values in items.values():  # an int field that saw a float stores floats
        for name, value in values.items():
            if types[name] == "float":
                values[name] = float(value)
    return Metadata(types, items)


def report_unknown_ids(metadata: Metadata, ids, source: str) -> int:
    """Log how many metadata ids are not indexed (they are ignored); returns that count."""
    unknown = set(metadata.items) - set(ids)
    if unknown:
        logger.warning(
            "%s: %d of %d metadata ids are not in the index (ignored), e.g. %s",
            source,
            len(unknown),
            len(metadata.items),
            sorted(unknown)[0],
        )
    return len(unknown)


# ----------------------------------------------------------------- columns for filtering
@dataclass(frozen=True)
class MetadataColumns:
    """The metadata as one array per field aligned with index rows, for vectorised filters.

    str fields: a numpy unicode array ('' where missing); numbers and bools: float64 (NaN where
    missing); ``present[field]`` is a bool array of rows that have a value."""

    types: dict[str, str]
    values: dict[str, np.ndarray]
    present: dict[str, np.ndarray]
    count: int

    @classmethod
    def build(cls, metadata: Metadata, ids) -> "MetadataColumns":
        ids = list(ids)
        values, present = {}, {}
        for name, kind in metadata.types.items():
            raw = [metadata.items.get(i, {}).get(name) for i in ids]
            has = np.array([v is not None for v in raw], dtype=bool)
            if kind == "str":
                col = np.array(["" if v is None else str(v) for v in raw], dtype=str)
            else:
                col = np.array([np.nan if v is None else float(v) for v in raw], dtype=np.float64)
            values[name], present[name] = col, has
        return cls(dict(metadata.types), values, present, len(ids))


def item_files(records: dict, metadata: Metadata, ids) -> dict[str, bytes] | None:
    """The per-item files of a new version: item_files.json (file states) and item_metadata.json."""
    from index.items import ITEM_FILES, encode_records

    files = {}
    if records:
        files[ITEM_FILES] = encode_records(records, ids)
    if metadata.types:
        files[ITEM_METADATA] = metadata.encode(ids)
    return files or None


def user_fields(metadata: Metadata) -> Metadata:
    """Only the user's fields (what a rebuild carries over; the built-in ones are read again)."""
    keep = {f: t for f, t in metadata.types.items() if f not in BUILTIN_FIELDS}
    items = {i: {f: v for f, v in values.items() if f in keep} for i, values in metadata.items.items()}
    return Metadata(keep, {i: v for i, v in items.items() if v})
