"""Memory accounting every family's planner uses: dtype sizes, :class:`Need`, parameter counts on the meta
device, KV-cache and activation math of a causal LM, from architecture configs (``config.json`` dicts).

Parameter counts come from building the real classes on the meta device (nothing allocated) and summing
``numel``; bytes = parameters x dtype bytes. The KV cache per token is ``2 (K and V) x layers x KV heads x head_dim
x dtype bytes``; with tensor parallelism each GPU holds ``ceil(KV heads / tp)`` heads (vLLM replicates KV heads
when there are fewer than GPUs). Activation figures are estimates of the peak of one forward pass (the formula is
in each :class:`Need`), not measurements. The family planners (``grafting.memory.vlm_needs``,
``audio.memory.tts_needs``, ``video.memory.video_needs``) build on these; ``services.config.memory_plan`` adds them up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

#: A config's dtype name (:data:`core.constants.DTYPE_PATTERN`) -> the torch dtype engines load weights in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: A config's dtype name -> bytes per element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM's profile run on the API server batches up to this many tokens (its max_num_batched_tokens default there).
VLLM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class Need:
    """One thing that takes GPU memory: ``what`` (e.g. ``llm weights``), ``bytes``, ``how`` (the formula used)."""

    what: str
    bytes: int
    how: str


def read_config(directory: str | Path, sub: str = "") -> dict:
    """``<directory>/<sub>/config.json`` as a dict. Raises FileNotFoundError."""
    return json.loads((Path(directory) / sub / "config.json").read_text())


def meta_params(build) -> int:
    """Number of parameters of the module ``build()`` returns, built on the meta device (no memory allocated)."""
    with torch.device("meta"):
        model = build()
    return sum(p.numel() for p in model.parameters())


@lru_cache(maxsize=32)
def _causal_lm_params(cfg_json: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(cfg_json)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    return meta_params(lambda: AutoModelForCausalLM.from_config(hf))


def causal_lm_params(cfg: dict) -> int:
    """Parameters of the causal LM that ``cfg`` (a ``config.json`` dict with ``model_type``) describes."""
    return _causal_lm_params(json.dumps(cfg, sort_keys=True))


def head_dim(cfg: dict) -> int:
    """Per-head width: ``head_dim`` if the config has it, else ``hidden_size / num_attention_heads``."""
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def kv_bytes_per_token(cfg: dict, dtype_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes of one token on one of ``tp`` GPUs: 2 x layers x ceil(kv_heads / tp) x head_dim x bytes."""
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * math.ceil(kv / tp) * head_dim(cfg) * dtype_bytes


def prefill_activation_bytes(cfg: dict, tokens: int, dtype_bytes: int, tp: int = 1, logits_rows: int = 1) -> int:
    """Estimated peak activations of one decoder layer over ``tokens`` tokens on one of ``tp`` GPUs, plus the fp32
    logits of ``logits_rows`` positions: tokens x (4 hidden + 2 intermediate / tp + (heads + 2 kv) head_dim / tp)
    x bytes + rows x vocab / tp x 4 (residual, norm, attention output, MLP gate/up, Q/K/V live together)."""
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    per_token = (4 * cfg["hidden_size"] + 2 * cfg["intermediate_size"] // tp
                 + (cfg["num_attention_heads"] + 2 * kv) * head_dim(cfg) // tp)
    return tokens * per_token * dtype_bytes + logits_rows * cfg["vocab_size"] // tp * 4
