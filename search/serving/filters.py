"""The filter language of the search routes, compiled to a boolean mask over index rows.

A filter is JSON over the version's metadata fields (index/metadata.py):

    {"class": "apps"}                                   field equals a value
    {"class": {"in": ["apps", "food"]}}                 one of several values
    {"size": {"gte": 1000, "lt": 50000}}                ranges on numeric fields (gt, gte, lt, lte)
    {"path": {"prefix": "animals/"}}                    string prefix
    {"and": [F, ...]}, {"or": [F, ...]}, {"not": F}     combinations; several keys in one object mean "and"

An item without a value for a field matches no condition on it (it matches ``not`` of one).
`parse_filter` checks every field name, operator and value type against the field types and
raises FilterError naming the field; `Filter.mask(columns)` evaluates it with numpy. Numbers are
compared as float64, so a number beyond +-MAX_NUMBER (a JSON integer of 400 digits) is refused;
a filter nested more than MAX_DEPTH levels is refused before it is decoded.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from index.metadata import MetadataColumns

RANGE_OPS = {"gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}
MAX_NODES = 256  # conditions per filter: bounds the work one request can ask for
MAX_IN_VALUES = 4096
#: the largest magnitude a filter number may have: the metadata columns are float64
MAX_NUMBER = sys.float_info.max
#: levels of JSON nesting a filter may have (objects and lists; `{"a": {"in": [1]}}` is 3): about 30
#: nested and / or lists. Below every JSON parser's own limit on the routes (pydantic's is 200), so the same
#: filter is answered the same on every route, and checked before decoding (400 beyond it)
MAX_DEPTH = 64
#: a JSON string (escapes included), removed before the brackets of a filter text are counted
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]++")


class FilterError(ValueError):
    """A filter that cannot run on this index version; `field` names the offending field (or None).
    `status` and `code` are what the API answers (422 bad_filter)."""

    status, code = 422, "bad_filter"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class FilterTooDeep(FilterError):
    """A filter nested deeper than MAX_DEPTH: refused as the JSON parser refuses a body nested too deep
    (400)."""

    status, code = 400, "filter_too_deep"

    def __init__(self):
        super().__init__(f"filter is nested more than {MAX_DEPTH} levels deep (objects and lists)")


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
        if text_depth(spec) > MAX_DEPTH:
            raise FilterTooDeep()
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as err:
            raise FilterError(f"filter is not JSON ({err.msg})") from None
        except RecursionError:  # not reached below MAX_DEPTH; kept so no parser limit ever becomes a 500
            raise FilterTooDeep() from None
        except ValueError as err:  # e.g. an integer literal longer than Python converts (4300 digits)
            raise FilterError(
                f"filter is not JSON this server reads ({str(err).split(':')[0][:80]})"
            ) from None
    elif filter_depth(spec) > MAX_DEPTH:
        raise FilterTooDeep()
    counter = [0]
    fields: set[str] = set()
    try:
        evaluate = _node(spec, types, counter, fields, "filter")
    except RecursionError:
        raise FilterTooDeep() from None
    key = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return Filter(key, evaluate, frozenset(fields))


def text_depth(text: str) -> int:
    """Deepest bracket nesting of JSON text, strings left out: the depth json.loads would recurse to."""
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    if not brackets:
        return 0
    opens = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((opens == ord("[")) | (opens == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def filter_depth(spec: Any) -> int:
    """Nesting of decoded JSON (objects and lists), walked without recursion, stopping past MAX_DEPTH."""
    deepest, stack = 0, [(spec, 0)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, (dict, list)):
            level += 1
            deepest = max(deepest, level)
            if deepest > MAX_DEPTH:
                break
            stack.extend((v, level) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def _name(name: str) -> str:
    """A field or operator name quoted for a message, cut to 40 characters."""
    return repr(name if len(name) <= 40 else name[:37] + "...")


def _show(value: Any, limit: int = 40) -> str:
    """`value` as short JSON for a message (a huge integer by its size, a long text cut)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits} digits"
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _node(spec: Any, types: dict[str, str], counter: list[int], fields: set[str], where: str):
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise FilterError(f"filter has more than {MAX_NODES} conditions")
    if not isinstance(spec, dict) or not spec:
        raise FilterError(f"{where} must be a non-empty JSON object, got {_show(spec, 60)}")
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
        raise FilterError(f"unknown field {_name(field)} in {where} (fields: {known})", field)
    kind = types[field]
    if not isinstance(value, dict):  # {"field": value} is equality
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
                raise FilterError(
                    f"{where}.{field}.{op}: ranges need a numeric field; {field!r} is {kind}", field
                )
            v = _scalar(field, kind, operand)
            tests.append(lambda c, v=v, f=RANGE_OPS[op]: c.present[field] & f(c.values[field], v))
        elif op == "prefix":
            if kind != "str" or not isinstance(operand, str):
                raise FilterError(
                    f"{where}.{field}.prefix needs a string field and a string; {field!r} is {kind}", field
                )
            tests.append(lambda c, p=operand: c.present[field] & _startswith(c.values[field], p))
        else:
            raise FilterError(
                f"{where}.{field}: unknown operator {_name(op)} (use in, gt, gte, lt, lte, prefix, "
                "or a value for equality)",
                field,
            )
    return _fold(tests, np.logical_and)


