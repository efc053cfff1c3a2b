"""The flex_attention backend: a `BlockMask` from the kept blocks, and flex_attention compiled once per process.

The route of NABLA (Mikhailov et al. 2025, arXiv:2507.13546): block masks for `torch.nn.attention.flex_attention`,
no custom kernel. Compiled, flex skips masked blocks on CPU and GPU alike (on GPU a Triton kernel); eager flex
computes densely (a reference only).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .select import _check_valid


def make_block_mask(indices: torch.Tensor, n_keep: int, valid: torch.Tensor, block_size: int) -> BlockMask:
    """flex_attention `BlockMask` from `select_blocks` output.

    Args:
        indices: int32 [B, H, n_blocks, n_blocks], first `n_keep` per row are kept key blocks (ascending).
        n_keep: kept blocks per row.
        valid: bool [n_blocks * block_size], real tokens; keys at padding slots are masked.
        block_size: tokens per block (same for queries and keys).

    Returns:
        BlockMask over [n_blocks * block_size]^2. Kept blocks that hold no padding are "full" blocks, computed
        without evaluating the mask; kept blocks with padding slots (edge tiles) are partial blocks. The mask_mod
        (kept block and real key) defines the same mask element-wise, so eager flex, which ignores the block
        structure and evaluates mask_mod everywhere, computes the same attention.
    """
    B, H, nb, _ = indices.shape
    valid = _check_valid(valid, nb * block_size, block_size, indices.device)
    kept_idx = indices[..., :n_keep].long()
    kept = torch.zeros(B, H, nb, nb, dtype=torch.bool, device=indices.device)
    kept.scatter_(-1, kept_idx, True)
    has_pad = ~valid.view(nb, block_size).all(-1)
    padded = has_pad[kept_idx]  # [B, H, nb, n_keep]
    n_partial = padded.sum(-1, dtype=torch.int32)
    filler = torch.zeros(B, H, nb, nb - n_keep, dtype=torch.int32, device=indices.device)
    # Stable sorts keep each group ascending: partial blocks first for kv_indices, full blocks first for full_.
    partial_idx = kept_idx.gather(-1, torch.argsort(~padded, dim=-1, stable=True)).to(torch.int32)
    full_idx = kept_idx.gather(-1, torch.argsort(padded, dim=-1, stable=True)).to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return kept[b, h, q_idx // block_size, kv_idx // block_size] & valid[kv_idx]

    return BlockMask.from_kv_blocks(
        n_partial, torch.cat([partial_idx, filler], -1), n_keep - n_partial, torch.cat([full_idx, filler], -1),
        BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(nb * block_size, nb * block_size),
    )


_compiled_flex = None


def _flex(compiled: bool):
    """`flex_attention`, compiled once per process on first use when `compiled`.

    Each new latent size is one more compiled variant. Past dynamo's recompile limit (8 by default) a call would
    silently fall back to eager flex, which materializes the full score matrix (tens of GB at 32k tokens), so the
    limit is raised to at least 64 for this process.
    """
    global _compiled_flex
    if not compiled:
        return flex_attention
    if _compiled_flex is None:
        import torch._dynamo

        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 256)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex
