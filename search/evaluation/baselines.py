"""Plain searches a user could run instead of the trained encoder, and the paired comparison with them.

The baseline every image collection has is raw pixels: each image as a 32x32 grey vector, centred on
the database mean and compared by cosine (exact search). A trained encoder that does not beat it has
bought nothing, and the report's first line says so, with a paired bootstrap interval over queries:
the per-query difference d_q = prec@k(trained, q) - prec@k(baseline, q) is resampled, so the interval
reflects the query-to-query variation both searches share.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from search.evaluation.metrics import bootstrap_ci, knn_search

RAW_PIXEL_SIDE = 32
RAW_PIXELS = f"raw pixels ({RAW_PIXEL_SIDE}x{RAW_PIXEL_SIDE} grey, centred cosine)"


def raw_pixel_features(images: torch.Tensor, side: int = RAW_PIXEL_SIDE) -> np.ndarray:
    """Preprocessed images (B, C, S, S) -> grey side x side pixels, flattened (B, side^2) float32.

    Grey is the channel mean; the resize is area averaging (box filter), as a thumbnail would be."""
    x = images.detach().float()
    grey = x.mean(dim=1, keepdim=True)  # (B, 1, S, S)
    if grey.shape[-1] != side or grey.shape[-2] != side:
        grey = F.interpolate(grey, size=(side, side), mode="area")
    return grey.flatten(1).cpu().numpy().astype(np.float32)


def centred_unit(db: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Subtract the database mean from both sides and L2-normalise rows (centred cosine)."""
    mu = db.mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32)

    def unit(a: np.ndarray) -> np.ndarray:
        a = a - mu
        return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)

    return unit(db), unit(queries)


def per_query_precision(
    zq: np.ndarray,
    zdb: np.ndarray,
    query_labels,
    db_labels,
    k: int,
    exclude: np.ndarray | None = None,
    device=None,
) -> np.ndarray:
    """Per-query label precision@k of an exact inner-product search: (Q,) float64."""
    n_avail = zdb.shape[0] - (1 if exclude is not None else 0)
    kk = min(k, n_avail)
    _, rows = knn_search(zq, zdb, kk, exclude=exclude, device=device)
    return (np.asarray(db_labels)[rows] == np.asarray(query_labels)[:, None]).mean(axis=1)


def paired_difference(this: np.ndarray, other: np.ndarray, n_boot: int = 1000, seed: int = 0) -> dict:
    """Mean of this - other over queries with its paired percentile-bootstrap 95 % interval."""
    mean, low, high = bootstrap_ci(
        np.asarray(this, np.float64) - np.asarray(other, np.float64), n_boot, 0.05, seed
    )
    return {"mean": mean, "low": low, "high": high}


def verdict(metric: str, baseline: str, diff: dict, recipe: str | None = None) -> str:
    """One plain sentence: improved (interval above 0), worse (below 0), or no clear difference;
    with `recipe`, which training recipe it judges."""
    span = f"{diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]"
    if diff["low"] > 0:
        out = f"training improved {metric} over {baseline} by {span}"
    elif diff["high"] < 0:
        out = f"training did not improve {metric} over {baseline}: it is worse by {span}"
    else:
        out = f"training did not clearly improve {metric} over {baseline}: {span} (the interval includes 0)"
    return f"{out}; recipe: {recipe}" if recipe else out


def recipe_description(info: dict) -> str | None:
    """The training recipe of a checkpoint in a few words (its positives, tower input size, steps), from the
    checkpoint's metadata; None when it records no generator (e.g. an imported model)."""
    gen = (info.get("lineage") or {}).get("generator") or {}
    if not gen.get("name"):
        return None
    opts = gen.get("options") or {}
    name = gen["name"]
    if name == "label":
        what = "class folders as positives (label)"
    elif name == "neighbour":
        where = opts.get("space", "pixels")
        every = opts.get("refresh_every", 0)
        space = {"pixels": "grey-pixel", "encoder": "encoder", "both": "pixel+encoder"}.get(where, where)
        what = (
            f"{space} neighbours as positives (neighbour, k {opts.get('k')}"
            + (f", refreshed every {every} steps" if where != "pixels" and every else "")
            + (", step-0 tower" if where != "pixels" and not every else "")
            + ")"
        )
    elif name == "instance":
        what = "two augmentations of one image as positives (instance)"
    else:
        what = f"{name} positives"
    tc = info.get("train_config") or {}
    enc = tc.get("encoder") or {}
    size, w, c = enc.get("image_size"), enc.get("pixel_weight") or 0, enc.get("colour_weight") or 0
    e = enc.get("gradient_weight") or 0
    side, bins = enc.get("pixel_side", 32), enc.get("colour_bins", 4)
    grid, dirs = enc.get("gradient_grid", 4), enc.get("gradient_bins", 16)
    parts = [
        f"{side}x{side} grey pixels at weight {w:g}" if w else "",
        f"a colour histogram of {bins}x{bins}x{bins} bins at weight {c:g}" if c else "",
        f"gradient-orientation histograms ({dirs} directions, {grid}x{grid} cells) at weight {e:g}"
        if e
        else "",
    ]
    parts = [p for p in parts if p]
    carries = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)
    anchor = f"pixel anchor {w:g}" + (f" + colour {c:g}" if c else "") + (f" + gradient {e:g}" if e else "")
    extra = [
        f"{size} px" if size else None,
        f"{tc['steps']} steps" if tc.get("steps") else None,
        f"{anchor} (the embedding carries {carries} beside the tower's {1 - w - c - e:g})" if parts else None,
        "the loss saw the anchored embedding" if parts and tc.get("loss_sees_anchor") else None,
    ]
    return ", ".join([what] + [e for e in extra if e])


def baseline_comparison(
    rows: dict[str, tuple[np.ndarray, np.ndarray]],
    trained: tuple[np.ndarray, np.ndarray],
    ks=(10, 1),
    n_boot: int = 1000,
    seed: int = 0,
    recipe: str | None = None,
) -> dict:
    """Report part: each baseline's precision@k and the trained encoder's paired difference to it.

    ``rows`` maps a baseline name to its (per-query prec@ks[0], per-query prec@ks[1]) arrays; ``trained``
    holds the trained encoder's arrays on the same queries. The verdict compares with raw pixels and
    names the training `recipe` when given."""
    out: dict = {
        "ks": list(ks),
        "n_queries": int(trained[0].size),
        "n_boot": n_boot,
        "trained": {f"precision@{k}": float(np.mean(v)) for k, v in zip(ks, trained)},
        "rows": [],
    }
    for name, per_q in rows.items():
        row = {"name": name}
        for k, base, mine in zip(ks, per_q, trained):
            row[f"precision@{k}"] = float(np.mean(base))
            row[f"difference@{k}"] = paired_difference(mine, base, n_boot, seed)
        out["rows"].append(row)
    first = next((r for r in out["rows"] if r["name"] == RAW_PIXELS), out["rows"][0] if out["rows"] else None)
    if first is not None:
        out["verdict"] = verdict(f"precision@{ks[0]}", first["name"], first[f"difference@{ks[0]}"], recipe)
    if recipe:
        out["recipe"] = recipe
    return out
