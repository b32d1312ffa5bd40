"""Captions for image-text search: synthetic captions with an exact ideal, and captions people have.

Synthetic captions (`CaptionScheme`). Each of the synthetic image's three latent angles
(training/synthetic.py) is binned into equal-width arcs centred on named directions and written
as words: "a teal disc at the upper left, light from the north-east". Bin k of B covers
[2 pi k / B - pi / B, 2 pi k / B + pi / B). Because the caption is a function of the bins alone
and the latents are uniform on the torus, an image y with latents theta has

    p(y | c) = 1[theta in cell(c)] / vol(cell),   p(y) = 1 / (2 pi)^3,
    r(c, y) = p(y | c) / p(y) = n_cells * 1[cell(y) = cell(c)],

so the ideal text-to-image search over a database is uniform over the items in the caption's
cell (`CaptionIdeal.log_ratio`), exactly. Several sentence templates name the same cell; which
one is drawn is independent of the image, so r is unchanged. `oracle_text_embedding` and
`oracle_image_embedding` (one-hot per angle bin, scaled to unit length) give s = 1 inside the
cell and s <= 2/3 outside, so at a small temperature the learned search equals the ideal one up
to N e^{-1/(3 tau)}: the known-answer test for text queries.

Captions people have (`read_captions`): a folder with `captions.jsonl` lines
{"file": relative path, "text": caption} or a sidecar `NAME.txt` beside `NAME.png`; a sidecar's
first line that is not a `lang.utf8=` translation is the caption (sidecars that carry translations
of it, one `lang.utf8=text` line each, read the same way).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.synthetic import M, wrap_angles

logger = logging.getLogger(__name__)

__all__ = [
    "CaptionScheme",
    "CaptionIdeal",
    "DIRECTIONS",
    "HUES",
    "POSITIONS",
    "TEMPLATES",
    "oracle_text_embedding",
    "oracle_image_embedding",
    "read_captions",
    "CAPTIONS_FILE",
]

#: compass words, counter-clockwise from east (angle 0, the x axis), y up the image
DIRECTIONS = {
    4: ("east", "north", "west", "south"),
    8: ("east", "north-east", "north", "north-west", "west", "south-west", "south", "south-east"),
}
#: hue words on the synthetic hue wheel: angle 0 is red (the red channel peaks), 2 pi / 3 green, 4 pi / 3 blue
HUES = {3: ("red", "green", "blue"), 6: ("red", "yellow", "green", "teal", "blue", "magenta")}
#: disc positions on its orbit, counter-clockwise from the right
POSITIONS = {
    4: ("right", "top", "left", "bottom"),
    8: ("right", "upper right", "top", "upper left", "left", "lower left", "bottom", "lower right"),
}
#: sentences naming one cell; template t of a caption is drawn independently of the image
TEMPLATES = (
    "a {hue} disc at the {position}, light from the {direction}",
    "light from the {direction}, a {hue} disc at the {position}",
    "{hue} disc, {position}, lit from the {direction}",
    "the {position} holds a {hue} disc and the light comes from the {direction}",
)
CAPTIONS_FILE = "captions.jsonl"
_TRANSLATION = re.compile(r"^[A-Za-z_@-]+\.utf8=")


@dataclass(frozen=True)
class CaptionScheme:
    """Bins per latent angle: (gradient direction, disc hue, disc position)."""

    bins: tuple[int, int, int] = (8, 6, 8)

    def __post_init__(self) -> None:
        bins = tuple(int(b) for b in self.bins)
        object.__setattr__(self, "bins", bins)
        if len(bins) != M:
            raise ValueError(f"caption bins must name {M} angles, got {list(bins)}")
        for b, words, what in zip(bins, (DIRECTIONS, HUES, POSITIONS), ("direction", "hue", "position")):
            if b not in words:
                raise ValueError(f"caption {what} bins must be one of {sorted(words)}, got {b}")

    @property
    def n_cells(self) -> int:
        return int(np.prod(self.bins))

    @property
    def words(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return DIRECTIONS[self.bins[0]], HUES[self.bins[1]], POSITIONS[self.bins[2]]

    def bin_indices(self, latents: np.ndarray) -> np.ndarray:
        """(N, 3) angles -> (N, 3) int bins; bin k of B is centred on 2 pi k / B."""
        lat = wrap_angles(np.asarray(latents, dtype=np.float64).reshape(-1, M))
        b = np.asarray(self.bins, dtype=np.float64)
        return np.floor((lat * b / (2 * np.pi)) + 0.5).astype(np.int64) % np.asarray(self.bins)

    def cells(self, latents: np.ndarray) -> np.ndarray:
        """(N,) cell index = mixed-radix number of the three bins."""
        return self.cell_of_bins(self.bin_indices(latents))

    def cell_of_bins(self, bins: np.ndarray) -> np.ndarray:
        b = np.asarray(bins, dtype=np.int64).reshape(-1, M)
        return (b[:, 0] * self.bins[1] + b[:, 1]) * self.bins[2] + b[:, 2]

    def bins_of_cell(self, cells: np.ndarray) -> np.ndarray:
        c = np.asarray(cells, dtype=np.int64).reshape(-1)
        return np.stack(
            [c // (self.bins[1] * self.bins[2]), (c // self.bins[2]) % self.bins[1], c % self.bins[2]], axis=1
        )

    def caption(self, cell: int, template: int = 0) -> str:
        """The sentence of `template` naming `cell`."""
        d, h, p = (int(v) for v in self.bins_of_cell(np.array([cell]))[0])
        dirs, hues, positions = self.words
        return TEMPLATES[template % len(TEMPLATES)].format(
            direction=dirs[d], hue=hues[h], position=positions[p]
        )

    def captions(self, latents: np.ndarray, templates: np.ndarray | None = None) -> list[str]:
        """One caption per row of latents; `templates` (N,) ints pick the sentence (default: the first)."""
        cells = self.cells(latents)
        t = np.zeros(cells.size, dtype=np.int64) if templates is None else np.asarray(templates).reshape(-1)
        return [self.caption(int(c), int(k)) for c, k in zip(cells, t)]

    def parse(self, text: str) -> int | None:
        """The cell a caption names (any template), None when the words name no single cell."""
        low = " " + " ".join(re.sub(r"[,;.]", " ", text.lower()).split()) + " "
        patterns = (("from the {} ",), (" {} disc ",), (" the {} ", " disc {} "))
        found = []
        for words, forms in zip(self.words, patterns):
            hits = [i for i, w in enumerate(words) if any(f.format(w) in low for f in forms)]
            if len(hits) != 1:
                return None
            found.append(hits[0])
        return int(self.cell_of_bins(np.array([found]))[0])


class CaptionIdeal:
    """Exact ideal for synthetic captions: ``log r(c, y) = log n_cells`` in the caption's cell, -inf outside.

    Query and database metadata are cell indices (`CaptionScheme.cells`); `search.evaluation.gap`
    takes this like any positive generator's log r."""

    name = "caption"
    exact = True

    def __init__(self, scheme: CaptionScheme | None = None):
        self.scheme = scheme or CaptionScheme()
        self.description = (
            f"caption: latent angles binned {list(self.scheme.bins)} and written as words; exact "
            f"log r = log {self.scheme.n_cells} in the caption's cell, -inf elsewhere"
        )

    def options(self) -> dict:
        return {"bins": list(self.scheme.bins)}

    def log_ratio(self, query_meta: np.ndarray, db_meta: np.ndarray) -> np.ndarray:
        q = np.asarray(query_meta, dtype=np.int64).reshape(-1)
        d = np.asarray(db_meta, dtype=np.int64).reshape(-1)
        return np.where(q[:, None] == d[None, :], np.log(self.scheme.n_cells), -np.inf)


