"""The trained projector: MoonViT patch features -> LLM input embeddings (Kimi-style).

Kimi K2.5's ``mm_projector`` (``Kimi_K25MultimodalProjection`` in transformers): per-patch LayerNorm over the
tower hidden size, concatenation of each 2x2 merge group, then Linear -> GELU -> Linear into the LLM hidden size.
The real K2.5 projector is 4608 -> 4608 -> 7168; a public GLM-5.2 graft trains 4608 -> 4608 -> 6144 (~49.5M
params). ``mid_size`` below 4608 gives the cheaper variant. It is the only module that trains.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class GraftProjectorConfig(PretrainedConfig):
    """Sizes of the projector: ``vision_hidden_size`` (tower width, 1152 for MoonViT), ``merge_size``
    (patches per merge group, 4 for 2x2), ``mid_size`` (default: the concatenated width), ``llm_hidden_size``."""

    model_type = "chimera_graft_projector"

    def __init__(self, vision_hidden_size: int = 1152, merge_size: int = 4, mid_size: int | None = None,
                 llm_hidden_size: int = 4096, layer_norm_eps: float = 1e-5, **kwargs):
        self.vision_hidden_size = vision_hidden_size
        self.merge_size = merge_size
        self.mid_size = mid_size or vision_hidden_size * merge_size
        self.llm_hidden_size = llm_hidden_size
        self.layer_norm_eps = layer_norm_eps
        super().__init__(**kwargs)


class GraftProjector(PreTrainedModel):
    """Kimi-style projector, saved and loaded with ``save_pretrained``/``from_pretrained`` (safetensors).

    forward(patch_groups): ``(num_tokens, merge_size, vision_hidden_size)`` float (the tower's ``pooler_output``,
    one row per LLM image token) -> ``(num_tokens, llm_hidden_size)`` in the projector's dtype.
    """

    config_class = GraftProjectorConfig
    base_model_prefix = "projector"
    _no_split_modules: list[str] = []

    def __init__(self, config: GraftProjectorConfig):
        super().__init__(config)
        in_size = config.vision_hidden_size * config.merge_size
        self.pre_norm = nn.LayerNorm(config.vision_hidden_size, eps=config.layer_norm_eps)
        self.in_proj = nn.Linear(in_size, config.mid_size)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(config.mid_size, config.llm_hidden_size)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, patch_groups: torch.Tensor) -> torch.Tensor:
        """``(N, merge, C)`` -> ``(N, llm_hidden)``, computed in the projector's dtype (keep it fp32 or bf16:
        fp16 overflows in the GELU MLP on real towers' activations)."""
        n = patch_groups.shape[0]
        x = self.pre_norm(patch_groups.to(self.pre_norm.weight.dtype))
        x = x.reshape(n, -1)
        return self.out_proj(self.act(self.in_proj(x)))
