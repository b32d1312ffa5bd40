"""The duplicates page: calibration plots (reliability, copy vs look-alike scores) and the groups with
thumbnails, one self-contained HTML file (images inlined as base64)."""
from __future__ import annotations

import base64
import html
import io

import numpy as np

MAX_GROUPS_SHOWN = 300
THUMB = 96


def _png_data(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _thumb(snapshot, item_id: str) -> str:
    try:
        im = snapshot.item_image(item_id).convert("RGB")
    except (KeyError, FileNotFoundError, ValueError, OSError):
        return ""
    im.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return _png_data(buf.getvalue())


def threshold_label(threshold: float) -> str:
    """How the page names the groups' probability threshold, in its header, its figure and the figure's alt text."""
    return f"groups kept: p \u2265 {threshold:.3g}"


def calibration_figure(calibration: dict, threshold: float) -> bytes:
    """Reliability diagram of the held-out top-1 probability, and the top-1 p of edited copies against
    items that have no copy (their nearest neighbours are same-class look-alikes), with a line at the
    `threshold` the groups were kept at (the scan's P, not the calibration queries' own precision threshold)."""
    from search.evaluation.figures import png_bytes

    return png_bytes(_calibration_axes(calibration, threshold))


def _calibration_axes(calibration: dict, threshold: float):
    from search.evaluation.figures import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    table = calibration.get("reliability") or []
    left.plot([0, 1], [0, 1], color="#999", lw=1, ls="--", label="perfect calibration")
    if table:
        left.plot([b["predicted"] for b in table], [b["observed"] for b in table], "o-", color="#c63",
                  label=f"held out (ECE {calibration['ece']:.3f})")
    left.set_xlabel("predicted p(original | copy)")
    left.set_ylabel("observed frequency")
    left.legend(loc="upper left", fontsize=8)
    bins = np.linspace(0, 1, 26)
    right.hist(calibration.get("positives") or [], bins=bins, alpha=0.7, color="#4a8", label="edited copies")
    negatives = calibration.get("negatives") or []
    # the look-alikes are over-sampled (job.hard_negative_sample); their weights give the collection's shares
    right.hist(negatives, bins=bins, weights=calibration.get("negative_weights") or None, alpha=0.7, color="#36c",
               label="no copy (look-alikes, weighted)")
    right.axvline(threshold, color="#b00", lw=1, label=threshold_label(threshold))
    right.set_xlabel("top-1 probability")
    right.set_yscale("log")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def render_page(result: dict, snapshot) -> str:
    """The HTML page of one dedup result."""
    from search.duplicates.calibration import DuplicateCalibration

    cal = result["calibration"]
    threshold = float(result["threshold"])   # the one threshold the page states: header, figure line, alt text
    calib = DuplicateCalibration.from_json(cal)
    weights = calib.geometry_weights     # a scan written before a penalty existed reads its weight as 0
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>softsearch duplicates</title><style>"
        "body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}"
        ".group{border:1px solid #ddd;border-radius:6px;padding:.5rem;margin:.5rem 0;display:flex;gap:.5rem;"
        "flex-wrap:wrap;align-items:flex-start}.item{font:11px monospace;width:110px;overflow-wrap:anywhere}"
        ".item img{width:96px;height:96px;object-fit:contain;background:#f4f4f4;display:block}"
        ".meta{width:100%;font-size:.85rem;color:#555}</style></head><body>",
        f"<h1>Duplicates in index version {esc(result['version'])}</h1>",
        f"<p>{len(result['groups'])} groups ({sum(len(g['ids']) for g in result['groups'])} of {result['count']} "
        f"items) at probability &ge; {threshold:.3g}. Duplicate temperature {result['temperature']:.4g}, "
        f"no-original score {result['bias']:.4g}, fitted on {cal['fitted_on']} queries made from this collection "
        + ("(edited copies of its items searched with their original, and items searched without themselves); "
           "verified stage (each item's nearest items re-scored pixel for pixel, a match's stretch and crop costing "
           f"{weights[0]:.3g} per log-aspect and {weights[1]:.3g} per squared log-area, a local window whose "
           f"structure differs {weights[2]:.3g} per log-deficit)" if cal.get("stage") == "verified"
           else "(edited copies of its items, and items with no copy); encoder stage")
        + "; expected calibration error on held-out queries (two-fold cross-fitting) "
        f"{cal['ece']:.3f} over {cal['held_out']} queries. A group's confidence is the smallest, over its members, "
        "of the probability that the member's original is among the others.</p>",
        f"<img alt='calibration; red line: {esc(threshold_label(threshold))}' "
        f"src='{_png_data(calibration_figure(cal, threshold))}'>",
    ]
    if result.get("collection_share") is not None:
        share, design = result["collection_share"], calib.design_share
        parts.append(
            f"<p>Items with a duplicate: about {share:.1%} of this collection (estimated from the scan, no labels) "
            f"against {design:.0%} of the calibration queries. "
            + ("The probabilities above assume this collection's share (--prior collection)."
               if result.get("prior") == "collection" else
               "The probabilities above assume the calibration's share"
               + ("; with fewer duplicates than that, a stated p overstates the chance of a duplicate here "
                  "(--prior collection re-weighs it)." if share < design else "."))
            + "</p>")
    if not calib.reachable:
        parts.append(f"<p><b>Note:</b> {esc(calib.limit_note())}.</p>")
    score = "verification score" if cal.get("stage") == "verified" else "cosine"
    for g in result["groups"][:MAX_GROUPS_SHOWN]:
        items = "".join(f"<div class='item'><img alt='{esc(i)}' src='{_thumb(snapshot, i)}'>{esc(i)}</div>"
                        for i in g["ids"])
        sims = [p["similarity"] for p in g["pairs"]]
        parts.append(f"<div class='group'><div class='meta'>confidence {g['confidence']:.4f} · {score} "
                     f"{min(sims):.4f}&ndash;{max(sims):.4f}</div>{items}</div>")
    if len(result["groups"]) > MAX_GROUPS_SHOWN:
        parts.append(f"<p>{len(result['groups']) - MAX_GROUPS_SHOWN} more groups in the JSON file.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
