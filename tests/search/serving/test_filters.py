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
    leaves = [
        lambda: {"class": str(rng.choice(["apps", "food", "animals", "none"]))},
        lambda: {"class": {"in": list(rng.choice(["apps", "food", "animals"], size=2, replace=False))}},
        lambda: {"path": {"prefix": str(rng.choice(["a", "ab", "b/", ""]))}},
        lambda: {"size": {str(rng.choice(["gt", "gte", "lt", "lte"])): int(rng.integers(0, 100))}},
        lambda: {"size": {"gte": 20, "lt": 60}},
        lambda: {"score": {"lt": float(rng.normal())}},
        lambda: {"ok": bool(rng.random() > 0.5)},
        lambda: {"size": int(rng.integers(0, 100))},
    ]
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
    assert nonempty > 100  # the random filters select proper subsets, not only all or nothing


@pytest.mark.parametrize(
    "spec, field, needle",
    [
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
    ],
)
def test_bad_filters_name_the_field(spec, field, needle):
    with pytest.raises(FilterError, match=needle) as err:
        parse_filter(spec, TYPES)
    assert err.value.field == field


def test_filter_text_and_dict_compile_to_the_same_key():
    a = parse_filter({"size": {"lt": 5, "gt": 1}, "class": "apps"}, TYPES)
    b = parse_filter('{"class": "apps", "size": {"gt": 1, "lt": 5}}', TYPES)
    assert a.key == b.key and a.fields == {"class", "size"}


def _true_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_true_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_true_depth(v) for v in value), default=0)
    return 0


def test_the_text_depth_is_the_decoded_depth():
    """The bracket count run before json.loads agrees with the depth of what json.loads returns, strings
    (brackets and escaped quotes inside them) left out."""
    from search.serving.filters import filter_depth, text_depth

    rng = np.random.default_rng(3)

    def random_json(level):
        pick = rng.integers(0, 6) if level < 12 else 5
        if pick <= 1:
            return [random_json(level + 1) for _ in range(rng.integers(0, 3))]
        if pick <= 3:
            return {
                str(rng.choice(["a", "[", '"{', "\\]"])) + str(i): random_json(level + 1)
                for i in range(rng.integers(0, 3))
            }
        return str(rng.choice(["x", "[[[", '\\"}', "{", 3, None]))

    for _ in range(300):
        value = random_json(0)
        text = __import__("json").dumps(value)
        assert text_depth(text) == _true_depth(value) == filter_depth(value), text


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"size": {"gte": 10**400}}, "out of range"),
        ({"score": -(10**309)}, "out of range"),
        ({"size": {"in": [1, 2**1024]}}, "out of range"),
        ({"score": float("nan")}, "field 'score' is float; got NaN"),
        ({"score": {"lt": float("inf")}}, "got Infinity"),
    ],
)
def test_numbers_beyond_float64_are_refused_by_name(spec, needle):
    with pytest.raises(FilterError, match=needle) as err:
        parse_filter(spec, TYPES)
    assert err.value.field in spec or err.value.field in ("size", "score")
    assert err.value.status == 422 and len(str(err.value)) < 200


def test_the_largest_float64_compares_and_a_long_in_list_costs_no_memory():
    import sys

    ids, meta = _metadata(200, 0)
    cols = MetadataColumns.build(meta, ids)
    biggest = int(sys.float_info.max)  # exactly representable: accepted, compared as itself
    has_size = np.array(["size" in meta.items[i] for i in ids])
    np.testing.assert_array_equal(parse_filter({"size": {"lt": biggest}}, TYPES).mask(cols), has_size)
    assert not parse_filter({"size": {"gt": biggest}}, TYPES).mask(cols).any()
    # 1,000 values, one of 250,000 characters: no (1,000 x 250,000) array (1 GB) is built; the short one
    # matches
    spec = {"class": {"in": ["x" * 250_000] + ["apps"] + [""] * 998}}
    mask = parse_filter(spec, TYPES).mask(cols)
    np.testing.assert_array_equal(mask, [meta.items[i].get("class") == "apps" for i in ids])
    assert not parse_filter({"class": {"in": ["y" * 1_000_000]}}, TYPES).mask(cols).any()


def test_nesting_deeper_than_a_valid_filter_is_refused_before_decoding():
    from search.serving.filters import MAX_DEPTH, FilterTooDeep

    for text in ("[" * 100_000, '{"not":' * 2000 + '{"ok": true}' + "}" * 2000):
        with pytest.raises(FilterTooDeep) as err:
            parse_filter(text, TYPES)
        assert err.value.status == 400 and err.value.code == "filter_too_deep"
    deep: object = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(FilterTooDeep):
        parse_filter({"size": {"in": deep}}, TYPES)


def test_a_trailing_nul_is_part_of_the_value():
    """numpy reads trailing NULs as padding ('apps\\0' == 'apps' on a str array); the filter does not."""
    ids, meta = _metadata(200, 0)
    cols = MetadataColumns.build(meta, ids)
    apps = np.array([meta.items[i].get("class") == "apps" for i in ids])
    assert apps.any()
    for spec in ({"class": "apps\0"}, {"class": {"in": ["apps\0", "apps\0\0"]}}):
        assert not parse_filter(spec, TYPES).mask(cols).any(), spec
    np.testing.assert_array_equal(parse_filter({"class": {"in": ["apps\0", "apps"]}}, TYPES).mask(cols), apps)
    assert not parse_filter({"class": {"prefix": "app\0"}}, TYPES).mask(cols).any()
    np.testing.assert_array_equal(parse_filter({"class": {"prefix": "app"}}, TYPES).mask(cols), apps)
