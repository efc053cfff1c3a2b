"""GPU memory the grafted VLM needs, from its architecture configs (``config.json`` dicts), for the memory plan:
:func:`vlm_needs` (tower, projector, LLM, KV cache), on the shared accounting of :mod:`core.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.memory import DTYPE_BYTES, VLLM_BATCHED_TOKENS, Need, causal_lm_params, kv_bytes_per_token, meta_params, \
    prefill_activation_bytes

from .config import VLMConfig


def tower_params(vision_config: dict) -> int:
    """Parameters of the MoonViT ``vision_config`` describes (``Kimi_K25VisionModel`` on the meta device)."""
    from transformers import Kimi_K25VisionConfig, Kimi_K25VisionModel

    cfg = Kimi_K25VisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    return meta_params(lambda: Kimi_K25VisionModel(cfg))


def projector_params(vision_hidden: int, llm_hidden: int, merge_size: int = 4, mid_size: int | None = None) -> int:
    """Parameters of :class:`~grafting.projector.GraftProjector` of those sizes (meta device)."""
    from .projector import GraftProjector, GraftProjectorConfig

    pc = GraftProjectorConfig(vision_hidden_size=vision_hidden, merge_size=merge_size, mid_size=mid_size,
                              llm_hidden_size=llm_hidden)
    return meta_params(lambda: GraftProjector(pc))


@dataclass(frozen=True)
class VLMNeeds:
    """What the VLM needs. ``llm``: per GPU the LLM spans (weights / tp, activations; with vLLM these live inside
    vLLM's ``gpu_memory_utilization`` share). ``kv_per_sequence``: KV bytes of one full-length sequence on one of
    those GPUs; ``sequences``: sequences decoded together (``max_batch_size``); ``context``: their length in tokens.
    ``replica``: tower + projector + tower activations, on the replica's first GPU."""

    llm: list[Need]
    kv_per_sequence: int
    sequences: int
    context: int
    replica: list[Need]


def vlm_needs(cfg: VLMConfig, vision_config: dict, llm_config: dict, projector_config: dict | None,
              gpus: int) -> VLMNeeds:
    """Memory needs of the VLM engine ``cfg`` at its limits, spread over ``gpus`` GPUs (vLLM tensor parallel, or
    the transformers backend's even device map). ``projector_config``: the trained projector's ``config.json``
    (None: the default Kimi-style sizes for this tower and LLM)."""
    gpus = max(1, gpus)
    llm_dt = cfg.vllm.dtype if cfg.backend == "vllm" else cfg.dtype
    b = DTYPE_BYTES[llm_dt]
    n_llm = causal_lm_params(llm_config)
    context = cfg.max_prompt_tokens + cfg.max_new_tokens
    tp = cfg.vllm.tensor_parallel_size if cfg.backend == "vllm" else 1
    kv_seq = kv_bytes_per_token(llm_config, b, tp) * context // (1 if cfg.backend == "vllm" else gpus)
    chunk = min(context, VLLM_BATCHED_TOKENS) if cfg.backend == "vllm" else cfg.max_prompt_tokens
    llm = [Need("llm weights", n_llm * b // gpus, f"{n_llm / 1e9:.2f}B params x {b} B / {gpus} GPUs"),
           Need("llm activations", prefill_activation_bytes(llm_config, chunk, b, tp, cfg.max_batch_size),
                f"one layer over {chunk} prefill tokens + fp32 logits of {cfg.max_batch_size} rows (estimate)")]
    tb = DTYPE_BYTES[cfg.dtype]
    n_tower = tower_params(vision_config)
    pc = projector_config or {}
    n_proj = projector_params(vision_config["hidden_size"], llm_config["hidden_size"], pc.get("merge_size", 4),
                              pc.get("mid_size"))
    pb = DTYPE_BYTES[cfg.projector_dtype]
    side = cfg.max_image_side // vision_config.get("patch_size", 14)
    per_image = side * side
    tokens = cfg.limits.max_images * per_image
    h = vision_config["hidden_size"]
    act = (tokens * (4 * h + vision_config["intermediate_size"]) * tb
           + vision_config["num_attention_heads"] * per_image * per_image * tb)
    replica = [Need("tower weights", n_tower * tb, f"{n_tower / 1e6:.0f}M params x {tb} B"),
               Need("projector weights", n_proj * pb, f"{n_proj / 1e6:.1f}M params x {pb} B"),
               Need("tower activations", act,
                    f"{cfg.limits.max_images} images x {side}x{side} patches: tokens x (4 hidden + mlp) x {tb} B "
                    f"+ one image's attention scores heads x {per_image}^2 x {tb} B (estimate)")]
    return VLMNeeds(llm, kv_seq, cfg.max_batch_size, context, replica)
