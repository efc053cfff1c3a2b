"""The trained projector: MoonViT patch features -> LLM input embeddings (Kimi-style).

Kimi K2.5's ``mm_projector`` (``Kimi_K25MultimodalProjection`` in transformers): per-patch LayerNorm over the
tower hidden size, concatenation of each 2x2 merge group, then Linear -> GELU -> Linear into the LLM hidden size.
The real K2.5 projector is 4608 -> 4608 -> 7168; a public GLM-5.2 graft trains 4608 -> 4608 -> 6144 (~49.5M
params). ``mid_size`` below 4608 gives the cheaper variant. It is the only module that trains.

``image_context`` (off by default, and off in every GPU profile) adds one linear map of the image's mean merge
group to every token's middle layer, so each LLM image token also carries a summary of its whole image (global
average pooling as in Squeeze-and-Excitation, Hu et al. 2018, arXiv:1709.01507, and GCNet, Cao et al. 2019,
arXiv:1904.11492): a per-token MLP cannot pool across tokens, so without it the LLM alone has to count or compare
across the image's tokens. Token counts are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class GraftProjectorConfig(PretrainedConfig):
    """Sizes of the projector: ``vision_hidden_size`` (tower width, 1152 for MoonViT), ``merge_size``
    (patches per merge group, 4 for 2x2), ``mid_size`` (default: the concatenated width), ``llm_hidden_size``."""

    model_type = "chimera_graft_projector"

    def __init__(self, vision_hidden_size: int = 1152, merge_size: int = 4, mid_size: int | None = None,
                 llm_hidden_size: int = 4096, layer_norm_eps: float = 1e-5, image_context: bool = False,
                 **kwargs):
        self.vision_hidden_size = vision_hidden_size
        self.merge_size = merge_size
        self.mid_size = mid_size or vision_hidden_size * merge_size
        self.llm_hidden_size = llm_hidden_size
        self.layer_norm_eps = layer_norm_eps
        self.image_context = image_context
        super().__init__(**kwargs)


class GraftProjector(PreTrainedModel):
    """Kimi-style projector, saved and loaded with ``save_pretrained``/``from_pretrained`` (safetensors).

    forward(patch_groups, tokens_per_image): ``(num_tokens, merge_size, vision_hidden_size)`` float (the tower's
    ``pooler_output``, one row per LLM image token, images packed in order) -> ``(num_tokens, llm_hidden_size)`` in
    the projector's dtype. With ``image_context`` the middle layer is ``in_proj(x_i) + context_proj(mean_j x_j)``,
    the mean over the tokens of token i's image.
    """

    config_class = GraftProjectorConfig
    base_model_prefix = "projector"
    _no_split_modules: list[str] = []

    def __init__(self, config: GraftProjectorConfig):
        super().__init__(config)
        in_size = config.vision_hidden_size * config.merge_size
        self.pre_norm = nn.LayerNorm(config.vision_hidden_size, eps=config.layer_norm_eps)
        self.in_proj = nn.Linear(in_size, config.mid_size)
        self.context_proj = nn.Linear(in_size, config.mid_size, bias=False) if config.image_context else None
        self.act = nn.GELU()
        self.out_proj = nn.Linear(config.mid_size, config.llm_hidden_size)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, patch_groups: torch.Tensor, tokens_per_image: Sequence[int] | None = None) -> torch.Tensor:
        """``(N, merge, C)`` -> ``(N, llm_hidden)``, computed in the projector's dtype (keep it fp32 or bf16:
        fp16 overflows in the GELU MLP on real towers' activations).

        ``tokens_per_image``: the LLM tokens of each packed image, in order
        (``grafting.model.image_token_counts``); needed with ``image_context`` (each image's mean is taken over its
        own tokens only, so a packed batch gives every image the rows it gets alone), ignored without it. Raises
        ValueError with ``image_context`` if it is missing, or does not sum to N or holds a count below 1.
        """
        n = patch_groups.shape[0]
        x = self.pre_norm(patch_groups.to(self.pre_norm.weight.dtype))
        x = x.reshape(n, -1)
        h = self.in_proj(x)
        if self.context_proj is not None:
            counts = list(tokens_per_image) if tokens_per_image is not None else None
            if counts is None or sum(counts) != n or min(counts, default=1) < 1:
                raise ValueError(f"an image-context projector needs each packed image's token count (>= 1 each, "
                                 f"summing to the {n} rows given); got {counts}")
            means = torch.stack([part.mean(0) for part in x.split(counts)])  # (images, merge * C)
            h = h + self.context_proj(means).repeat_interleave(torch.tensor(counts, device=h.device), dim=0)
        return self.out_proj(self.act(h))
