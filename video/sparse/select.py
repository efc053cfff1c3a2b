"""Which key blocks each query block keeps: pooled-score top-k plus the diagonal and the first frame.

Pooled (centroid) scores rank key blocks per query block and head, as in VSA's coarse stage (arXiv:2505.13389),
SVG2 (Yang et al. 2025, arXiv:2505.18875) and NABLA (Mikhailov et al. 2025, arXiv:2507.13546); the diagonal block
is always kept (Radial Attention, arXiv:2506.19852: energy decays with distance) and so are the first latent
frame's blocks (Sparse VideoGen, arXiv:2502.01776: an attention sink).
"""

from __future__ import annotations

import torch



def _check_valid(valid: torch.Tensor | None, S_pad: int, block_size: int, device) -> torch.Tensor:
    """bool [S_pad] on `device` (all True when None); ValueError unless S_pad is whole blocks, each with a real
    token."""
    if S_pad % block_size:
        raise ValueError(f"padded length {S_pad} is not a multiple of block_size {block_size}")
    if valid is None:
        return torch.ones(S_pad, dtype=torch.bool, device=device)
    valid = valid.to(device=device, dtype=torch.bool)
    if valid.shape != (S_pad,):
        raise ValueError(f"valid has shape {tuple(valid.shape)}, expected ({S_pad},)")
    if not bool(valid.view(-1, block_size).any(-1).all()):
        raise ValueError("every block must hold at least one real token (a block of padding only)")
    return valid


def select_blocks(
    query: torch.Tensor,
    key: torch.Tensor,
    block_size: int,
    sparsity: float,
    forced_cols: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    zero_padding: bool = False,
) -> tuple[torch.Tensor, int]:
    """Pick, per query block and head, the key blocks to compute (pooled-score top-k, as in VSA / SVG2 / NABLA).

    Args:
        query, key: [B, H, S_pad, D] (any float dtype), already tiled (`TileLayout.to_tiles`), S_pad = n_blocks *
            block_size.
        block_size: tokens per block.
        sparsity: kept fraction of key blocks in (0, 1].
        forced_cols: bool [n_blocks], key blocks every query block keeps (the first latent frame); the diagonal
            block is always kept as well.
        valid: bool [S_pad], real tokens (`TileLayout.valid`); pooling averages over those only. None: all real.
        zero_padding: the padding slots of query and key hold +0.0 (as `TileLayout.to_tiles` writes them), so
            the masking multiply is skipped (a full pass over both; the result is the same to the bit).

    Returns:
        `(indices, n_keep)`: int32 [B, H, n_blocks, n_blocks] whose first `n_keep` entries per row are the kept
        key blocks in ascending order (the rest is filler), and `n_keep` = max(round(sparsity * n_blocks),
        forced blocks per row), at most n_blocks.

    Raises:
        ValueError: if `sparsity` is outside (0, 1], S_pad is not whole blocks, or a block holds no real token.
    """
    if not 0.0 < sparsity <= 1.0:
        raise ValueError(f"sparsity must be in (0, 1], got {sparsity}")
    B, H, S_pad, D = query.shape
    valid = _check_valid(valid, S_pad, block_size, query.device)
    nb = S_pad // block_size
    weight = valid.float()
    counts = weight.view(nb, block_size).sum(-1)[:, None]

    def pooled(x):  # x * 1.0 == x and 0.0 * 0.0 == 0.0: skipping the multiply on zero padding changes no bit
        x = x.float() if zero_padding else x.float() * weight[:, None]
        return x.view(B, H, nb, block_size, D).sum(-2) / counts

    return rank_blocks(pooled(query), pooled(key), sparsity, forced_cols)


def pool_blocks(x: torch.Tensor, block_of_token: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each block's mean query or key (the centroids `rank_blocks` scores), straight from untiled tokens.

    x: [B, H, N, D] (any float dtype, any strides), tokens in any order; block_of_token: int64 [N], the block of
    each token (`TileLayout.inv // block_size`); counts: [n_blocks] tokens per block (each >= 1). Returns float32
    [B, H, n_blocks, D]. One scatter-add pass over x: no tiled copy of it (what `select_blocks` pools from). The
    centroids of VSA's coarse stage (arXiv:2505.13389). Raises (from `index_add_`) RuntimeError if block_of_token
    does not hold N entries, IndexError if one is not below n_blocks.
    """
    B, H, _, D = x.shape
    sums = torch.zeros(B, H, counts.numel(), D, dtype=torch.float32, device=x.device)
    sums.index_add_(2, block_of_token.to(x.device), x.float())
    return sums / counts.to(device=x.device, dtype=torch.float32)[:, None]


def rank_blocks(pooled_q: torch.Tensor, pooled_k: torch.Tensor, sparsity: float,
                forced_cols: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The kept key blocks per query block and head from block centroids (`select_blocks`' ranking step): top-k of
    the pooled scores plus the diagonal and `forced_cols` (VSA, arXiv:2505.13389; Radial Attention, arXiv:2506.19852;
    Sparse VideoGen, arXiv:2502.01776).

    pooled_q, pooled_k: float [B, H, n_blocks, D] (`pool_blocks`); sparsity and forced_cols as in
    `select_blocks`, whose return value this is. Raises ValueError if `sparsity` is outside (0, 1].
    """
    if not 0.0 < sparsity <= 1.0:
        raise ValueError(f"sparsity must be in (0, 1], got {sparsity}")
    B, H, nb, _ = pooled_q.shape
    score = pooled_q @ pooled_k.transpose(-1, -2)  # [B, H, nb, nb]

    forced = torch.eye(nb, dtype=torch.bool, device=pooled_q.device)
    if forced_cols is not None:
        forced = forced | forced_cols.to(pooled_q.device)[None, :]
    n_keep = min(nb, max(round(sparsity * nb), int(forced.sum(-1).max())))
    score = score.masked_fill(forced, float("inf"))
    kept = score.topk(n_keep, dim=-1).indices.sort(dim=-1).values
    filler = torch.zeros(B, H, nb, nb - n_keep, dtype=kept.dtype, device=kept.device)
    return torch.cat([kept, filler], dim=-1).to(torch.int32), n_keep
