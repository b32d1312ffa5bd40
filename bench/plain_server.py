"""The plainest search server a user would write instead of `softsearch serve` (bench/http_baseline.py's
baseline): FastAPI + faiss.IndexFlatIP over an index version's embeddings, the version's checkpoint,
and the project's decode and preprocessing (training/images.py, training/transforms.py). With
`--vectors` (bench/vs_vectordb.py's baseline) it serves POST /search/vector {"vector": [...], "k": 10}
over a version's embeddings alone: no checkpoint, no probabilities.

    python bench/plain_server.py VERSION_DIR CHECKPOINT PORT SQUARE(0|1) TORCH_THREADS
    python bench/plain_server.py --vectors VERSION_DIR PORT
"""

import json
import sys

import faiss
import numpy as np
import uvicorn
from fastapi import FastAPI, File, Form, UploadFile
from pydantic import BaseModel

if sys.argv[1] == "--vectors":
    version, port = sys.argv[2], int(sys.argv[3])
    emb = np.load(f"{version}/embeddings.npy")
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(emb)
    ids = json.load(open(f"{version}/ids.json"))
    app = FastAPI()

    class VectorQuery(BaseModel):
        vector: list[float]
        k: int = 10

    @app.post("/search/vector")
    async def search_vector(query: VectorQuery):
        x = np.asarray(query.vector, dtype=np.float32)[None]
        x /= np.linalg.norm(x)
        scores, rows = index.search(x, query.k)
        return {"ids": [ids[r] for r in rows[0]], "scores": scores[0].tolist()}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    sys.exit(0)

import torch  # noqa: E402

from training.checkpoint import load_checkpoint  # noqa: E402
from training.images import cache_resolution, load_query, load_square  # noqa: E402
from training.transforms import preprocess  # noqa: E402

version, checkpoint, port, square, threads = (
    sys.argv[1],
    sys.argv[2],
    int(sys.argv[3]),
    sys.argv[4] == "1",
    int(sys.argv[5]),
)
torch.set_num_threads(threads)
encoder, _ = load_checkpoint(checkpoint)
encoder.eval()
index = faiss.IndexFlatIP(encoder.embed_dim)
index.add(np.load(f"{version}/embeddings.npy"))
ids = json.load(open(f"{version}/ids.json"))
side = cache_resolution(encoder.image_size)
app = FastAPI()


@app.post("/search")
async def search(file: UploadFile = File(...), k: int = Form(10)):
    data = await file.read()
    pixels = load_square(data, side) if square else load_query(data, side)
    with torch.inference_mode():
        z = encoder(preprocess(pixels[None], encoder.image_size)).numpy()
    scores, rows = index.search(z, k)
    return {"ids": [ids[r] for r in rows[0]], "scores": scores[0].tolist()}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
