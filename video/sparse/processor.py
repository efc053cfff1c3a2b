"""The diffusers attention processor: `WanAttnProcessor` whose self-attention runs `block_sparse_attention`, and the
`SparseState` its instances share (options of the request, where denoising stands).

In the style of diffusers' attention processors (`diffusers.models.attention_processor`): installed with
`transformer.set_attn_processor()`, dense code paths are the parent's, unchanged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections

from ..config import SparseAttentionConfig
from .attention import block_sparse_attention
from .layout import Grid

logger = logging.getLogger(__name__)


@dataclass
class SparseState:
    """What the processors of one transformer share: the request's options and where denoising stands.

    `grid` (latent frames, height, width in tokens) and `step` are set by the transformer's forward pre-hook;
    `sparsity` None means dense everywhere. Counters tell tests which path ran.
    """

    config: SparseAttentionConfig
    sparsity: float | None = None
    tile: Grid = (2, 8, 8)
    dense_steps: int = 0
    dense_layers: frozenset[int] = frozenset()
    backend: str = "auto"
    compiled: bool = True
    grid: Grid | None = None
    step: int = -1
    last_timestep: float | None = None
    sparse_calls: int = 0
    dense_calls: int = 0
    warned: set = field(default_factory=set)

    def sparse_now(self, layer_index: int) -> bool:
        """True when layer `layer_index` runs sparse at the current step."""
        return (
            self.sparsity is not None
            and self.step >= self.dense_steps
            and layer_index not in self.dense_layers
        )


def _apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding, exactly as diffusers' `WanAttnProcessor` applies it. x: [B, N, H, D]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanSparseAttnProcessor(WanAttnProcessor):
    """`WanAttnProcessor` whose self-attention is block-sparse (the method: `video.sparse`'s docstring).

    Cross-attention (`encoder_hidden_states` given), attention with an explicit mask, dense steps, dense layers,
    and calls whose token count does not match the recorded latent grid run the parent's dense code unchanged.

    Args:
        state: the `SparseState` shared by all processors of a transformer.
        layer_index: index of the transformer block this processor serves (for `dense_layers`).

    Call shapes: hidden_states [B, N, C] (N = frames * height * width latent tokens, frame-major),
    rotary_emb (cos, sin) each [1, N, 1, head_dim]; returns [B, N, C] in hidden_states' dtype.
    """

    def __init__(self, state: SparseState, layer_index: int = 0):
        super().__init__()
        self.state = state
        self.layer_index = layer_index

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        state = self.state
        usable = (
            encoder_hidden_states is None
            and attention_mask is None
            and attn.add_k_proj is None
            and state.grid is not None
            and math.prod(state.grid) == hidden_states.shape[1]
        )
        if not (usable and state.sparse_now(self.layer_index)):
            if encoder_hidden_states is None:
                state.dense_calls += 1
                if state.sparsity is not None and not usable and "grid" not in state.warned:
                    state.warned.add("grid")
                    logger.warning("sparse attention: token count %d does not match grid %s; running dense",
                                   hidden_states.shape[1], state.grid)
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)

        out = block_sparse_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            grid=state.grid, sparsity=state.sparsity, tile=state.tile, compiled=state.compiled,
            backend=state.backend,
        )
        state.sparse_calls += 1
        hidden_states = out.transpose(1, 2).flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)