def _scalar(field: str, kind: str, value: Any):
    """`value` checked against the field's type (int and float fields accept any finite number within
    +-MAX_NUMBER: the columns are float64, and float() of a larger integer overflows)."""
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, (int, float)) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
    }[kind]
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise FilterError(f"field {field!r} is {kind}; got {_show(value)}", field)
    if kind in ("int", "float") and abs(value) > MAX_NUMBER:  # exact for any int: no float() yet
        raise FilterError(
            f"field {field!r}: {_show(value)} is out of range (a filter number is at most "
            f"{MAX_NUMBER:.6g} in magnitude)",
            field,
        )
    return float(value) if kind in ("int", "float", "bool") else value


def _equal(cols: MetadataColumns, field: str, value) -> np.ndarray:
    if isinstance(value, str) and value.endswith("\0"):  # numpy would read the NUL as padding ("a\0" == "a")
        return np.zeros(cols.count, dtype=bool)  # and a column holds no value ending in one
    return cols.present[field] & (cols.values[field] == value)


def _startswith(column: np.ndarray, prefix: str) -> np.ndarray:
    """Rows whose string starts with `prefix`; numpy drops a prefix's trailing NULs, so such a prefix
    is compared in Python."""
    if prefix.endswith("\0"):
        return np.fromiter((str(v).startswith(prefix) for v in column), dtype=bool, count=len(column))
    return np.char.startswith(column, prefix)


def _member(cols: MetadataColumns, field: str, values: list) -> np.ndarray:
    column = cols.values[field]
    if column.dtype.kind == "U":  # a value longer than every stored one matches none; an array of the
        width = column.dtype.itemsize // 4  # long ones would take len(values) x the longest of them
        values = [v for v in values if len(v) <= width and not v.endswith("\0")]  # as in _equal
        if not values:
            return np.zeros(column.shape, dtype=bool)
    return cols.present[field] & np.isin(column, np.asarray(values))


def filter_json_schema(types: dict[str, str], ref: str) -> dict:
    """The JSON Schema of a filter over fields `types` ({field: str|int|float|bool}); `ref` is where the
    schema itself lives (its and / or / not recurse through it). Every filter it admits parses here;
    the schema states the MAX_NODES and MAX_DEPTH bounds only in its description."""
    number = {"type": "number", "minimum": -MAX_NUMBER, "maximum": MAX_NUMBER}
    scalar = {"str": {"type": "string"}, "bool": {"type": "boolean"}, "int": number, "float": number}
    properties: dict[str, Any] = {}
    for field, kind in types.items():
        value = scalar[kind]
        ops = {"eq": value, "in": {"type": "array", "items": value, "minItems": 1, "maxItems": MAX_IN_VALUES}}
        if kind in ("int", "float"):
            ops.update({op: value for op in RANGE_OPS})
        if kind == "str":
            ops["prefix"] = value
        properties[field] = {
            "anyOf": [
                value,
                {"type": "object", "properties": ops, "additionalProperties": False, "minProperties": 1},
            ]
        }
    branch = {"type": "array", "items": {"$ref": ref}, "minItems": 1}
    properties.update({"and": branch, "or": branch, "not": {"$ref": ref}})
    return {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "minProperties": 1,
        "description": f"a filter over the served version's metadata fields (at most {MAX_NODES} conditions, "
        f"nested at most {MAX_DEPTH} levels)",
    }