def _one_hot_bins(scheme: CaptionScheme, bins: np.ndarray) -> np.ndarray:
    b = np.asarray(bins, dtype=np.int64).reshape(-1, M)
    offsets = np.concatenate([[0], np.cumsum(scheme.bins)[:-1]])
    z = np.zeros((b.shape[0], int(sum(scheme.bins))), dtype=np.float64)
    rows = np.arange(b.shape[0])
    for i in range(M):
        z[rows, offsets[i] + b[:, i]] = 1.0
    return z / np.sqrt(M)


def oracle_text_embedding(scheme: CaptionScheme, cells: np.ndarray) -> np.ndarray:
    """(Q,) caption cells -> (Q, sum(bins)) unit rows: one-hot per angle bin over sqrt(3)."""
    return _one_hot_bins(scheme, scheme.bins_of_cell(cells))


def oracle_image_embedding(scheme: CaptionScheme, latents: np.ndarray) -> np.ndarray:
    """(N, 3) latents -> (N, sum(bins)) unit rows, the same one-hot code: s = (matching bins) / 3."""
    return _one_hot_bins(scheme, scheme.bin_indices(latents))


def _sidecar_caption(path: Path) -> str | None:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        line = line.strip()
        if line and not _TRANSLATION.match(line):
            return line
    return None


def read_captions(root: str | Path, relative_paths: list[str]) -> list[str | None]:
    """The caption of each image (its path relative to `root`), None where it has none.

    `root/captions.jsonl` ({"file", "text"} per line) wins over a sidecar `NAME.txt`."""
    root = Path(root)
    table: dict[str, str] = {}
    jsonl = root / CAPTIONS_FILE
    if jsonl.is_file():
        for n, line in enumerate(jsonl.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                file, text = rec["file"], rec["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f'{jsonl} line {n}: expected {{"file": ..., "text": ...}} ({err})') from err
            if not isinstance(file, str) or not isinstance(text, str):
                raise ValueError(f"{jsonl} line {n}: file and text must be strings")
            table[Path(file).as_posix()] = text.strip()
    out: list[str | None] = []
    for rel in relative_paths:
        rel = Path(rel).as_posix()
        text = table.get(rel)
        if text is None:
            text = _sidecar_caption((root / rel).with_suffix(".txt"))
        out.append(text or None)
    return out
