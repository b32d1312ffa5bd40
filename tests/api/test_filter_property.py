"""Property test of the filter language over HTTP (hypothesis): arbitrary JSON of any depth (up to
10^5 levels), huge and non-finite numbers, long strings, every field type (str, int, float, bool), on
the JSON routes (/v1/search/vector, /item, /batch) and the multipart ones (/v1/search, /batch).

Every request is answered within the hypothesis deadline, never with a 5xx, and exactly as a plain-Python
reference of the documented language says: 200 with `matched` = the items the reference passes (over
each item's fields as GET /v1/items/{id} reports them), 422 for a filter the reference refuses, 400 for
nesting deeper than MAX_DEPTH or text the JSON parser cannot read (multipart: 422 bad_filter)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from datetime import timedelta

import pytest
from api_helpers import ADMIN_TOKEN, make_checkpoint, png_bytes
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from api.app import create_app
from api.config import Settings
from index.build import BuildOptions, build_index
from index.metadata import load_user_metadata
from search.serving.filters import MAX_DEPTH, MAX_IN_VALUES, MAX_NODES

FLOAT_MAX = sys.float_info.max
#: Starlette's limit on one multipart text part (a longer filter is 400)
MAX_PART_BYTES = 1024 * 1024
TAGS = ["apps", "app", "", "[", '{"x"', "a\x00b", "\u03b1\u03b2", "apps/food"]
RANGES = ("gt", "gte", "lt", "lte")


class Raw:
    """JSON text written as it is (numbers Python's json module cannot write: 5,000 digits, 1e400)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


def dump(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k) + ":" + dump(v) for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)  # NaN / Infinity for non-finite floats, as Python's json reads them


# ---- the reference: the documented language, item by item -----------------------------------------------


class Refused(Exception):
    pass


def _number(x) -> bool:
    return (
        isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= FLOAT_MAX
    )  # NaN compares False


def _value_ok(kind: str, x) -> bool:
    return {"str": isinstance(x, str), "bool": isinstance(x, bool), "int": _number(x), "float": _number(x)}[
        kind
    ]


def check(spec, types: dict, count: list) -> None:
    """Raise Refused unless `spec` is a valid filter over `types` (at most MAX_NODES condition objects)."""
    count[0] += 1
    if count[0] > MAX_NODES or not isinstance(spec, dict) or not spec:
        raise Refused
    for name, cond in spec.items():
        if name in ("and", "or"):
            if not isinstance(cond, list) or not cond:
                raise Refused
            for sub in cond:
                check(sub, types, count)
        elif name == "not":
            check(cond, types, count)
        else:
            if name not in types:
                raise Refused
            kind = types[name]
            ops = cond if isinstance(cond, dict) else {"eq": cond}
            if not ops:
                raise Refused
            for op, x in ops.items():
                if op == "eq":
                    ok = _value_ok(kind, x)
                elif op == "in":
                    ok = (
                        isinstance(x, list)
                        and 0 < len(x) <= MAX_IN_VALUES
                        and all(_value_ok(kind, v) for v in x)
                    )
                elif op in RANGES:
                    ok = kind in ("int", "float") and _value_ok(kind, x)
                elif op == "prefix":
                    ok = kind == "str" and isinstance(x, str)
                else:
                    ok = False
                if not ok:
                    raise Refused


def passes(spec, item: dict) -> bool:
    """Whether an item (its fields; a missing field fails every condition on it) passes a valid filter."""
    result = True
    for name, cond in spec.items():
        if name == "and":
            result &= all(passes(s, item) for s in cond)
        elif name == "or":
            result &= any(passes(s, item) for s in cond)
        elif name == "not":
            result &= not passes(cond, item)
        else:
            ops = cond if isinstance(cond, dict) else {"eq": cond}
            v = item.get(name)
            for op, x in ops.items():
                if v is None:
                    result = False
                elif op == "eq":
                    result &= _same(v, x)
                elif op == "in":
                    result &= any(_same(v, y) for y in x)
                elif op == "prefix":
                    result &= v.startswith(x)
                else:  # numbers compare as float64
                    a, b = float(v), float(x)
                    result &= {"gt": a > b, "gte": a >= b, "lt": a < b, "lte": a <= b}[op]
    return result


