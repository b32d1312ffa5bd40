#!/usr/bin/env bash
# The GPU path, ready to prove (#30 item 4). On a machine with a CUDA GPU: trains a few steps, embeds,
# builds every index kind (FAISS on the GPU when it is a GPU build, else exact search by torch on the GPU),
# runs the streaming cross-entropy gap and the normaliser there, and prints each timing next to the CPU's.
# On a machine without one it says so and exits 0.
#
#   bash bench/gpu_check.sh            # PYTHON=... to pick the interpreter; OUT=dir for the run's files
#
# What runs where: training and embedding follow torch.cuda.is_available() (training's --set device=cuda);
# index/faiss_index.py builds on the GPU when faiss.get_num_gpus() > 0 (faiss-gpu), HNSW always on the CPU;
# search/evaluation/gap.py picks cuda when torch sees it; the normaliser (search/serving/normaliser.py) is numpy
# and runs on the machine's CPUs. Figures go to bench/results/gpu_check.json, gap_gpu.json, normaliser_gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

read -r TORCH_GPUS FAISS_GPUS <<<"$("$PYTHON" - <<'PY'
import torch
from index import faiss_index
print(torch.cuda.device_count() if torch.cuda.is_available() else 0, faiss_index.gpu_count())
PY
)"
if [ "$TORCH_GPUS" = "0" ]; then
    echo "gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False; FAISS sees $FAISS_GPUS GPUs); nothing to check here"
    exit 0
fi
echo "gpu_check: torch sees $TORCH_GPUS CUDA GPU(s), FAISS sees $FAISS_GPUS$([ "$FAISS_GPUS" = 0 ] && echo ' (faiss-cpu: GPU search falls back to torch)')"

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
STEPS="${STEPS:-30}"
for dev in cuda cpu; do
    start=$EPOCHREALTIME
    "$PYTHON" -m api.cli train --config configs/tiny.toml --set steps=$STEPS --set "device=\"$dev\"" \
        --set checkpoint_every=$STEPS --out "$OUT/train-$dev" >"$OUT/train-$dev.log" 2>&1
    awk -v a="$start" -v b="$EPOCHREALTIME" -v d="$dev" -v n="$STEPS" \
        'BEGIN { printf "train %d steps (configs/tiny.toml) on %s: %.1f s (process wall time)\n", n, d, b - a }'
done
"$PYTHON" bench/gpu_check.py --checkpoint "$OUT/train-cuda/checkpoint.safetensors"
"$PYTHON" bench/gap.py --name gap_gpu --repeats 2
"$PYTHON" bench/normaliser.py --sizes 1000000 --queries 200 --name normaliser_gpu
