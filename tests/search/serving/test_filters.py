"""The filter language (search/serving/filters.py) against a plain-Python evaluator, and filtered
search (SearchSnapshot.search with a mask) against brute force over the subset."""
from __future__ import annotations

import numpy as np
import pytest

from index.metadata import Metadata, MetadataColumns
from search.serving.filters import FilterError, parse_filter

TYPES = {"class": "str", "path": "str", "size": "int", "score": "float", "ok": "bool"}


def _metadata(n: int, seed: int) -> tuple[list[str], Metadata]:
    rng = np.random.default_rng(seed)
    ids = [f"item{i}" for i in range(n)]
    items = {}
    for i, iid in enumerate(ids):
        v = {}
        if rng.random() > 0.1:
            v["class"] = str(rng.choice(["apps", "food", "animals"]))
        if rng.random() > 0.1:
            v["path"] = f"{rng.choice(['a', 'ab', 'b'])}/{i}.png"
        if rng.random() > 0.1:
            v["size"] = int(rng.integers(0, 100))
        if rng.random() > 0.1:
            v["score"] = float(rng.normal())
        if rng.random() > 0.1:
            v["ok"] = bool(rng.random() > 0.5)
        items[iid] = v
    return ids, Metadata(dict(TYPES), items)


def _reference(spec, values: dict) -> bool:
    """The filter semantics written out item by item (a missing value fails every condition)."""
    ok = True
    for name, cond in spec.items():
        if name == "and":
            ok &= all(_reference(s, values) for s in cond)
        elif name == "or":
            ok &= any(_reference(s, values) for s in cond)
        elif name == "not":
            ok &= not _reference(cond, values)
        else:
            v = values.get(name)
            cond = cond if isinstance(cond, dict) else {"eq": cond}
            for op, x in cond.items():
                if v is None:
                    ok = False
                elif op == "eq":
                    ok &= v == x
                elif op == "in":
                    ok &= v in x
                elif op == "prefix":
                    ok &= v.startswith(x)
                else:
                    ok &= {"gt": v > x, "gte": v >= x, "lt": v < x, "lte": v <= x}[op]
    return ok


def _random_filter(rng, depth=0):
    leaves = [lambda: {"class": str(rng.choice(["apps", "food", "animals", "none"]))},
              lambda: {"class": {"in": list(rng.choice(["apps", "food", "animals"], size=2, replace=False))}},
              lambda: {"path": {"prefix": str(rng.choice(["a", "ab", "b/", ""]))}},
              lambda: {"size": {str(rng.choice(["gt", "gte", "lt", "lte"])): int(rng.integers(0, 100))}},
              lambda: {"size": {"gte": 20, "lt": 60}},
              lambda: {"score": {"lt": float(rng.normal())}},
              lambda: {"ok": bool(rng.random() > 0.5)},
              lambda: {"size": int(rng.integers(0, 100))}]
    if depth < 2 and rng.random() < 0.5:
        op = str(rng.choice(["and", "or", "not"]))
        if op == "not":
            return {"not": _random_filter(rng, depth + 1)}
        return {op: [_random_filter(rng, depth + 1) for _ in range(int(rng.integers(1, 4)))]}
    return leaves[int(rng.integers(len(leaves)))]()


def test_random_filters_equal_the_item_by_item_reference():
    ids, meta = _metadata(400, 0)
    cols = MetadataColumns.build(meta, ids)
    rng = np.random.default_rng(1)
    nonempty = 0
    for _ in range(300):
        spec = _random_filter(rng)
        mask = parse_filter(spec, meta.types).mask(cols)
        ref = np.array([_reference(spec, meta.items[i]) for i in ids])
        np.testing.assert_array_equal(mask, ref, err_msg=str(spec))
        nonempty += 0 < ref.sum() < len(ids)
    assert nonempty > 100   # the random filters select proper subsets, not only all or nothing


@pytest.mark.parametrize("spec, field, needle", [
    ({"colour": "red"}, "colour", "unknown field 'colour'"),
    ({"class": 3}, "class", "field 'class' is str; got 3"),
    ({"size": "big"}, "size", "field 'size' is int"),
    ({"class": {"gt": "a"}}, "class", "ranges need a numeric field"),
    ({"size": {"prefix": "1"}}, "size", "prefix needs a string field"),
    ({"size": {"near": 3}}, "size", "unknown operator 'near'"),
    ({"class": {"in": []}}, "class", "must be a list"),
    ({"or": {"class": "a"}}, None, "must be a non-empty list"),
    ({}, None, "non-empty JSON object"),
    ("{not json", None, "not JSON"),
    ({"ok": 1}, "ok", "field 'ok' is bool"),
])
def test_bad_filters_name_the_field(spec, field, needle):
    with pytest.raises(FilterError, match=needle) as err:
        parse_filter(spec, TYPES)
    assert err.value.field == field


def test_filter_text_and_dict_compile_to_the_same_key():
    a = parse_filter({"size": {"lt": 5, "gt": 1}, "class": "apps"}, TYPES)
    b = parse_filter('{"class": "apps", "size": {"gt": 1, "lt": 5}}', TYPES)
    assert a.key == b.key and a.fields == {"class", "size"}
