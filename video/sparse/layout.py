"""The 3-D tile layout of Wan's latent tokens: one 128-token block is exactly one spatio-temporal tile.

Wan's patch embedding flattens tokens frame-major (t, h, w). Sliding Tile Attention (Zhang et al. 2025,
arXiv:2502.04507) and VSA (arXiv:2505.13389, github.com/hao-ai-lab/FastVideo) permute them into 3-D tiles so that
a hardware block is a cube of the video; we do the same, padding every tile (edge tiles included) to whole blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]



@dataclass(frozen=True)
class TileLayout:
    """Where each frame-major token sits in the tiled, padded sequence; one block = one tile, exactly.

    Frames 1.. are cut into (t, h, w) tiles from frame 1 on; frame 0 (Wan's VAE gives it to one pixel frame) into
    (1, h, t*w) tiles, so that its tiles hold as many tokens as the others. Every tile, edge tiles included, is
    padded to the block size (the tile volume), so block b of the sequence is tile b and nothing else. Padding
    slots hold zeros, are masked as keys, and their query rows are dropped.

    Attributes:
        grid: (frames, height, width) latent token grid; tile: (t, h, w); block_size: prod(tile).
        slots: int64 [S_pad], S_pad = n_blocks * block_size: the frame-major token index at each slot, -1 where
            the slot is padding.
        inv: int64 [N], N = prod(grid): the slot of each frame-major token (`x = x_tiled[..., inv, :]`).
        valid: bool [S_pad]: slot holds a real token.
        n_blocks: blocks (= tiles); first_frame_blocks: the leading blocks that tile frame 0.
        cache: what backends derive from the layout alone and keep between calls (the gather backend's
            tile-order indices, `plan.TilePlan`); not part of the layout's identity.
    """

    grid: Grid
    tile: Grid
    block_size: int
    slots: torch.Tensor
    inv: torch.Tensor
    valid: torch.Tensor
    n_blocks: int
    first_frame_blocks: int
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    def to_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, N, D] frame-major -> [B, H, S_pad, D] tiled, zeros at padding slots (same dtype/device)."""
        out = x.new_zeros(*x.shape[:2], self.slots.numel(), x.shape[-1])
        return out.index_copy_(2, self.inv.to(x.device), x)

    def from_tiles(self, y: torch.Tensor) -> torch.Tensor:
        """[B, H, S_pad, D] tiled -> [B, H, N, D] frame-major; padding slots are dropped."""
        return y.index_select(2, self.inv.to(y.device))


@lru_cache(maxsize=64)
def tile_layout(grid: Grid, tile: Grid) -> TileLayout:
    """The `TileLayout` of a latent grid (Sliding Tile Attention / VSA layout, tiles padded to whole blocks).

    Args:
        grid: (frames, height, width) of the latent token grid, e.g. (21, 30, 52) for Wan2.1 at 480x832x81.
        tile: (t, h, w) tile shape of frames 1..; frame 0 uses (1, h, t*w). Block size = t*h*w.

    Returns:
        The layout (CPU tensors; cached per (grid, tile)). Example: (21, 30, 52) with (2, 8, 8) gives 16 frame-0
        blocks (4 x 4 tiles of 1x8x16) + 280 blocks for frames 1-20 (10 x 4 x 7 tiles of 2x8x8) = 296 blocks
        holding 32,760 tokens in 37,888 slots.

    Raises:
        ValueError: if a grid or tile dimension is not positive.
    """
    grid, tile = tuple(int(g) for g in grid), tuple(int(t) for t in tile)
    if len(grid) != 3 or len(tile) != 3 or min(grid) < 1 or min(tile) < 1:
        raise ValueError(f"grid {grid} and tile {tile} must be three positive sizes")
    T, H, W = grid
    index = torch.arange(T * H * W).view(T, H, W)
    first = _tile_slots(index[:1], (1, tile[1], tile[0] * tile[2]))
    parts = [first] + ([_tile_slots(index[1:], tile)] if T > 1 else [])
    slots = torch.cat(parts)
    valid = slots >= 0
    inv = torch.empty(T * H * W, dtype=torch.int64)
    inv[slots[valid]] = torch.nonzero(valid).squeeze(1)
    block_size = math.prod(tile)
    return TileLayout(grid, tile, block_size, slots, inv, valid, slots.numel() // block_size,
                      first.numel() // block_size)


def _tile_slots(index: torch.Tensor, tile: Grid) -> torch.Tensor:
    """Frame-major indices `index` (int64 [t, h, w]) listed tile by tile, each tile in (t, h, w) order and padded
    with -1 to the tile volume (edge tiles included)."""
    pads = [(-s) % ts for s, ts in zip(index.shape, tile)]
    padded = F.pad(index, (0, pads[2], 0, pads[1], 0, pads[0]), value=-1)
    (nt, nh, nw), (tt, th, tw) = [s // ts for s, ts in zip(padded.shape, tile)], tile
    return padded.view(nt, tt, nh, th, nw, tw).permute(0, 2, 4, 1, 3, 5).reshape(-1)


def tile_ids(grid: Grid, tile: Grid) -> torch.Tensor:
    """int64 [N]: the geometric tile of each frame-major token (frame 0: (1, h, t*w) tiles; frames 1..: (t, h, w)
    tiles starting at frame 1), numbered in the order `tile_layout` lists them. The reference for locality."""
    T, H, W = grid
    tt, th, tw = tile
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    n0h, n0w = -(-H // th), -(-W // (tt * tw))
    nh, nw = -(-H // th), -(-W // tw)
    first = (h // th) * n0w + w // (tt * tw)
    rest = n0h * n0w + (((t - 1).clamp(min=0) // tt) * nh + h // th) * nw + w // tw
    return torch.where(t == 0, first, rest).reshape(-1)


def block_locality(slots: torch.Tensor, grid: Grid, tile: Grid, block_size: int) -> dict:
    """How local the blocks of a token order are: the measure the pooled block selection relies on.

    Args:
        slots: int64 [S_pad] frame-major token index per slot, -1 for padding (a `TileLayout.slots`, or any other
            order cut into consecutive blocks of `block_size`).
        grid, tile: the latent grid and the tile shape whose tiles (`tile_ids`) are the reference.

    Returns:
        dict with `blocks`; `straddling`: blocks whose real tokens lie in more than one tile; `fill`: real tokens /
        slots; `bbox`: mean (frames, rows, cols) extent of a block's real tokens; `bbox_volume`: mean volume of
        that box over the mean real tokens per block (1.0 = a block fills its box).
    """
    T, H, W = grid
    blocks = slots.view(-1, block_size)
    ids = tile_ids(grid, tile)
    straddling, extents, ratios = 0, [], []
    for row in blocks:
        tok = row[row >= 0]
        if tok.numel() == 0:
            continue
        straddling += int(ids[tok].unique().numel() > 1)
        t, h, w = tok // (H * W), (tok // W) % H, tok % W
        ext = [int(a.max() - a.min()) + 1 for a in (t, h, w)]
        extents.append(ext)
        ratios.append(math.prod(ext) / tok.numel())
    n = len(extents)
    return {"blocks": blocks.shape[0], "straddling": straddling, "fill": float((slots >= 0).sum()) / slots.numel(),
            "bbox": tuple(sum(e[i] for e in extents) / n for i in range(3)), "bbox_volume": sum(ratios) / n}

