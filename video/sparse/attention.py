"""`block_sparse_attention`: tiled, block-sparse self-attention, a drop-in for `F.scaled_dot_product_attention`.

Tiles the tokens (`layout`), picks the kept blocks (`select`; on the CPU the block centroids are pooled straight
from the untiled tokens), and runs one of two backends with the same mask and result: "flex" (`flex`, the CUDA
default) or "gather" (`gather`, the CPU default).
"""

from __future__ import annotations

import math

import torch

from .flex import _flex, make_block_mask
from .gather import compact_block_attention
from .layout import Grid, tile_layout
from .select import pool_blocks, rank_blocks, select_blocks


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grid: Grid,
    sparsity: float,
    tile: Grid = (2, 8, 8),
    compiled: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Self-attention over the tiled block-sparse mask; drop-in for `F.scaled_dot_product_attention`.

    Args:
        query, key, value: [B, H, N, D], frame-major tokens with N = prod(grid) (float32, bfloat16 or float16).
        grid: (frames, height, width) of the latent token grid.
        sparsity: kept fraction of key blocks in (0, 1]; 1.0 computes every block (equals dense attention).
        tile: (t, h, w) tile shape; its volume is the block size; one block is one tile (`tile_layout`).
        compiled: for the flex backend: compiled flex_attention (skips masked blocks) or eager flex (dense
            compute, a reference).
        backend: "flex" (`flex_attention` with a `BlockMask`), "gather" (`gathered_block_attention`: gathered
            kept blocks and batched GEMMs), or "auto": flex on CUDA, gather elsewhere. Same mask, same result
            to float rounding.

    Returns:
        [B, H, N, D] attention output, frame-major, dtype of `query`. Softmax scale 1/sqrt(D). Padding slots of
        the tiles are never attended to and never returned.

    Raises:
        ValueError: if N != prod(grid), `sparsity` is outside (0, 1], a tile dimension is not positive, or
            `backend` is unknown.
    """
    if backend == "auto":
        backend = "flex" if query.is_cuda else "gather"
    if backend not in ("flex", "gather"):
        raise ValueError(f"unknown sparse attention backend {backend!r} (auto, flex or gather)")
    B, H, N, D = query.shape
    if N != math.prod(grid):
        raise ValueError(f"sequence length {N} does not match the latent grid {grid}")
    layout = tile_layout(tuple(grid), tuple(tile))
    bs, nb = layout.block_size, layout.n_blocks
    valid = layout.valid.to(query.device)
    forced_cols = torch.arange(nb, device=query.device) < layout.first_frame_blocks
    counts = valid.view(nb, bs).sum(-1)
    if query.is_cuda:  # centroids from the tiles flex reads anyway (index_add_ is not deterministic on CUDA)
        q, k = (layout.to_tiles(x) for x in (query, key))
        indices, n_keep = select_blocks(q, k, bs, sparsity, forced_cols, valid, zero_padding=True)
    else:  # centroids in one pass over the untiled tokens (no tiled copy; the CPU backend never tiles)
        block_of_token = layout.inv // bs
        indices, n_keep = rank_blocks(pool_blocks(query, block_of_token, counts),
                                      pool_blocks(key, block_of_token, counts), sparsity, forced_cols)
    if backend == "gather":  # straight from frame-major to the real tokens in tile order, and back
        real = layout.slots[layout.valid].to(query.device)  # frame-major token at each compact position
        out = compact_block_attention(query.float(), key.float(), value.float(), counts, indices, n_keep,
                                      min(layout.first_frame_blocks, n_keep), order=real, cache=layout.cache)
        return out.to(query.dtype)
    mask = make_block_mask(indices, n_keep, valid, bs)
    q, k, v = (layout.to_tiles(x) for x in (query, key, value))
    return layout.from_tiles(_flex(compiled)(q, k, v, block_mask=mask))
