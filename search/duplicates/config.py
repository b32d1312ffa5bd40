"""Every constant of `softsearch dedup` in one validated place (DedupConfig): the method itself has none."""

from __future__ import annotations

from dataclasses import dataclass, fields

FORMAT = "softsearch-duplicates-4"  # the JSON a scan writes (older scans are not read)
VERIFIERS = ("pixels", "encoder", "both")  # what decides a candidate pair (see DedupConfig.verifier)


@dataclass(frozen=True)
class DedupConfig:
    """What the duplicate finder does; the defaults are the method, a collection needs no others.

    thumb: side of the greyscale thumbnail each image is reduced to (aligned at half and a quarter of it,
        correlated at half after warping at full).
    dct: side of the low-frequency DCT block whose coefficients (DC dropped) are the search descriptor's
        grey half.
    colour_weight: weight of the descriptor's colour half (the 8 x 8 chroma layout) against its grey half.
    k_descriptor / k_embedding: candidate neighbours per item by descriptor and by the index's embeddings.
    calibration_items: items given a synthetic edited copy (the positives the classifier learns from).
    copy_pairs: share of those positives that are two independent edits of one picture instead of a
        picture and its edit (two copies of one original are a duplicate pair too, and look less alike).
    iterations: Gauss-Newton steps of the alignment at the coarse and at the fine level.
    zooms: zooms into the other picture the alignment's start tries, each with its shift by phase
        correlation: the scales from a copy onto its original that a crop of <= 20 % of the area, its
        aspect change and a 5-degree rotation's inner crop make.
    cell: side (pixels of the half-size thumbnail) of the cells the robust correlation drops the worst of:
        an overlay is one compact region, a look-alike's differences are spread over many cells.
    max_share: the highest share of candidate pairs the fit may call duplicates (a bound it reports when hit).
    share_delta: confidence (1 - share_delta) of the bound that picks the cut of the share estimate.
    segments: pieces of each feature's monotone function in the fit, at quantiles of the pooled pairs.
    threshold: the pair probability a pair must reach, unless --threshold or --precision says otherwise.
    l2: ridge penalty of the logistic regression on standardised features.
    """

    thumb: int = 64
    dct: int = 12
    colour_weight: float = 1.0
    k_descriptor: int = 6
    k_embedding: int = 6
    calibration_items: int = 400
    copy_pairs: float = 1 / 3
    iterations: tuple[int, int] = (16, 8)
    zooms: tuple[float, ...] = (1.0, 0.94, 0.88, 0.83, 0.78)
    cell: int = 4
    max_share: float = 0.5
    share_delta: float = 0.1
    segments: int = 8
    threshold: float = 0.5
    l2: float = 1e-4
    flips: bool = False
    seed: int = 0
    # --- the trained copy detector (copy_encoder.py), used by verifier "encoder" (alone) or "both" (a pair
    # must pass the alignment and the encoder); "pixels" is the alignment alone. copy_source: side of the
    # colour thumbnail it trains on (views shrunk to copy_side, a ViT of copy_patch patches, copy_width wide,
    # copy_layers deep, copy_dim out); copy_steps x copy_batch items of InfoNCE at copy_temperature plus
    # copy_koleo x KoLeo, AdamW at copy_lr; copy_k candidates per item in its softmax with a "none" option;
    # copy_readout: "softmax" (over the candidates) or "pair" (over the pair alone).
    verifier: str = "pixels"
    copy_source: int = 32
    copy_side: int = 32
    copy_patch: int = 8
    copy_width: int = 64
    copy_layers: int = 2
    copy_dim: int = 64
    copy_steps: int = 150
    copy_batch: int = 256
    copy_lr: float = 2e-3
    copy_temperature: float = 0.05
    copy_koleo: float = 0.1
    copy_k: int = 8
    copy_readout: str = "softmax"

    def __post_init__(self):
        if self.thumb < 16 or self.thumb % 4:
            raise ValueError(f"thumb must be a multiple of 4 and >= 16, got {self.thumb}")
        if not 2 <= self.dct <= self.thumb:
            raise ValueError(f"dct must be in [2, thumb], got {self.dct}")
        if not 0.0 <= self.colour_weight <= 10.0:
            raise ValueError(f"colour_weight must be in [0, 10], got {self.colour_weight}")
        if self.k_descriptor < 1 or self.k_embedding < 0:
            raise ValueError("k_descriptor must be >= 1 and k_embedding >= 0")
        if self.calibration_items < 20:
            raise ValueError(f"calibration_items must be >= 20, got {self.calibration_items}")
        if not 0.0 <= self.copy_pairs <= 1.0:
            raise ValueError(f"copy_pairs must be in [0, 1], got {self.copy_pairs}")
        if len(self.iterations) != 2 or min(self.iterations) < 1:
            raise ValueError(f"iterations must be two positive counts, got {self.iterations}")
        if not self.zooms or not all(0.5 <= z <= 1.0 for z in self.zooms):
            raise ValueError(f"zooms must be one or more scales in [0.5, 1], got {self.zooms}")
        if self.cell < 1 or (self.thumb // 2) % self.cell:
            raise ValueError(f"cell must divide half the thumbnail ({self.thumb // 2}), got {self.cell}")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {self.max_share}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.l2 < 0 or not 0.0 < self.share_delta < 1.0 or self.segments < 1:
            raise ValueError("l2 must be >= 0, share_delta in (0, 1) and segments >= 1")

        if self.verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {', '.join(VERIFIERS)}, got {self.verifier!r}")
        if self.copy_readout not in ("softmax", "pair"):
            raise ValueError(f"copy_readout must be softmax or pair, got {self.copy_readout!r}")
        if self.copy_source % self.copy_side or self.copy_side % self.copy_patch or self.copy_width % 4:
            raise ValueError("copy_side must divide copy_source, copy_patch copy_side, and 4 copy_width")
        if min(self.copy_steps, self.copy_batch - 1, self.copy_dim, self.copy_layers, self.copy_k) < 1:
            raise ValueError("copy_steps, copy_dim, copy_layers, copy_k must be >= 1 and copy_batch >= 2")
        if not (self.copy_lr > 0 and self.copy_temperature > 0 and self.copy_koleo >= 0):
            raise ValueError("copy_lr and copy_temperature must be > 0 and copy_koleo >= 0")

    def to_json(self) -> dict:
        return {
            f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)
        }

    @classmethod
    def from_json(cls, data: dict) -> "DedupConfig":
        known = {f.name for f in fields(cls)}
        kw = {k: (tuple(v) if k in ("iterations", "zooms") else v) for k, v in data.items() if k in known}
        return cls(**kw)
