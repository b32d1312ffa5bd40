"""Request and response bodies of the v1 API (they document the OpenAPI schema)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StrictBool, model_validator

#: Temperatures a client may ask for; outside this range exp(s / tau) is numerically meaningless.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
#: A query's softmax temperature; None: the served version's own.
QueryTemperature = Annotated[
    float | None,
    Field(
        ge=MIN_TEMPERATURE,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description="softmax temperature; default: the index's search_temperature",
    ),
]


OFFSET_DOC = "skip this many ranked hits (after the cut-offs): stable pages of k; at most max_k"
MIN_PROBABILITY_DOC = "drop hits whose probability p(j|x) is below this value"
MASS_DOC = "top-p: keep the shortest prefix of hits whose probabilities sum to at least this value"
FILTER_DOC = (
    "restrict the search to items whose metadata pass this filter (searched inside the index; "
    'probabilities become p(j|x,F) over the passing items): {"class": "apps"}, '
    '{"field": {"in": [...]}}, {"size": {"gte": 1000, "lt": 5000}}, '
    '{"path": {"prefix": "a/"}}, {"and"|"or": [...]}, {"not": {...}}; '
    "GET /v1/index lists the fields and their types"
)


class PageQuery(BaseModel):
    """Cut-offs and paging shared by the JSON search routes."""

    offset: int = Field(0, ge=0, description=OFFSET_DOC)
    min_probability: float | None = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False, description=MIN_PROBABILITY_DOC
    )
    mass: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False, description=MASS_DOC)
    filter: dict | None = Field(None, description=FILTER_DOC)


_PLAIN_NUMBERS = {float, int}


def _not_a_number(value) -> bool:
    return isinstance(value, (bool, str, bytes))


class JsonPageQuery(PageQuery):
    """A search query in a JSON body, whose numbers must be JSON numbers: pydantic's lax mode would
    also take `true` or "5" (the schema says number, so such a request is refused, 422), while its
    strict mode would refuse 1.0 for an integer (which JSON Schema calls an integer)."""

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_numbers(cls, data):
        if isinstance(data, dict):
            for name in ("k", "offset", "min_probability", "mass", "temperature"):
                if _not_a_number(data.get(name)):
                    raise ValueError(f"{name} must be a JSON number")
            vectors = [data["vector"]] if isinstance(data.get("vector"), list) else []
            vectors += (
                [v for v in data.get("vectors") or [] if isinstance(v, list)]
                if isinstance(data.get("vectors"), list)
                else []
            )
            # set(map(type, v)) runs in C: a 512-float vector costs ~10 us instead of a Python loop's ~150
            if any(
                not set(map(type, v)) <= _PLAIN_NUMBERS and any(_not_a_number(x) for x in v) for v in vectors
            ):
                raise ValueError("vector values must be JSON numbers")
        return data


class ErrorResponse(BaseModel):
    error: str = Field(description="short machine-readable code, e.g. not_an_image, k_out_of_range")
    detail: str = Field(description="what was wrong, naming the bad value")


class HitOut(BaseModel):
    id: str = Field(description="stable item id, e.g. synthetic/train/17")
    row: int = Field(description="row of the item in this index version")
    similarity: float = Field(description="cosine similarity s = z_query . z_item, in [-1, 1]")
    probability: float = Field(
        description="learned softmax search p(j|x) = exp(s_j/tau) / sum_l exp(s_l/tau) over the WHOLE index "
        "(exact, or with the bounded normaliser's estimate of the sum: see `normaliser`)"
    )


class NormaliserOut(BaseModel):
    method: str = Field(description="how log Z was computed: exact, or bounded (sampled tail)")
    lower: float = Field(description="deterministic lower bound on the exact log Z")
    upper: float = Field(description="deterministic upper bound on the exact log Z")
    interval: list[float] | None = Field(
        None, description="sampled [lower, upper] interval of log Z at `level` (bounded only)"
    )
    level: float | None = Field(None, description="coverage of the sampled interval")
    rows: int = Field(description="embedding rows read for this query's log Z")


class PeakednessOut(BaseModel):
    top1_probability: float = Field(description="p of the first hit")
    uniform_probability: float = Field(description="1 / count: every item equally likely")
    top1_vs_uniform: float = Field(description="top1_probability * count; near 1 means no preference at all")
    topk_mass: float = Field(description="sum of the returned hits' probabilities")
    effective_candidates_at_most: float = Field(
        description="upper bound on exp(H(p)) over the whole index: how many items share the probability"
    )
    near_uniform: bool = Field(description="top-1 below twice uniform: the search barely tells items apart")
    hint: str = Field(description="the same in plain words")


class SearchResponse(BaseModel):
    version: str = Field(description="index version that answered")
    k: int
    count: int = Field(description="items in that index version (the softmax runs over all of them)")
    temperature: float = Field(description="tau used for the probabilities")
    log_normaliser: float | None = Field(
        description="log sum_l exp(s_l / tau): exact, or the bounded estimate; "
        "null when a filter matches no item"
    )
    log_normalizer: float | None = Field(
        None,
        deprecated=True,
        description="the same value as log_normaliser (the old spelling, kept "
        "for clients written against it)",
    )
    normaliser: NormaliserOut | None = Field(
        None, description="the bound on log Z; each p lies in [exp(s/tau - upper), exp(s/tau - lower)]"
    )
    batch_size: int = Field(description="queries that shared this encoder/index call (micro-batching)")
    peakedness: PeakednessOut | None = Field(None, description="how peaked p(.|x) is compared with uniform")
    offset: int = Field(0, description="ranked hits skipped before `results`")
    n_passed: int = Field(
        description="ranked hits (among the k + offset fetched) that passed min_probability / mass"
    )
    more_may_pass: bool = Field(description="every fetched hit passed: more items beyond them may pass too")
    self_rank: int | None = Field(
        None,
        description="search by stored item only: the item's own 1-based rank "
        "among the hits (null when it is not within k + 1)",
    )
    matched: int | None = Field(
        None,
        description="filtered searches: items passing the filter; the softmax "
        "(and log_normaliser) runs over these only",
    )
    results: list[HitOut]


class VectorQuery(JsonPageQuery):
    vector: list[float] = Field(
        min_length=1,
        max_length=65536,
        description="query embedding, length = index dim; normalised to unit length",
    )
    k: int = Field(10, ge=1, description="results to return, 1..max_k")
    temperature: QueryTemperature = None


#: Queries one /v1/search/batch request may carry.
MAX_BATCH_QUERIES = 256


class BatchVectorQuery(JsonPageQuery):
    model_config = {"extra": "forbid"}
    vectors: list[list[float]] = Field(
        min_length=1, max_length=MAX_BATCH_QUERIES, description="query embeddings, each of length = index dim"
    )
    k: int = Field(10, ge=1, description="results per query, 1..max_k")
    temperature: QueryTemperature = None


class BatchImageForm(PageQuery):
    """The form fields of a multipart /v1/search/batch (the images are the `files` parts)."""

    model_config = {"extra": "forbid"}
    k: int = Field(10, ge=1)
    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False)


class BatchResponse(BaseModel):
    responses: list[SearchResponse] = Field(
        description="one answer per query, in request order, each what the single-query route would return"
    )


class DuplicatePairOut(BaseModel):
    a: str
    b: str
    p_ab: float = Field(
        description="probability that a and b are one picture edited (symmetric: p_ba equals it)"
    )
    p_ba: float = Field(description="the same probability (kept for clients of the older pair shape)")
    similarity: float = Field(description="the pair's probability (kept for clients of the older pair shape)")


class DuplicateGroupOut(BaseModel):
    ids: list[str]
    rows: list[int]
    confidence: float = Field(
        description="the lowest probability among the pairs that hold the group together"
    )
    pairs: list[DuplicatePairOut]


class SkippedOut(BaseModel):
    id: str
    error: str


class BaselineOut(BaseModel):
    name: str = Field(description="dHash, pHash, PDQ or cosine")
    rule: str = Field(description="the cut-off it was run at")
    pairs: int = Field(description="pairs of this version's items the rule calls duplicates")
    items: int = Field(description="items those pairs touch")
    pairs_in_scan_groups: int = Field(
        description="of those pairs, how many lie inside one of the scan's groups"
    )
    scan_pairs_kept_too: int = Field(description="of the scan's kept pairs, how many the rule keeps too")
    scan_pairs: int = Field(description="the scan's kept pairs")


class DuplicatesOut(BaseModel):
    version: str
    created: str
    count: int = Field(description="items in the version")
    threshold: float = Field(description="pair probability a pair had to reach to be kept")
    threshold_rule: str = Field(
        description="how the threshold was chosen (default, given, or from a precision)"
    )
    max_probability: float = Field(
        description="the highest pair probability the scan found (0 when no pairs)"
    )
    notes: list[str] = Field(
        description="what to know about this scan (a fit at a bound, no pair at the "
        "threshold, ...), each saying what to do; empty when nothing"
    )
    collection_share: float = Field(
        description="share of this version's items with a duplicate, estimated from the scan (no labels)"
    )
    copy_recall: float = Field(description="held-out synthetic edited copies found at the default threshold")
    skipped: list[SkippedOut] = Field(description="items whose image could not be read (not scanned)")
    identical_pairs: int = Field(
        0,
        description="items joined to another as an identical picture (same decoded "
        "pixels or thumbnails), at p 1",
    )
    baselines: list[BaselineOut] = Field(
        default_factory=list,
        description="what the usual rules (dHash, pHash, "
        "PDQ at their usual cut-offs, cosine >= 0.99) keep on the same items",
    )
    total_groups: int
    offset: int
    groups: list[DuplicateGroupOut]


class ItemQuery(JsonPageQuery):
    model_config = {"extra": "forbid"}
    id: str = Field(min_length=1, description="id of an indexed item: its stored embedding is the query")
    k: int = Field(10, ge=1, description="results to return, 1..max_k")
    temperature: QueryTemperature = None
    include_self: bool = Field(False, strict=True, description="keep the item itself in `results`")


class ItemSummary(BaseModel):
    id: str
    row: int
    thumbnail_url: str


class ItemSample(BaseModel):
    version: str
    count: int
    items: list[ItemSummary]


class ItemOut(BaseModel):
    id: str
    row: int
    version: str
    label: int | None = None
    class_name: str | None = None
    dataset: dict | None = Field(None, description="dataset spec the image is recovered from")
    thumbnail_url: str
    fields: dict = Field(
        default_factory=dict, description="the item's metadata fields (what filters select on)"
    )


class IndexOut(BaseModel):
    version: str
    count: int
    dim: int
    temperature: float = Field(description="default search temperature (manifest search_temperature)")
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="metadata fields a `filter` may use, with their types (str, int, float, bool)",
    )
    categories: dict[str, list[str]] = Field(
        default_factory=dict,
        description="distinct values of the string fields that have at most "
        "100 (e.g. the class folders), for filter pickers",
    )
    normaliser: dict | None = Field(
        None,
        description="how log Z is computed for this version: method (exact | "
        "bounded), what `auto` measured to choose it (probe), where "
        "the top-k comes from, the bounded estimate's settings",
    )
    manifest: dict


class ServiceConfigOut(BaseModel):
    max_k: int
    max_upload_bytes: int
    batching: bool
    report_url: str | None = Field(description="latest evaluation report, if the server has one")
    version: str | None
    rate_limit: dict | None = Field(
        None, description="per-client token bucket {rps, burst, key}; null when off"
    )


class ReloadRequest(BaseModel):
    version: str | None = Field(
        None,
        description="version to serve; default: the store's current one. A version "
        "that is not current is made current in the store too",
    )
    force: StrictBool = Field(
        False,
        description="serve it even if the activation rule refuses it (failed quality gate, "
        "recall below target); recorded as forced in the store's history",
    )


class ReloadOut(BaseModel):
    previous: str | None
    version: str
    changed: bool
    encoder_reloaded: bool
    count: int
    store_current: str | None = Field(None, description="the store's current version (equals `version`)")


class HealthOut(BaseModel):
    status: str
    version: str | None = Field(None, description="the index version being served; null before one is loaded")


ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "bad input (not an image, truncated, malformed JSON)"},
    413: {"model": ErrorResponse, "description": "upload or image too large"},
    415: {"model": ErrorResponse, "description": "wrong content type"},
    422: {"model": ErrorResponse, "description": "invalid parameter (k, temperature, vector)"},
    429: {"model": ErrorResponse, "description": "rate limited; see Retry-After"},
    503: {"model": ErrorResponse, "description": "no index loaded yet"},
}