def _same(v, x) -> bool:
    return v == x if isinstance(v, str) else float(v) == float(x)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _text_depth(text: str) -> int:
    """Deepest [ / { nesting of JSON text, brackets inside strings not counted (a character scan)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def expected(text: str, multipart: bool, types: dict, items: list[dict]):
    """({statuses}, matched) the documented behaviour gives for a filter sent as `text`."""
    if multipart and len(text.encode()) > MAX_PART_BYTES:
        return {400}, None
    try:
        spec = json.loads(text)
        too_deep = _depth(spec) > MAX_DEPTH
    except RecursionError:
        spec, too_deep = None, True
    except json.JSONDecodeError:  # not JSON: too deep by its brackets (400) or unreadable (422 bad_filter)
        if not multipart:
            return {400}, None
        # where unterminated strings make "nesting" ambiguous, either answer is the documented one
        return ({400, 422} if _text_depth(text) > MAX_DEPTH else {422}), None
    except ValueError:  # well-formed, but an integer over Python's 4,300-digit limit
        if not multipart:
            return {400}, None
        return ({400} if _text_depth(text) > MAX_DEPTH else {422}), None  # depth is counted on the text first
    if not multipart and not isinstance(spec, (dict, type(None))):
        # a JSON body's `filter` must be an object: 422 for anything else, or 400 where the body's
        # parser gives up first (nested deeper than it reads)
        return ({400, 422} if too_deep else {422}), None
    if too_deep:
        return {400}, None
    if spec is None:
        return {200}, None
    try:
        check(spec, types, [0])
    except Refused:
        return {422}, None
    return {200}, sum(passes(spec, item) for item in items)


# ---- strategies ----------------------------------------------------------------------------------------

FIELDS = {"tag": "str", "count": "int", "score": "float", "flag": "bool"}
NAMES = [
    "tag",
    "count",
    "score",
    "flag",
    "and",
    "or",
    "not",
    "eq",
    "in",
    "gt",
    "gte",
    "lt",
    "lte",
    "prefix",
    "colour",
    "",
]
HUGE = st.one_of(
    st.sampled_from(
        [
            10**400,
            -(10**400),
            2**1024,
            int(FLOAT_MAX),
            -int(FLOAT_MAX),
            int(FLOAT_MAX) + 2**971,
            2**53 + 1,
            float(FLOAT_MAX),
            5e-324,
        ]
    ),
    st.integers(300, 6000).map(lambda n: Raw("9" * n)),  # beyond float64, and beyond Python's digit limit
    st.sampled_from([Raw("1e400"), Raw("-1e999"), Raw("NaN"), Raw("-Infinity"), Raw("1E+309")]),
)
NUMBERS = st.one_of(st.integers(-6, 6), st.integers(), st.floats(), HUGE)
LONG_TEXT = st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=3), st.integers(1, 120_000))
TEXT = st.one_of(st.sampled_from(TAGS), st.text(max_size=12), LONG_TEXT)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=8)), inner, max_size=4),
    ),
    max_leaves=12,
)
VALUE = {
    "str": st.one_of(st.sampled_from(TAGS), TEXT),
    "int": NUMBERS,
    "float": NUMBERS,
    "bool": st.booleans(),
}


SHAPES = {
    "str": ["eq", "in", "prefix"],
    "bool": ["eq", "in"],
    "int": ["eq", "in", "range"],
    "float": ["eq", "in", "range"],
}
SENSIBLE = {
    "str": st.sampled_from(TAGS),
    "bool": st.booleans(),
    "int": st.integers(-6, 6),
    "float": st.sampled_from([-3.0, -0.0, 0.25, 1e-300, 1.5e300, 2.0]),
}


@st.composite
def condition(draw):
    """One field's condition: mostly well formed (a field's own operators and values near the stored
    ones), now and then any field name, operator, shape or value."""
    wild = draw(st.integers(0, 4)) == 0
    field = (
        draw(st.sampled_from(sorted(FIELDS) + ["colour"])) if wild else draw(st.sampled_from(sorted(FIELDS)))
    )
    kind = FIELDS.get(field, "str")
    value = draw(st.sampled_from([VALUE[kind], ANY_JSON])) if wild else SENSIBLE[kind]
    shapes = ["eq", "dict", "in", "range", "prefix"] if wild else SHAPES[kind]
    shape = draw(st.sampled_from(shapes))
    if shape == "eq":
        return {field: draw(value)}
    if shape == "in":
        return {field: {"in": draw(st.lists(value, min_size=0 if wild else 1, max_size=5))}}
    if shape == "range":
        return {
            field: {op: draw(value) for op in draw(st.lists(st.sampled_from(RANGES), min_size=1, max_size=2))}
        }
    if shape == "prefix":
        return {field: {"prefix": draw(value)}}
    return {
        field: draw(
            st.dictionaries(st.sampled_from(["eq", "in", "gt", "lt", "prefix", "near"]), value, max_size=3)
        )
    }


FILTERS = st.recursive(
    condition(),
    lambda inner: st.one_of(
        st.builds(lambda fs: {"and": fs}, st.lists(inner, max_size=3)),
        st.builds(lambda fs: {"or": fs}, st.lists(inner, max_size=3)),
        st.builds(lambda f: {"not": f}, inner),
        st.builds(lambda a, b: {**a, **b}, inner, inner),
    ),
    max_leaves=8,
)

#: (prefix, suffix) wrapping a filter text n times: deep nesting without building it as objects
WRAPS = [
    ("[", "]"),
    ('{"not":', "}"),
    ('{"and":[', "]}"),
    ('{"or":[{"tag":"apps"},', "]}"),
    ('{"count":{"in":[', "]}}"),
]


@st.composite
def filter_text(draw) -> str:
    text = dump(draw(st.one_of(FILTERS, FILTERS, ANY_JSON, st.none())))
    if draw(st.integers(0, 3)) == 0:
        prefix, suffix = draw(st.sampled_from(WRAPS))
        n = draw(st.one_of(st.integers(0, 2 * MAX_DEPTH), st.integers(0, 100_000)))
        text = prefix * n + text + suffix * n
    return text


# ---- the served index: synthetic items with one user field of each type ---------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, api_dataset):
    base = tmp_path_factory.mktemp("filter_property")
    ids = api_dataset.item_ids()
    lines = []
    for n, item_id in enumerate(ids):
        row = {"id": item_id}
        if n % 7:
            row["tag"] = TAGS[n % len(TAGS)]
        if n % 5:
            row["count"] = [-5, 0, 1, 3, 2**60, 6][n % 6]
        if n % 3:
            row["score"] = [-0.0, 1e-300, -2.5, 1.5e300, 0.25][n % 5]
        if n % 4:
            row["flag"] = n % 2 == 0
        lines.append(json.dumps(row))
    (base / "user.jsonl").write_text("\n".join(lines) + "\n")
    ck = make_checkpoint(base / "encoder.safetensors", seed=3)
    build_index(
        ck,
        api_dataset,
        base / "index",
        BuildOptions(progress=False, metadata=load_user_metadata(base / "user.jsonl")),
    )
    app = create_app(Settings(index_root=base / "index", admin_token=ADMIN_TOKEN))
    with TestClient(app, raise_server_exceptions=False) as client:
        info = client.get("/v1/index").json()
        types = info["fields"]
        assert {k: types[k] for k in FIELDS} == FIELDS
        items = [client.get(f"/v1/items/{i}").json()["fields"] for i in ids]
        assert sum("flag" in it for it in items) == sum(1 for n in range(len(ids)) if n % 4)
        yield {
            "client": client,
            "types": types,
            "items": items,
            "ids": ids,
            "dim": info["dim"],
            "png": png_bytes(api_dataset.image(0)),
            "vector": [1.0] + [0.0] * (info["dim"] - 1),
        }


def _send(served, route: str, text: str):
    client, vector = served["client"], json.dumps(served["vector"])
    if route == "vector":
        return client.post(
            "/v1/search/vector",
            content=f'{{"vector":{vector},"k":3,"filter":{text}}}',
            headers={"content-type": "application/json"},
        )
    if route == "item":
        return client.post(
            "/v1/search/item",
            content=f'{{"id":{json.dumps(served["ids"][1])},"k":3,"include_self":true,"filter":{text}}}',
            headers={"content-type": "application/json"},
        )
    if route == "batch":
        return client.post(
            "/v1/search/batch",
            content=f'{{"vectors":[{vector},{vector}],"k":3,"filter":{text}}}',
            headers={"content-type": "application/json"},
        )
    if route == "image":
        return client.post(
            "/v1/search",
            files={"file": ("q.png", served["png"], "image/png")},
            data={"k": "3", "filter": text},
        )
    return client.post(
        "/v1/search/batch",
        files=[("files", ("q.png", served["png"], "image/png"))],
        data={"k": "3", "filter": text},
    )


ROUTES = ["vector", "item", "batch", "image", "image_batch"]


def test_every_filter_is_answered_as_the_reference_says(served):
    seen: Counter = Counter()  # (route, status) -> requests; "some" -> 200s matching some items
    slowest = [0.0]

    @given(text=filter_text(), route=st.sampled_from(ROUTES))
    # deeper than MAX_DEPTH and holding an integer Python will not convert: the depth, counted on the
    # text first, answers (400) on a multipart route too
    @example(text="[" * (MAX_DEPTH + 6) + "1" * 5000 + "]" * (MAX_DEPTH + 6), route="image")
    @example(text="[" * (MAX_DEPTH + 6) + "1" * 5000 + "]" * (MAX_DEPTH + 6), route="vector")
    @settings(
        max_examples=400,
        deadline=timedelta(seconds=20),
        database=None,
        derandomize=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    def run(text, route):
        start = time.perf_counter()
        r = _send(served, route, text)  # the deadline bounds each request (generously: a shared CI box)
        slowest[0] = max(slowest[0], time.perf_counter() - start)
        assert r.status_code < 500, r.text
        multipart = route.startswith("image")
        statuses, matched = expected(text, multipart, served["types"], served["items"])
        assert r.status_code in statuses, (r.status_code, r.text[:300])
        body = r.json()
        seen[route, r.status_code] += 1
        if r.status_code != 200:
            assert body["error"] and body["detail"]
            return
        answers = body["responses"] if "responses" in body else [body]
        assert [a["matched"] for a in answers] == [matched] * len(answers)
        seen["some"] += matched is not None and 0 < matched < len(served["items"])

    run()
    print(
        "filter property test, requests by (route, status):",
        dict(sorted(seen.items(), key=str)),
        f"slowest request {slowest[0]:.3f} s",
    )
    # the examples reached every outcome on every route: answered filters (some selecting a proper
    # subset), refused ones (422) and ones nested too deep or unreadable (400)
    for route in ROUTES:
        assert min(seen[route, 200], seen[route, 422], seen[route, 400]) > 0, (route, seen)
    assert seen["some"] >= 20, seen
