#!/usr/bin/env bash
# bench/gpu_checks.py check: the cpu profile on CUDA end to end through the three engines (< 5 min).
# --dry-run checks it on the CPU in seconds (imports, configs, meta-device shapes); without CUDA and without
# --dry-run it prints a note and exits 0. Usage: bash bench/gpu_check.sh [--dry-run] [options of bench/gpu_checks.py]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec "$PY" bench/gpu_checks.py check "$@"
