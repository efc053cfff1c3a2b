#!/usr/bin/env bash
# bench/gpu_checks.py scale: real-size random-weight Wan2.1-1.3B (dense/sparse per step and end to end, then
# bench/video_speed.py's lever table at 480p: sparse, step caches, distilled steps) / Orpheus 3B / MoonViT + GLM-4-9B
# on one GPU (< 10 min, estimated in bench/gpu_checks.py), one table.
# --dry-run checks it on the CPU in seconds (imports, configs, meta-device shapes); without CUDA and without
# --dry-run it prints a note and exits 0. Usage: bash bench/gpu_scale.sh [--dry-run] [options of bench/gpu_checks.py]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec "$PY" bench/gpu_checks.py scale "$@"
