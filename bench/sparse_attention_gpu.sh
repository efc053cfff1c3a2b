#!/usr/bin/env bash
# Dense SDPA vs block-sparse flex_attention on a GPU, up to Wan2.1's 21x30x52 = 32,760 tokens (480x832, 81 frames).
# Same benchmark as on the CPU (bench/sparse_attention.py), bf16, Wan2.1-1.3B's 12 heads of 128.
# Needs a CUDA device; prints a note and exits 0 without one. Usage: bash bench/sparse_attention_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: skipping the GPU sparse-attention benchmark"; exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec "$PY" bench/sparse_attention.py --device cuda --dtype bfloat16 --heads 12 --gpu-sizes --repeats 10 "$@"
