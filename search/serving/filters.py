"""The filter language of the search routes, compiled to a boolean mask over index rows.

A filter is JSON over the version's metadata fields (index/metadata.py):

    {"class": "apps"}                                   field equals a value
    {"class": {"in": ["apps", "food"]}}                 one of several values
    {"size": {"gte": 1000, "lt": 50000}}                ranges on numeric fields (gt, gte, lt, lte)
    {"path": {"prefix": "animals/"}}                    string prefix
    {"and": [F, ...]}, {"or": [F, ...]}, {"not": F}     combinations; several keys in one object mean "and"

An item without a value for a field matches no condition on it (it matches ``not`` of one).
`parse_filter` checks every field name, operator and value type against the field types and
raises FilterError naming the field; `Filter.mask(columns)` evaluates it with numpy.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from index.metadata import MetadataColumns

RANGE_OPS = {"gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}
MAX_NODES = 256          # conditions per filter: bounds the work one request can ask for
MAX_IN_VALUES = 4096


class FilterError(ValueError):
    """A filter that cannot run on this index version; `field` names the offending field (or None)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Filter:
    """A parsed filter: `key` is its canonical JSON (a cache key), `evaluate` maps columns to a mask."""

    key: str
    evaluate: Callable[[MetadataColumns], np.ndarray]
    fields: frozenset[str]

    def mask(self, columns: MetadataColumns) -> np.ndarray:
        """(N,) bool: rows that pass."""
        out = self.evaluate(columns)
        return np.asarray(out, dtype=bool)


def parse_filter(spec: Any, types: dict[str, str]) -> Filter:
    """Validate `spec` (the decoded JSON) against `types` ({field: str|int|float|bool}) and compile it."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as err:
            raise FilterError(f"filter is not JSON ({err.msg})") from None
    counter = [0]
    fields: set[str] = set()
    evaluate = _node(spec, types, counter, fields, "filter")
    key = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return Filter(key, evaluate, frozenset(fields))


def _node(spec: Any, types: dict[str, str], counter: list[int], fields: set[str], where: str):
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise FilterError(f"filter has more than {MAX_NODES} conditions")
    if not isinstance(spec, dict) or not spec:
        raise FilterError(f"{where} must be a non-empty JSON object, got {json.dumps(spec)[:60]}")
    parts = []
    for name, value in spec.items():
        if name in ("and", "or"):
            if not isinstance(value, list) or not value:
                raise FilterError(f"{where}.{name} must be a non-empty list of filters")
            subs = [_node(v, types, counter, fields, f"{where}.{name}[{i}]") for i, v in enumerate(value)]
            combine = np.logical_and if name == "and" else np.logical_or
            parts.append(_fold(subs, combine))
        elif name == "not":
            sub = _node(value, types, counter, fields, f"{where}.not")
            parts.append(lambda cols, sub=sub: ~sub(cols))
        else:
            parts.append(_condition(name, value, types, where))
            fields.add(name)
    return _fold(parts, np.logical_and)


def _fold(parts, combine):
    if len(parts) == 1:
        return parts[0]

    def evaluate(cols):
        out = parts[0](cols)
        for part in parts[1:]:
            out = combine(out, part(cols))
        return out
    return evaluate


def _condition(field: str, value: Any, types: dict[str, str], where: str):
    if field not in types:
        known = ", ".join(sorted(types)) or "none: this index version stores no metadata"
        raise FilterError(f"unknown field {field!r} in {where} (fields: {known})", field)
    kind = types[field]
    if not isinstance(value, dict):            # {"field": value} is equality
        value = {"eq": value}
    if not value:
        raise FilterError(f"{where}.{field}: empty condition", field)
    tests = []
    for op, operand in value.items():
        if op == "eq":
            v = _scalar(field, kind, operand)
            tests.append(lambda c, v=v: _equal(c, field, v))
        elif op == "in":
            if not isinstance(operand, list) or not operand or len(operand) > MAX_IN_VALUES:
                raise FilterError(f"{where}.{field}.in must be a list of 1..{MAX_IN_VALUES} values", field)
            values = [_scalar(field, kind, v) for v in operand]
            tests.append(lambda c, vs=values: _member(c, field, vs))
        elif op in RANGE_OPS:
            if kind not in ("int", "float"):
                raise FilterError(f"{where}.{field}.{op}: ranges need a numeric field; {field!r} is {kind}", field)
            v = _scalar(field, kind, operand)
            tests.append(lambda c, v=v, f=RANGE_OPS[op]: c.present[field] & f(c.values[field], v))
        elif op == "prefix":
            if kind != "str" or not isinstance(operand, str):
                raise FilterError(f"{where}.{field}.prefix needs a string field and a string; {field!r} is {kind}",
                                  field)
            tests.append(lambda c, p=operand: c.present[field] & np.char.startswith(c.values[field], p))
        else:
            raise FilterError(f"{where}.{field}: unknown operator {op!r} (use in, gt, gte, lt, lte, prefix, "
                              "or a value for equality)", field)
    return _fold(tests, np.logical_and)


def _scalar(field: str, kind: str, value: Any):
    """`value` checked against the field's type (int and float fields accept any finite number)."""
    ok = {"str": isinstance(value, str),
          "bool": isinstance(value, bool),
          "int": isinstance(value, (int, float)) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise FilterError(f"field {field!r} is {kind}; got {json.dumps(value)[:40]}", field)
    return float(value) if kind in ("int", "float", "bool") else value


def _equal(cols: MetadataColumns, field: str, value) -> np.ndarray:
    return cols.present[field] & (cols.values[field] == value)


def _member(cols: MetadataColumns, field: str, values: list) -> np.ndarray:
    return cols.present[field] & np.isin(cols.values[field], np.asarray(values))


def filter_json_schema(types: dict[str, str], ref: str) -> dict:
    """The JSON Schema of a filter over fields `types` ({field: str|int|float|bool}); `ref` is where the
    schema itself lives (its and / or / not recurse through it). Every filter it admits parses here;
    the schema only leaves unsaid the MAX_NODES bound on conditions."""
    scalar = {"str": {"type": "string"}, "bool": {"type": "boolean"},
              "int": {"type": "number"}, "float": {"type": "number"}}
    properties: dict[str, Any] = {}
    for field, kind in types.items():
        value = scalar[kind]
        ops = {"eq": value, "in": {"type": "array", "items": value, "minItems": 1, "maxItems": MAX_IN_VALUES}}
        if kind in ("int", "float"):
            ops.update({op: value for op in RANGE_OPS})
        if kind == "str":
            ops["prefix"] = value
        properties[field] = {"anyOf": [value, {"type": "object", "properties": ops, "additionalProperties": False,
                                               "minProperties": 1}]}
    branch = {"type": "array", "items": {"$ref": ref}, "minItems": 1}
    properties.update({"and": branch, "or": branch, "not": {"$ref": ref}})
    return {"type": "object", "properties": properties, "additionalProperties": False, "minProperties": 1,
            "description": f"a filter over the served version's metadata fields (at most {MAX_NODES} conditions)"}
