#!/usr/bin/env bash
# bench/gpu_checks.py scale: real-size random-weight Wan2.1-1.3B (dense/sparse per step and end to end, then
# bench/video_speed.py's lever table at 480p: sparse, step caches, distilled steps) / Orpheus 3B / MoonViT + GLM-4-9B
# on one GPU (< 10 min, estimated in bench/gpu_checks.py), one table.
# Then the quantization part (issue 26; needs the gpu profile's real weights: GLM-4-9B-0414, the trained projector,
# Orpheus-3B, under its model_dir or in the Hugging Face cache; without them it prints what is missing and stops):
# FP8 vs BF16 on one GPU. GLM-4-9B: `chimera quantize --scheme fp8 --select greedy --fraction 0.75` with the KL
# search at real size (`--compare 0.25,0.5,0.75`: every method's KL table), then bench/quantization.py serves bf16,
# FP8 on every unit and the greedy set (decode tok/s at 1 and 8 requests, TTFT, process and GPU memory, paired graft
# accuracy; GPU memory there is vLLM's fixed share). Orpheus-3B: the same quantize (KL over its audio ids), then bench/tts_concurrency.py at 1 and 8 streams
# on the bf16 and the FP8 profile (audio s per wall s and time to first audio), and the memory plans
# (`chimera profile show`). Not timed on a GPU yet: the greedy search's cost grows with the units (GLM-4-9B: 40
# layers, 160 units; Orpheus: 28, 112) and may not fit one 10-minute call; --quant-only runs this part alone,
# --no-quant skips it. Checkpoints go to $QUANT_DIR (default /tmp/chimera-gpu-quant).
# --dry-run checks it on the CPU in seconds (imports, configs, meta-device shapes; the quantization commands are
# parsed by the programs' own parsers, bench/gpu_quant.py validate, instead of run); without CUDA and without
# --dry-run it prints a note and exits 0.
# Usage: bash bench/gpu_scale.sh [--dry-run] [--quant-only|--no-quant] [options of bench/gpu_checks.py]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
CHIMERA=.venv/bin/chimera
DRY=0; SCALE=1; QUANT=1; ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1; ARGS+=("$a") ;;
    --quant-only) SCALE=0 ;;
    --no-quant) QUANT=0 ;;
    *) ARGS+=("$a") ;;
  esac
done
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
if [ "$SCALE" = 1 ]; then
  "$PY" bench/gpu_checks.py scale "${ARGS[@]+"${ARGS[@]}"}"
fi
[ "$QUANT" = 1 ] || exit 0
if [ "$DRY" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_scale.sh: no CUDA here: the FP8 quantization rows need a GPU (--dry-run checks the commands)"; exit 0
fi
QD=${QUANT_DIR:-/tmp/chimera-gpu-quant}
[ "$DRY" = 1 ] && QD=$(mktemp -d)

# run_q CMD...: one command of the quantization part; with --dry-run parsed by its program's parser, not run.
N_Q=0
run_q() {
  echo "+ $*"
  N_Q=$((N_Q + 1))
  if [ "$DRY" = 1 ]; then "$PY" bench/gpu_quant.py validate -- "$@"; else "$@"; fi
}

# one-GPU copies of the gpu profile: bf16, and with the FP8 checkpoints named (made below)
"$PY" bench/gpu_quant.py profile --out "$QD/gpu1-bf16.yaml" >/dev/null
"$PY" bench/gpu_quant.py profile --out "$QD/gpu1-fp8.yaml" --vlm-quantized "$QD/vlm/llm-fp8-greedy-0.75" \
  --tts-quantized "$QD/tts/lm-fp8-greedy-0.75" >/dev/null
if [ "$DRY" = 0 ] && ! "$PY" bench/gpu_quant.py missing --profile "$QD/gpu1-bf16.yaml"; then
  echo "gpu_scale.sh: the quantization rows need the gpu profile's real weights (above); skipped"; exit 0
fi

# GLM-4-9B: the KL search at real size (every method at 3 fractions), the served FP8 vs BF16 rows
run_q "$CHIMERA" quantize --family vlm --profile "$QD/gpu1-bf16.yaml" --scheme fp8 --select greedy --fraction 0.75 \
  --shortlist 4 --search-prompts 4 --compare 0.25,0.5,0.75 --out "$QD/vlm/llm-fp8-greedy-0.75"
run_q "$CHIMERA" quantize report "$QD/vlm/llm-fp8-greedy-0.75" --no-detail
run_q "$PY" bench/quantization.py --profile "$QD/gpu1-bf16.yaml" --scheme fp8 --select all,greedy --fraction 0.75 \
  --shortlist 4 --search-prompts 4 --checkpoint-dir "$QD/vlm" --questions 200
# Orpheus-3B: the KL search over audio ids, FP8 vs BF16 streams, memory plans
run_q "$CHIMERA" quantize --family tts --profile "$QD/gpu1-bf16.yaml" --scheme fp8 --select greedy --fraction 0.75 \
  --shortlist 4 --search-prompts 4 --compare 0.25,0.5,0.75 --out "$QD/tts/lm-fp8-greedy-0.75"
run_q "$PY" bench/tts_concurrency.py --profile "$QD/gpu1-bf16.yaml" --engines transformers,vllm --streams 1,8 --rounds 1
run_q "$PY" bench/tts_concurrency.py --profile "$QD/gpu1-fp8.yaml" --engines transformers,vllm --streams 1,8 --rounds 1
# memory plans on two of these GPUs (the VLM and the speech LM each take a vLLM share of its own GPU); the LM weights
# at their bits are in the notes (nvidia-smi shows vLLM's fixed share, not the weights: FP8 frees KV cache inside it)
run_q "$CHIMERA" profile show --profile "$QD/gpu1-bf16.yaml" --gpus 2 --gpu-memory 141GB
run_q "$CHIMERA" profile show --profile "$QD/gpu1-fp8.yaml" --gpus 2 --gpu-memory 141GB
echo "gpu_scale.sh: quantization part: $N_Q commands $([ "$DRY" = 1 ] && echo validated || echo run)"

# EAGLE-3 draft head for GLM-4-9B (issue 28; docs/operations/speculator.md): self-distilled on the GPU from the
# scene and chat traffic (its decoder layer a Llama layer of GLM-4-9B's widths, core.spec.worker.head_layer_config;
# layers 2, 20, 37), the acceptance table, then vLLM with none / n-gram / the head at 1 and 8 requests (tok/s,
# inter-token latency, acceptance from vLLM's counters, greedy answers identical). vLLM 0.32's Glm4ForCausalLM does
# not implement SupportsEagle3 (the aux hidden states EAGLE-3 reads); the eagle3 arm needs a vLLM that does.
N_Q=0
run_q "$CHIMERA" speculator train --profile "$QD/gpu1-bf16.yaml" --device cuda --train-kinds both --train-scenes 512 \
  --train-chat 507 --heldout-scenes 128 --answer-tokens 256 --steps 2000 --pack-tokens 8192 --draft-vocab 32768 \
  --threads 8 --out "$QD/vlm/speculator-eagle3"
run_q "$CHIMERA" speculator report "$QD/vlm/speculator-eagle3"
run_q "$PY" bench/speculator.py --profile "$QD/gpu1-bf16.yaml" --head "$QD/vlm/speculator-eagle3" \
  --methods none,ngram,eagle3 --concurrency 1,8 --prompts 24 --max-tokens 256
echo "gpu_scale.sh: speculator part: $N_Q commands $([ "$DRY" = 1 ] && echo validated || echo run)"
