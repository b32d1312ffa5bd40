"""The design experiments' queries (pixel only): edited copies of stamps searched with their original, and
copies searched without it (nor its pixel twins); candidates the k nearest by the verification's 32 px vector."""
import io

import numpy as np
from PIL import Image

from search.duplicates import verify
from search.duplicates.edits import edited_copy
from training.images import load_rgb


def jpeg_step(data: bytes) -> float:
    """log of the mean step of a JPEG file's luminance quantisation table (how coarse its compression is);
    0 for a lossless file."""
    with Image.open(io.BytesIO(data)) as im:
        tables = getattr(im, "quantization", None)
        return float(np.log(np.mean(tables[0]))) if im.format == "JPEG" and tables else 0.0


def design_queries(seed, rgbs, thumbs, twins, m=300, k=8):
    """Yield (kind "copy" | "none", source row, candidate rows (k,), the copy's Thumb, whether the copy was saved
    losslessly (PNG), log of its mean JPEG luminance quantisation step (0 for PNG)) for 2 m queries."""
    base = np.stack([t.base for t in thumbs])
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(rgbs))
    for kind, rows in (("copy", perm[:m]), ("none", perm[m:2 * m])):
        for src in rows:
            data, names = edited_copy(Image.fromarray(rgbs[src]), rng)
            th = verify.thumb(load_rgb(data))
            cos = base @ th.base
            if kind == "none":
                cos[list(twins[src])] = -np.inf
            yield kind, int(src), np.argsort(-cos)[:k], th, "as_png" in names, jpeg_step(data)
