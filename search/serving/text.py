"""Text queries: a caption embedded by the version's text tower, searched like any query vector.

The text tower lives in the version's model file (index/models.py: the checkpoint holds both
towers, training/text.py). Probabilities are the same exact softmax over the whole database
(or the filtered subset) as for image queries, at the version's *text* temperature: the manifest's
`text.temperature`, calibrated on held-out captions at `index build` (search/evaluation/text_eval.py).
A version without a text tower (an image-only checkpoint, or one built from vectors) raises
`NoTextTowerError`, which the API answers with 409.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from index.manifest import DEFAULT_TEMPERATURE
from index.models import ModelStore, store_root_of
from search.serving.text_args import build_parser
from training.text import MAX_TEXT_CHARS, TextEncoder, load_text_encoder

logger = logging.getLogger(__name__)

__all__ = [
    "NoTextTowerError",
    "NO_TEXT_TOWER",
    "text_tower",
    "text_temperature",
    "encode_texts",
    "search_text",
    "check_texts",
]

NO_TEXT_TOWER = (
    "this index version has no text tower: build it from an image-text checkpoint to search by text"
)

_TOWERS: dict[str, TextEncoder | None] = {}  # model sha256 -> its text tower (None: the model has none)
_LOCK = threading.Lock()


class NoTextTowerError(RuntimeError):
    """A text query on a version whose model has no text tower."""

    def __init__(self, version: str):
        super().__init__(f"{NO_TEXT_TOWER} (index version {version})")
        self.version = version


def text_tower(snapshot) -> TextEncoder:
    """The text tower of the snapshot's model (loaded once per model sha256); NoTextTowerError if none."""
    manifest = snapshot.manifest
    record = manifest.checkpoint_record
    sha = record.sha256 if manifest.has_encoder else None
    if not sha:
        raise NoTextTowerError(snapshot.version)
    with _LOCK:
        if sha not in _TOWERS:
            path = ModelStore(store_root_of(snapshot.index.path)).resolve(record, snapshot.version)
            _TOWERS[sha] = load_text_encoder(path)
        tower = _TOWERS[sha]
    if tower is None:
        raise NoTextTowerError(snapshot.version)
    if tower.embed_dim != snapshot.dim:
        raise ValueError(
            f"the text tower embeds to {tower.embed_dim} dims, index version {snapshot.version} "
            f"has {snapshot.dim}"
        )
    return tower


def text_temperature(snapshot) -> float:
    """The manifest's calibrated text temperature; else the image search temperature (logged)."""
    record = snapshot.manifest.extra.get("text") or {}
    value = record.get("temperature") if isinstance(record, dict) else None
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    logger.warning(
        "index version %s records no text temperature; using the search temperature", snapshot.version
    )
    return float(snapshot.temperature or DEFAULT_TEMPERATURE)


def check_texts(texts: Sequence[str]) -> list[str]:
    """Non-empty strings of at most MAX_TEXT_CHARS characters, else ValueError naming the first bad one."""
    out = []
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"text {i} is empty; give words to search for")
        if len(t) > MAX_TEXT_CHARS:
            raise ValueError(f"text {i} has {len(t)} characters, at most {MAX_TEXT_CHARS} are accepted")
        out.append(t)
    return out


def encode_texts(snapshot, texts: Sequence[str]) -> np.ndarray:
    """(B, D) unit float32 embeddings of texts by the snapshot's text tower."""
    return text_tower(snapshot).encode(check_texts(list(texts)))


def search_text(
    snapshot, texts: Sequence[str], k: int, temperature: float | None = None, mask: np.ndarray | None = None
):
    """Top-k images for each text with exact probabilities (a SearchAnswer, search/serving/searcher.py)."""
    vectors = encode_texts(snapshot, texts)
    tau = text_temperature(snapshot) if temperature is None else float(temperature)
    return snapshot.search(vectors, k, tau, mask)


def main(argv: list[str] | None = None) -> int:
    """`softsearch search --index R --text WORDS`: the top-k images and their probabilities."""
    import json

    from search.serving.filters import FilterError, parse_filter
    from search.serving.searcher import Searcher

    args = build_parser().parse_args(argv)
    if args.k < 1:
        raise ValueError(f"--k must be a positive integer, got {args.k}")
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature must be positive, got {args.temperature}")
    if args.min_probability is not None and not 0 <= args.min_probability <= 1:
        raise ValueError(f"--min-probability must be in [0, 1], got {args.min_probability}")
    searcher = Searcher(args.index, optimise_encoder=False)
    searcher.load(args.version)
    snapshot = searcher.snapshot()
    mask = None
    if args.filter:
        try:
            spec = json.loads(args.filter)
            mask = snapshot.filter_mask(parse_filter(spec, snapshot.metadata_fields))
        except (json.JSONDecodeError, FilterError) as err:
            raise ValueError(f"--filter: {err}") from err
    try:
        answer = search_text(snapshot, args.text, args.k, args.temperature, mask)
    except NoTextTowerError as err:
        raise ValueError(str(err)) from err
    out = []
    for text, hits, tau in zip(args.text, answer, answer.temperatures):
        kept = [h for h in hits if args.min_probability is None or h.probability >= args.min_probability]
        out.append(
            {
                "text": text,
                "version": answer.version,
                "temperature": tau,
                "results": [
                    {"id": h.id, "row": h.row, "similarity": h.similarity, "probability": h.probability}
                    for h in kept
                ],
            }
        )
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0], indent=2))
        return 0
    for q in out:
        print(f"{q['text']!r}  (version {q['version']}, tau {q['temperature']:.4g})")
        for rank, h in enumerate(q["results"], 1):
            print(f"  {rank:>3}  {h['probability']:.6f}  {h['similarity']:+.4f}  {h['id']}")
    return 0
