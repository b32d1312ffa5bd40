"""The duplicates page: what the scan fitted (the probabilities of candidate pairs and of held-in synthetic
copies), its notes, and the groups with thumbnails, one self-contained HTML file (images inlined)."""

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


def probability_figure(result: dict) -> bytes:
    """Histogram of the candidate pairs' p (log counts) beside the synthetic copies' p, the threshold
    marked."""
    from search.figures import png_bytes, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    edges = np.linspace(0, 1, len(result["histogram"]) + 1)
    ax.bar(
        edges[:-1],
        result["histogram"],
        width=np.diff(edges),
        align="edge",
        alpha=0.7,
        color="#36c",
        label="candidate pairs of this collection",
    )
    if result.get("copy_probabilities"):
        counts, _ = np.histogram(result["copy_probabilities"], bins=edges)
        ax.bar(
            edges[:-1],
            counts,
            width=np.diff(edges),
            align="edge",
            alpha=0.6,
            color="#4a8",
            label="synthetic edited copies (fit)",
        )
    ax.axvline(result["threshold"], color="#b00", lw=1, label=f"threshold {result['threshold']:.3g}")
    ax.set_yscale("log")
    ax.set_xlabel("probability that the pair is one picture edited")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


def render_page(result: dict, snapshot) -> str:
    """The HTML page of one dedup result."""
    esc = html.escape
    model = result["model"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>softsearch duplicates</title><style>"
        "body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}"
        ".group{border:1px solid #ddd;border-radius:6px;padding:.5rem;margin:.5rem 0;display:flex;gap:.5rem;"
        "flex-wrap:wrap;align-items:flex-start}.item{font:11px monospace;width:110px;overflow-wrap:anywhere}"
        ".item img{width:96px;height:96px;object-fit:contain;background:#f4f4f4;display:block}"
        ".meta{width:100%;font-size:.85rem;color:#555}.note{background:#fff4d6;padding:.4rem}</style></head><body>",
        f"<h1>Duplicates in index version {esc(result['version'])}</h1>",
        f"<p>{len(result['groups'])} groups ({sum(len(g['ids']) for g in result['groups'])} of "
        f"{result['count']} items) at pair probability &ge; {result['threshold']:.3g} "
        f"({esc(result['threshold_rule'])}); the highest probability found is "
        f"{result['max_probability']:.3g}. "
        + (
            f"{result['pairs_scored']} candidate pairs scored (each item's "
            f"nearest by thumbnail DCT and by embedding), aligned and correlated; the classifier was fitted "
            f"on {model['positives']} edited copies of this collection's own images against those pairs, "
            f"no labels (positives against unlabelled pairs; share of candidate pairs that are duplicates "
            f"{model['share']:.3g}). Items with a duplicate: about {result['collection_share']:.1%} "
            f"(estimated); held-out synthetic copies found at the default threshold: "
            f"{model['copy_recall']:.0%}.</p>"
            if model is not None
            else f"{result['pairs_scored']} candidate pairs scored (each item's nearest by a copy "
            "detector trained on this collection, a softmax over them with a 'none' option fitted on "
            "held-apart edited copies, no labels). Items with a duplicate: about "
            f"{result['collection_share']:.1%} (estimated).</p>"
        ),
    ]
    if result.get("identical_pairs"):
        parts.append(
            f"<p>{result['identical_pairs']} items are pictures identical to another item (same decoded "
            "pixels or same thumbnails), joined to it at p 1 before any comparison.</p>"
        )
    parts += [f"<p class='note'><b>Note:</b> {esc(n)}</p>" for n in result.get("notes", [])]
    if result.get("baselines"):
        rows = "".join(
            f"<tr><td>{esc(b['name'])}</td><td>{esc(b['rule'])}</td><td>{b['pairs']}</td>"
            f"<td>{b['items']}</td><td>{b['pairs_in_scan_groups']}</td>"
            f"<td>{b['scan_pairs_kept_too']} of {b['scan_pairs']}</td></tr>"
            for b in result["baselines"]
        )
        parts.append(
            "<h2>The usual rules on the same items</h2><p>What each common rule would call a duplicate "
            "here (no labels, so no one is scored; bench/dedup.py measures them against planted copies): "
            "the pairs it keeps, the items they touch, how many of its pairs lie inside one of the groups "
            "below, and how many of the pairs this scan kept it keeps too.</p><table border='1' "
            "cellpadding='3' style='border-collapse:collapse'><tr><th>rule</th><th>cut-off</th><th>pairs"
            "</th><th>items</th><th>pairs inside a group here</th><th>this scan's pairs it keeps</th></tr>"
            + rows
            + "</table>"
        )
    parts.append(f"<img alt='probabilities' src='{_png_data(probability_figure(result))}'>")
    if result.get("skipped"):
        parts.append(
            "<p>Skipped (unreadable): " + ", ".join(esc(s["id"]) for s in result["skipped"][:50]) + "</p>"
        )
    for g in result["groups"][:MAX_GROUPS_SHOWN]:
        items = "".join(
            f"<div class='item'><img alt='{esc(i)}' src='{_thumb(snapshot, i)}'>{esc(i)}</div>"
            for i in g["ids"]
        )
        parts.append(
            f"<div class='group'><div class='meta'>confidence {g['confidence']:.4f} "
            f"({len(g['pairs'])} pairs)</div>{items}</div>"
        )
    if len(result["groups"]) > MAX_GROUPS_SHOWN:
        parts.append(f"<p>{len(result['groups']) - MAX_GROUPS_SHOWN} more groups in the JSON file.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
