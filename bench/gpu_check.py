"""GPU against CPU, side by side, for the steps bench/gpu_check.sh cannot time from the shell: embedding with
a trained checkpoint, building and searching every index kind, and exact search.

Embedding: `training.encoder.embed` of synthetic images on cuda and on the CPU. Index kinds:
`faiss_index.build` (on the GPU when FAISS is a GPU build and sees GPUs, `use_gpu`; HNSW always on the CPU)
against the same kind created, trained and filled on the CPU, both searched for recall@10 against exact.
Exact search: FAISS on the GPU (GpuIndexFlatIP) when it has GPUs, else torch on cuda (q @ x^T, top-k), each
checked against FAISS's CPU brute force (the same top-k rows). Without a CUDA GPU it says so and exits 0.

    # writes bench/results/gpu_check.json
    .venv/bin/python bench/gpu_check.py --checkpoint runs/x/checkpoint.safetensors
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import row, write_results


def timed(fn, repeats: int = 2):
    """(result, best seconds of `repeats` runs); a first untimed call warms CUDA kernels and caches."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--n", type=int, default=200_000, help="vectors for the index kinds")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--name", default="gpu_check")
    args = p.parse_args(argv)

    import faiss
    import torch
    from index_kinds import clustered

    from index import faiss_index
    from training.checkpoint import load_checkpoint
    from training.encoder import embed

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU on this machine "
            "(torch.cuda.is_available() is False); nothing to check here"
        )
        return 0
    rows = []
    gpus = faiss_index.gpu_count()
    encoder, _ = load_checkpoint(args.checkpoint, device="cpu")
    size = encoder.image_size
    images = torch.rand(args.images, 3, size, size, generator=torch.Generator().manual_seed(0))
    on = {}
    for dev in ("cuda", "cpu"):
        on[dev], on[dev + "_s"] = timed(
            lambda: embed(encoder, images, batch_size=256, device=dev, progress=False)
        )
    agree = float(np.abs(on["cuda"] - on["cpu"]).max())
    rows.append(
        row(
            f"embed {args.images} images ({size} px), images/s on cuda (vs CPU); max |diff| {agree:.1e}",
            args.images / on["cuda_s"],
            "images/s",
            args.images / on["cpu_s"],
        )
    )

    x = clustered(args.n, args.dim, seed=0)
    q = clustered(args.queries, args.dim, seed=1)
    exact_cpu, cpu_s = timed(lambda: faiss_index.exact_neighbours(x, q, 10), repeats=1)
    if gpus:

        def exact_gpu():
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, faiss.IndexFlatIP(args.dim))
            index.add(x)
            return index.search(q, 10)[1]

        how = "FAISS GpuIndexFlatIP"
    else:
        xt = torch.from_numpy(x).cuda()

        def exact_gpu():
            qt = torch.from_numpy(q).cuda()
            return torch.topk(qt @ xt.T, 10, dim=1).indices.cpu().numpy()

        how = "torch on cuda (faiss-cpu has no GPU index)"
    exact_gpu_rows, gpu_s = timed(exact_gpu)
    same = faiss_index.recall_at_k(exact_gpu_rows, exact_cpu, 10)
    rows.append(
        row(
            f"exact top-10, {args.queries} queries x {args.n}: queries/s by {how} (vs FAISS CPU); "
            f"agreement {same:.4f}",
            args.queries / gpu_s,
            "qps",
            args.queries / cpu_s,
        )
    )

    for kind in faiss_index.KINDS:
        t0 = time.perf_counter()
        index, params = faiss_index.build(kind, x)  # GPU when faiss_index.use_gpu(kind)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cpu, _ = faiss_index.create_index(kind, args.dim, args.n, **params)
        if not cpu.is_trained:
            cpu.train(
                x[
                    np.sort(
                        np.random.default_rng(0).choice(
                            args.n, min(args.n, 256 * params.get("nlist", 1)), replace=False
                        )
                    )
                ]
            )
        cpu.add(x)
        cpu_build_s = time.perf_counter() - t0
        where = "GPU" if faiss_index.use_gpu(kind) else "CPU (no FAISS GPU for it here)"
        recall = faiss_index.recall_at_k(faiss_index.search(index, q, 10)[1], exact_cpu, 10)
        rows.append(
            row(
                f"{kind}: build seconds by faiss_index.build on the {where} (vs CPU); recall@10 {recall:.3f}",
                build_s,
                "s",
                cpu_build_s,
            )
        )
    write_results(
        args.name,
        rows,
        command="bash bench/gpu_check.sh",
        machine_note=f"torch sees {torch.cuda.device_count()} GPU(s), FAISS {gpus}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
