"""Headless matplotlib for every page with plots (the evaluation report, the duplicates page): one place
that picks the Agg backend and turns a figure into PNG bytes (pages inline them as base64, so nothing is
written next to them). Neutral ground: search.evaluation and search.duplicates both import it, neither
imports the other."""

from __future__ import annotations

import io


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported lazily: eval without a report never loads it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int = 90) -> bytes:
    """The figure as PNG bytes; the figure is closed so a long eval does not accumulate them."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    return buf.getvalue()
