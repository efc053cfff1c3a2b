"""Block-sparse self-attention for the Wan transformer (diffusers `WanTransformer3DModel`).

What it does, per self-attention call of a denoising step:

1. Tokens arrive frame-major (t, h, w), as Wan's patch embedding flattens them. They are permuted into 3-D
   tiles (default 2 x 8 x 8 = 128 tokens; the first latent frame is tiled on its own, 1 x 8 x 16), and every
   tile, edge tiles included, is padded to the block size, so that one 128-token *block* is exactly one tile: a
   spatio-temporal neighbourhood on any grid (`tile_layout`). Padding slots are masked out as keys and their
   query rows dropped; they cost compute (13.5% of the slots at Wan2.1's 21 x 30 x 52, 6.25% at 21 x 45 x 80).
2. Each block's queries and keys are mean-pooled; the pooled Q.K^T score ranks the key blocks for each query
   block, per head. Kept: the top-k key blocks (k = round(sparsity * blocks)), plus always the diagonal block
   (the query's own neighbourhood) and every block holding the first latent frame (Wan's VAE gives the first
   latent frame to one pixel frame; every later frame attends to it heavily -- an "attention sink").
3. Attention over the kept blocks only, by one of two backends with the same mask and result:
   - "flex": `torch.nn.attention.flex_attention` with that `BlockMask`. Compiled (`torch.compile`), it skips
     masked blocks on CPU and GPU alike (on GPU a Triton kernel); eager flex computes densely, a reference only.
   - "gather": on the real tokens only (no padding computed), the first frame's blocks, kept by every row, in
     one dense call of ATen's fused kernel; per query block, its other kept key/value blocks gathered into one
     buffer (shared with a paired neighbouring block) and attention as two BLAS GEMMs with the softmax between
     (`compact_block_attention`); the parts merged exactly through their log-sum-exps. On CPU this is 3-4x
     faster than compiled flex, whose CPU template multiplies fp32 tiles with a 1x16 register micro-kernel.
   "auto" (default) picks flex on CUDA and gather elsewhere. No CUDA-only code either way.
4. The output is permuted back to frame-major order. Cross-attention (`encoder_hidden_states` given), the first
   `dense_fraction` of denoising steps, and `dense_layers` run diffusers' dense processor unchanged.

At sparsity 1.0 every block is kept and the result equals dense attention (to float rounding).

Where the ideas come from, and what we take from each:
- Sparse VideoGen (Xi et al. 2025, arXiv:2502.01776, github.com/svg-project/Sparse-VideoGen): spatial and
  temporal heads in video DiTs; keep the first ~25% of denoising steps (and optionally first layers) dense;
  the first frame as a sink every token attends to. We take the dense warm-up steps, dense layers and the
  always-kept first frame.
- SVG2 (Yang et al. 2025, arXiv:2505.18875): semantic-aware permutation, so that a block gathers similar
  tokens before top-k block selection on pooled (centroid) scores. We take pooled-score top-k block selection;
  our permutation is geometric (3-D tiles), not k-means.
- Radial Attention (Li et al. 2025, arXiv:2506.19852): attention energy decays with spatio-temporal distance,
  so a static mask concentrated near the diagonal loses little. We take "always keep the local/diagonal block";
  we do not use its static O(n log n) mask shape.
- Sliding Tile Attention (Zhang et al. 2025, arXiv:2502.04507) and VSA (arXiv:2505.13389,
  github.com/hao-ai-lab/FastVideo): permute tokens into 3-D tiles so that a hardware block is a cube of
  the video; VSA's coarse stage pools each tile and picks top-k tiles. We take the tile permutation and the
  pooled coarse stage; VSA's trained gating (it needs fine-tuning) we do not.
- NABLA (Mikhailov et al. 2025, arXiv:2507.13546): adaptive block mask from pooled Q/K with flex_attention
  block masks, no custom kernel. We take the flex_attention BlockMask implementation route; NABLA picks blocks
  by a cumulative-probability threshold, we use a fixed kept fraction (so cost is predictable).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import (
    WanAttnProcessor,
    _get_qkv_projections,
)
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .config import SparseAttentionConfig  # noqa: F401 - defined with the profile schema, re-exported here

logger = logging.getLogger(__name__)

Grid = tuple[int, int, int]


# ----------------------------------------------------------------------------------------------------------------
# 3-D tile layout: every block is one tile
# ----------------------------------------------------------------------------------------------------------------


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
    """

    grid: Grid
    tile: Grid
    block_size: int
    slots: torch.Tensor
    inv: torch.Tensor
    valid: torch.Tensor
    n_blocks: int
    first_frame_blocks: int

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


# ----------------------------------------------------------------------------------------------------------------
# Block selection and BlockMask
# ----------------------------------------------------------------------------------------------------------------


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

    pooled_q, pooled_k = pooled(query), pooled(key)
    score = pooled_q @ pooled_k.transpose(-1, -2)  # [B, H, nb, nb]

    forced = torch.eye(nb, dtype=torch.bool, device=query.device)
    if forced_cols is not None:
        forced = forced | forced_cols.to(query.device)[None, :]
    n_keep = min(nb, max(round(sparsity * nb), int(forced.sum(-1).max())))
    score = score.masked_fill(forced, float("inf"))
    kept = score.topk(n_keep, dim=-1).indices.sort(dim=-1).values
    filler = torch.zeros(B, H, nb, nb - n_keep, dtype=kept.dtype, device=kept.device)
    return torch.cat([kept, filler], dim=-1).to(torch.int32), n_keep


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


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@lru_cache(maxsize=1)
def cpu_kernel() -> str:
    """The kernel the gather backend runs its query blocks on, chosen once per process from the CPU.

    - "bmm": scores by one GEMM per query block (whole 128-row blocks: each K tile is packed once per block),
      exp in place (without the max subtraction when the scores are provably within +-64, see `_attend`), row
      sums, P @ V by a second GEMM and one division per output row.
    - "flash": ATen's fused CPU flash-attention kernel (what dense `F.scaled_dot_product_attention` runs), per
      query block. Below 192 query rows it tiles the rows by 32, so each of its GEMMs re-packs a 512-key tile
      of K for 32 rows only.

    Returns "bmm" where ATen's CPU capability (`torch.backends.cpu.get_cpu_capability()`, which honours
    ATEN_CPU_CAPABILITY) is AVX2 or AVX512: measured faster on both (`bench/sparse_attention.py` times both
    kernels side by side and prints the CPU's model, flags and capability; at 16,380 tokens, 1 thread: 472 vs
    537 ms on AVX512, 690 vs 739 ms with AVX2 emulated on the same CPU). "flash" elsewhere (not measured; the
    fused kernel is the portable choice). The shared first-frame part always runs on "flash" where the value
    head dim equals the query's (a dense [N x P] problem, its best shape; faster than "bmm" on both ISAs). Both
    kernels are exact to fp32 rounding (tests/test_sparse_attention.py, against a float64 reference).
    """
    capability = torch.backends.cpu.get_cpu_capability()
    return "bmm" if capability.startswith(("AVX2", "AVX512")) else "flash"


# |score| <= _EXP_RANGE keeps exp(score) and sums of up to 1e10 such terms inside float32's normal range
# (e^64 = 6.2e27, e^-64 = 1.6e-28; the normal range is 1.2e-38 .. 3.4e38)
_EXP_RANGE = 64.0


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str,
            out: torch.Tensor | None = None, bounded: bool = False, scratch: torch.Tensor | None = None):
    """Softmax attention per batch element with its log-sum-exp (for merging partial results exactly).

    q [G, M, D], k [G, L, D], v [G, L, Dv] float32 (strided views with a contiguous last dim are fine) ->
    (out [G, M, Dv], lse [G, M]), lse = log(sum_j exp(scale * q.k_j)) in natural log. kernel: "flash" or "bmm"
    (`cpu_kernel`); "flash" needs Dv == D and runs "bmm" otherwise. "bmm" overwrites q with q * scale. `out`
    (float32 [G, M, Dv], contiguous) and `scratch` (float32, >= G * M * L elements): where the "bmm" kernel
    writes its output and its scores (the "flash" kernel allocates its own). `bounded`: the caller has shown
    |scale * q.k| <= _EXP_RANGE for every pair, so "bmm" exponentiates the scores as they are (softmax is
    shift-invariant; the max subtraction only keeps exp in range) and skips a max pass and a subtraction.
    """
    if kernel == "flash" and q.shape[-1] == v.shape[-1]:
        o, lse = _FLASH_CPU(q[:, None], k[:, None], v[:, None], scale=scale)
        return o[:, 0], lse[:, 0]
    G, M, L = q.shape[0], q.shape[1], k.shape[1]
    if scale != 1.0:
        q = q.mul_(scale)
    s = torch.bmm(q, k.transpose(1, 2), out=None if scratch is None else scratch[:G * M * L].view(G, M, L))
    m = None if bounded else s.amax(-1, keepdim=True)
    (s if bounded else s.sub_(m)).exp_()
    total = s.sum(-1, keepdim=True)
    o = torch.bmm(s, v, out=out).div_(total)
    lse = total.log_() if bounded else total.log_().add_(m)
    return o, lse.squeeze(-1)


def _score_bound(query: torch.Tensor, key: torch.Tensor, scale: float) -> float:
    """max over (b, h, i, j) of scale * |q_i| * |k_j| (Cauchy-Schwarz: >= every |score|); one pass over q and k."""
    qn = torch.linalg.vector_norm(query, dim=-1).amax(-1)  # [B, H]
    kn = torch.linalg.vector_norm(key, dim=-1).amax(-1)
    return float((qn * kn).max()) * scale


def _row_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, N, D] (any strides) -> (rows [R, D], a view of x's storage where possible (a copy otherwise),
    int64 [B * H, N]: the row of rows holding x[b, h, n]). Lets the gathers read transposed [B, N, H, D] views in
    place."""
    B, H, N, D = x.shape
    strides = [s if n > 1 else 0 for s, n in zip(x.stride(), x.shape)]
    if (x.stride(-1) != 1 and D > 1) or any(s % D for s in strides[:3]) or min(strides[:3]) < 0:
        x = x.contiguous()
        strides = [s if n > 1 else 0 for s, n in zip(x.stride(), x.shape)]
    sb, sh, sn = (s // D for s in strides[:3])
    dev = x.device
    index = (torch.arange(B, device=dev)[:, None, None] * sb + torch.arange(H, device=dev)[None, :, None] * sh
             + torch.arange(N, device=dev)[None, None, :] * sn).view(B * H, N)
    return x.as_strided((int(index.max()) + 1, D), (D, 1)), index


def _ranges(base: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """int64: arange(base[0], base[0] + lens[0]), arange(base[1], ...), ... concatenated."""
    offsets = lens.cumsum(0) - lens
    return torch.repeat_interleave(base - offsets, lens) + torch.arange(int(lens.sum()), device=base.device)


def compact_block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    counts: torch.Tensor,
    indices: torch.Tensor,
    n_keep: int,
    shared_blocks: int = 0,
    budget_bytes: int = 2 << 20,
    kernel: str | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-sparse attention on the real tokens only, at the rate of the fused dense kernel (the CPU backend).

    Block b holds the tokens order[starts[b] : starts[b] + counts[b]] (starts = exclusive cumsum of counts; with
    `order` None, rows starts[b] : ... of the inputs): no padding anywhere, so no mask is needed and padding costs
    nothing. The tokens are read where they lie (strided views, e.g. transposed [B, N, H, D] projections, are not
    copied). Two parts, merged exactly through their log-sum-exps (out = lerp(out_var, out_shared,
    sigmoid(lse_shared - lse_var))), the idea of FlashAttention's blockwise softmax (Dao et al. 2022,
    arXiv:2205.14135) and of Sparse VideoGen's sink/rest split (arXiv:2502.01776):
    - shared: the `shared_blocks` leading key blocks every query block keeps (the first latent frame); all query
      rows of all heads attend to them in one call of the fused kernel (a dense [N x P] problem: its best tiles).
    - variable: the other kept blocks of each (head, query block). A head's query blocks are paired greedily by
      the keys their kept blocks share (neighbouring blocks keep mostly the same ones); a pair's keys and values
      are gathered once into one buffer ordered [only A's, both, only B's], so that each block's keys are one
      contiguous slice of it, and each block runs one call [1, rows, D] x [1, keys, D] on `kernel` (the second
      one reads the shared keys from cache).
    Outputs land in [B, N, H, Dv] memory order, the processor's next layout; one gather puts them there.

    Args:
        query, key: [B, H, N, D], value: [B, H, N, Dv]; float32, any strides; N = counts.sum().
        counts: int64 [n_blocks], tokens per block (each >= 1).
        indices: int [B, H, n_blocks, >= n_keep]; the first `n_keep` per row are the kept key blocks, the first
            `shared_blocks` of them 0 .. shared_blocks - 1 (not checked here).
        n_keep, shared_blocks: kept blocks per row and the shared prefix of them.
        budget_bytes: bound on the scores of one row chunk of the shared part where it runs on "bmm" (Dv != D).
        kernel: "flash" or "bmm" for the variable part (`cpu_kernel()` when None); the shared part runs on the
            flash kernel (the "bmm" one where Dv != D).
        order: int64 [N], a permutation: the token (index along dim 2) at each block position; None = identity.

    Returns:
        [B, H, N, Dv] float32 (memory order [B, N, H, Dv]); softmax scale 1/sqrt(D).
    """
    kernel = kernel or cpu_kernel()
    B, H, N, D = query.shape
    Dv, BH, nb, dev = value.shape[-1], B * H, counts.numel(), query.device
    scale = D**-0.5
    counts = counts.to(device=dev, dtype=torch.int64)
    order = torch.arange(N, device=dev) if order is None else order.to(device=dev, dtype=torch.int64)
    n_var = n_keep - shared_blocks
    bounded = kernel == "bmm" and _score_bound(query, key, scale) <= _EXP_RANGE
    if shared_blocks:
        P = int(counts[:shared_blocks].sum())
        shared = order[:P]
        lo = int(shared.min())
        if int(shared.max()) - lo + 1 == P:  # a contiguous run of tokens (frame 0 in frame-major order)
            ks, vs = key[:, :, lo:lo + P], value[:, :, lo:lo + P]
        else:
            ks, vs = key.index_select(2, shared), value.index_select(2, shared)
        if D == Dv:  # the fused kernel on a dense [N x P] problem: faster than "bmm" on AVX2 and AVX512 alike
            out_s, lse_s = _FLASH_CPU(query, ks, vs, scale=scale)
        else:  # per head, row chunks whose scores stay in cache; out_s in [B, N, H, Dv] memory order
            out_s, lse_s = query.new_empty(B, N, H, Dv).transpose(1, 2), query.new_empty(B, N, H).transpose(1, 2)
            rows = max(64, budget_bytes // (4 * P))
            scratch = query.new_empty(rows * P)
            for b in range(B):
                for h in range(H):
                    for r in range(0, N, rows):
                        o, lse = _attend(query[b, h, None, r:r + rows] * 1.0, ks[b, h, None], vs[b, h, None],
                                         scale, "bmm", None, bounded, scratch)
                        out_s[b, h, r:r + rows], lse_s[b, h, r:r + rows] = o[0], lse[0]
        if not n_var:
            return out_s

    # One element per (head, query block): its query rows against the keys of its variable kept blocks. Query
    # blocks of a head are paired by how many variable keys they share (`_pair_blocks`); a pair's keys are
    # gathered once, ordered [only A's | both | only B's], so that A's keys are the buffer's head and B's its tail,
    # each contiguous, and B reads the shared ones from cache.
    starts = counts.cumsum(0) - counts
    var = indices[..., shared_blocks:n_keep].reshape(BH, nb, n_var).long().cpu()
    counts_c, starts_c = counts.cpu(), starts.cpu()
    pairs, union_blocks, spans = _pair_blocks(var, counts_c)
    # spans: per element (head, query block, key offset in the pair buffer, keys); pairs: (first element, keys)
    head = torch.tensor([s[0] for s in spans], dtype=torch.int64)
    qblk = torch.tensor([s[1] for s in spans], dtype=torch.int64)
    rows = counts_c[qblk]
    ub = torch.tensor(union_blocks, dtype=torch.int64)
    ub_head = torch.tensor([h for h, n in zip([p[0] for p in pairs], [p[3] for p in pairs]) for _ in range(n)],
                           dtype=torch.int64)
    k_tok = order.cpu()[_ranges(starts_c[ub], counts_c[ub])]
    k_head = ub_head.repeat_interleave(counts_c[ub])
    q_tok = order.cpu()[_ranges(starts_c[qblk], rows)]
    q_head = head.repeat_interleave(rows)
    # queries pre-scaled once (one pass) instead of per call
    (qf, q_row), (kf, k_row), (vf, v_row) = (_row_view(x) for x in (query * scale, key, value))
    k_head, k_tok, q_head, q_tok = (t.to(dev) for t in (k_head, k_tok, q_head, q_tok))
    q_idx, k_idx = q_row[q_head, q_tok], k_row[k_head, k_tok]
    v_idx = k_idx if torch.equal(v_row, k_row) else v_row[k_head, k_tok]
    q_off = (rows.cumsum(0) - rows).tolist()
    rows = rows.tolist()

    E = BH * N  # query rows: every one is in exactly one element
    out_e = None if kernel == "flash" and D == Dv else query.new_empty(E, Dv)
    outs, lses = [], []
    max_keys = max(p[2] for p in pairs)
    k_buf, v_buf = query.new_empty(max_keys, D), query.new_empty(max_keys, Dv)
    scratch = None if out_e is None else query.new_empty(max(rows) * max(s[3] for s in spans))
    q_buf = query.new_empty(max(rows), D)
    k0 = 0
    for _, first, n_union, _, n_elems in pairs:
        kb = torch.index_select(kf, 0, k_idx[k0:k0 + n_union], out=k_buf[:n_union])
        vb = torch.index_select(vf, 0, v_idx[k0:k0 + n_union], out=v_buf[:n_union])
        k0 += n_union
        for e in range(first, first + n_elems):
            m, (_, _, off, n) = rows[e], spans[e]
            qb = torch.index_select(qf, 0, q_idx[q_off[e]:q_off[e] + m], out=q_buf[:m])
            dst = None if out_e is None else out_e[q_off[e]:q_off[e] + m][None]
            o, lse = _attend(qb[None], kb[None, off:off + n], vb[None, off:off + n], 1.0, kernel, dst, bounded,
                             scratch)
            if out_e is None:
                outs.append(o[0])
            lses.append(lse[0])
    if out_e is None:
        out_e = torch.cat(outs)
    lse_e = torch.cat(lses)
    # element order -> [B, N, H] order: one gather by the inverse permutation
    dest = ((q_head // H) * N + q_tok) * H + q_head % H
    inv = torch.empty_like(dest)
    inv[dest] = torch.arange(E, device=dev)
    out = out_e.index_select(0, inv).view(B, N, H, Dv)
    if shared_blocks:
        lse = lse_e.index_select(0, inv).view(B, N, H)
        out.lerp_(out_s.transpose(1, 2), torch.sigmoid(lse_s.transpose(1, 2) - lse)[..., None])
    return out.transpose(1, 2)


def _pair_blocks(var: torch.Tensor, counts: torch.Tensor):
    """Pair each head's query blocks greedily by the keys their variable kept blocks share.

    var: int64 [BH, nb, n_var] kept key blocks per (head, query block) (CPU); counts: int64 [nb] tokens per block.
    Returns (pairs, union_blocks, spans): pairs, one per buffer: (head, first element, union keys, union blocks,
    elements (1 or 2)); union_blocks: the key blocks of all buffers, concatenated, each buffer ordered [only A's,
    both, only B's]; spans, one per element in buffer order: (head, query block, key offset, keys).
    """
    BH, nb, n_var = var.shape
    kept = torch.zeros(BH, nb, nb)
    kept.scatter_(-1, var, 1.0)
    shared = (kept * counts.double().float()[None, None]) @ kept.transpose(1, 2)  # [BH, nb, nb] shared keys
    shared.diagonal(dim1=1, dim2=2).fill_(-1.0)
    cnt = counts.tolist()
    pairs, union_blocks, spans = [], [], []
    for h in range(BH):
        score = shared[h].numpy().copy()
        sets = [var[h, b].tolist() for b in range(nb)]
        free = [True] * nb
        for a in range(nb):
            if not free[a]:
                continue
            free[a] = False
            row = score[a]
            b = int(row.argmax())
            if row[b] < 0 or not free[b]:
                cands = [c for c in range(nb) if free[c]]
                b = max(cands, key=lambda c: row[c]) if cands else -1
            if b < 0:
                keys = sum(cnt[x] for x in sets[a])
                pairs.append((h, len(spans), keys, len(sets[a]), 1))
                union_blocks += sets[a]
                spans.append((h, a, 0, keys))
                continue
            free[b] = False
            score[:, a] = score[:, b] = -1.0
            sb = set(sets[b])
            only_a = [x for x in sets[a] if x not in sb]
            both = [x for x in sets[a] if x in sb]
            sa = set(sets[a])
            only_b = [x for x in sets[b] if x not in sa]
            ka, kboth, kb = (sum(cnt[x] for x in blocks) for blocks in (only_a, both, only_b))
            pairs.append((h, len(spans), ka + kboth + kb, len(only_a) + len(both) + len(only_b), 2))
            union_blocks += only_a + both + only_b
            spans.append((h, a, 0, ka + kboth))
            spans.append((h, b, ka, kboth + kb))
    return pairs, union_blocks, spans


def gathered_block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    indices: torch.Tensor,
    n_keep: int,
    block_size: int,
    valid: torch.Tensor | None = None,
    shared_blocks: int = 0,
    budget_bytes: int = 2 << 20,
    kernel: str | None = None,
) -> torch.Tensor:
    """Block-sparse attention by gathering each query block's kept key/value blocks (the CPU backend), on tiled,
    padded inputs: drops the padding slots and runs `compact_block_attention` on the real tokens.

    Args:
        query, key: [B, H, S_pad, D], value: [B, H, S_pad, Dv]; tiled (`TileLayout.to_tiles`), S_pad = n_blocks *
            block_size; float32 (other dtypes are computed in float32 and cast back).
        indices: int [B, H, n_blocks, >= n_keep] from `select_blocks`; the first `n_keep` per row are the kept key
            blocks in ascending order.
        n_keep: kept blocks per row.
        block_size: tokens per block.
        valid: bool [S_pad], real tokens (None: all real); padding slots are never attended to, and their query
            rows are not computed (zeros in the output).
        shared_blocks: leading kept entries equal to 0, 1, ..., shared_blocks - 1 in every row (checked).
        budget_bytes: bound on the scores of one row chunk of the shared part where it runs on "bmm" (Dv != D).
        kernel: "flash" or "bmm" (`cpu_kernel()` when None).

    Returns:
        [B, H, S_pad, Dv] in the dtype of `query`; softmax scale 1/sqrt(D) (the query's head dim).

    Raises:
        ValueError: if S_pad is not a whole number of blocks, a block holds no real token, or the first
            `shared_blocks` kept entries are not 0..shared_blocks-1 in every row.
    """
    B, H, S_pad, D = query.shape
    Dv = value.shape[-1]
    valid = _check_valid(valid, S_pad, block_size, query.device)
    nb = S_pad // block_size
    idx = indices[..., :n_keep]
    shared_blocks = min(shared_blocks, n_keep)
    if shared_blocks and not bool((idx[..., :shared_blocks] == torch.arange(shared_blocks, device=idx.device)).all()):
        raise ValueError(f"the first {shared_blocks} kept blocks are not shared by every row")
    real = torch.nonzero(valid).squeeze(1)
    q, k, v = (x.float().index_select(2, real) for x in (query, key, value))
    out = compact_block_attention(q, k, v, valid.view(nb, block_size).sum(-1), idx, n_keep, shared_blocks,
                                  budget_bytes, kernel)
    return out.new_zeros(B, H, S_pad, Dv).index_copy_(2, real, out).to(query.dtype)


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
    q, k = (layout.to_tiles(x) for x in (query, key))
    forced_cols = torch.arange(nb, device=query.device) < layout.first_frame_blocks
    indices, n_keep = select_blocks(q, k, bs, sparsity, forced_cols, valid, zero_padding=True)
    if backend == "gather":  # straight from frame-major to the real tokens in tile order, and back
        real = layout.slots[layout.valid].to(query.device)  # frame-major token at each compact position
        out = compact_block_attention(query.float(), key.float(), value.float(), valid.view(nb, bs).sum(-1),
                                      indices, n_keep, min(layout.first_frame_blocks, n_keep), order=real)
        return out.to(query.dtype)
    mask = make_block_mask(indices, n_keep, valid, bs)
    return layout.from_tiles(_flex(compiled)(q, k, layout.to_tiles(value), block_mask=mask))


# ----------------------------------------------------------------------------------------------------------------
# Processor + controller
# ----------------------------------------------------------------------------------------------------------------


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
    """`WanAttnProcessor` whose self-attention is block-sparse (see the module docstring for the method).

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


class WanSparseAttention:
    """Installs `WanSparseAttnProcessor` on a `WanTransformer3DModel` and tracks the latent grid and the step.

    Usage (one generation at a time per transformer)::

        sparse = WanSparseAttention.install(pipe.transformer, SparseAttentionConfig())
        with sparse.session(num_inference_steps=30, sparsity=0.125):
            frames = pipe(..., num_inference_steps=30).frames

    A forward pre-hook on the transformer reads the latent shape [B, C, F, H, W] (-> token grid F/p_t x H/p_h x
    W/p_w) and counts denoising steps by changes of the timestep (classifier-free guidance calls the transformer
    twice with the same timestep; it counts once). Several transformers (Wan2.2's `transformer_2`) can share one
    controller: pass `state=` of the first to `install` the second.
    """

    def __init__(self, state: SparseState):
        self.state = state
        self._installed: list[tuple[torch.nn.Module, object, dict]] = []

    @classmethod
    def install(
        cls, transformer: torch.nn.Module, config: SparseAttentionConfig | None = None, state: SparseState | None = None
    ) -> "WanSparseAttention":
        """Replace every attention processor of `transformer` with a `WanSparseAttnProcessor`; returns the controller.

        Args:
            transformer: a diffusers `WanTransformer3DModel`.
            config: defaults for sessions; `SparseAttentionConfig()` if None.
            state: share the state of another controller (for a second transformer of the same pipeline).
        """
        state = state or SparseState(config=config or SparseAttentionConfig())
        controller = cls(state)
        controller.add(transformer)
        return controller

    def add(self, transformer: torch.nn.Module) -> None:
        """Install the processors and the pre-hook on one more transformer sharing this controller's state."""
        original = dict(transformer.attn_processors)
        processors = {}
        for name in original:
            layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
            processors[name] = WanSparseAttnProcessor(self.state, layer)
        transformer.set_attn_processor(processors)
        patch = tuple(transformer.config.patch_size)
        hook = transformer.register_forward_pre_hook(
            lambda module, args, kwargs: self._observe(patch, args, kwargs), with_kwargs=True
        )
        self._installed.append((transformer, hook, original))

    def remove(self) -> None:
        """Put the processors found at install time back and drop the hooks."""
        for transformer, hook, original in self._installed:
            hook.remove()
            transformer.set_attn_processor(original)
        self._installed.clear()

    def _observe(self, patch: tuple[int, int, int], args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if hidden is not None:
            _, _, f, h, w = hidden.shape
            self.state.grid = (f // patch[0], h // patch[1], w // patch[2])
        if timestep is not None:
            t = float(torch.as_tensor(timestep).float().max())
            if t != self.state.last_timestep:
                self.state.step += 1
                self.state.last_timestep = t

    def begin(
        self,
        num_inference_steps: int | None = None,
        sparsity: float | None = None,
        tile: Grid | None = None,
        dense_fraction: float | None = None,
        dense_layers: list[int] | None = None,
        backend: str | None = None,
        compile: bool | None = None,
        full_is_dense: bool = True,
    ) -> None:
        """Start a generation with per-request options (None = the config's default).

        Args:
            num_inference_steps: denoising steps of this generation; the first
                round(dense_fraction * num_inference_steps) run dense. None: no dense warm-up.
            sparsity: kept fraction in (0, 1]. With `full_is_dense` (default), 1.0 runs diffusers' dense path;
                False routes 1.0 through the sparse backend with every block kept (exactness checks).
            tile, dense_fraction, dense_layers, backend, compile: as in `SparseAttentionConfig`.

        Raises:
            ValueError: on an out-of-range option (pydantic validation of the merged config).
        """
        overrides = dict(sparsity=sparsity, tile=tile, dense_fraction=dense_fraction, dense_layers=dense_layers,
                         backend=backend, compile=compile)
        merged = SparseAttentionConfig(**{**self.state.config.model_dump(),
                                          **{k: v for k, v in overrides.items() if v is not None}})
        s = self.state
        s.sparsity = None if (merged.sparsity >= 1.0 and full_is_dense) else merged.sparsity
        s.tile = merged.tile
        s.dense_steps = round(merged.dense_fraction * num_inference_steps) if num_inference_steps else 0
        s.dense_layers = frozenset(merged.dense_layers)
        s.backend, s.compiled = merged.backend, merged.compile
        s.step, s.last_timestep, s.grid = -1, None, None
        s.sparse_calls = s.dense_calls = 0

    def end(self) -> None:
        """Back to dense until the next `begin` (the processors stay installed)."""
        self.state.sparsity = None

    @contextlib.contextmanager
    def session(self, **options):
        """`begin(**options)` ... `end()` as a context manager."""
        self.begin(**options)
        try:
            yield self.state
        finally:
            self.end()


@contextlib.contextmanager
def sparse_attention(
    transformers: torch.nn.Module | list[torch.nn.Module],
    sparsity: float | None = None,
    num_inference_steps: int | None = None,
    config: SparseAttentionConfig | None = None,
    **options,
):
    """Run a generation with block-sparse self-attention; diffusers' dense processors are back afterwards.

    What the video engine wraps each job in::

        with sparse_attention(pipe.transformer, sparsity=0.125, num_inference_steps=40):
            pipe(...)

    Args:
        transformers: one `WanTransformer3DModel` or several sharing the schedule (Wan2.2 A14B's two experts).
        sparsity: kept fraction in (0, 1] (None: the config's); 1.0 runs dense.
        num_inference_steps: steps of the generation (for the dense warm-up fraction).
        config: defaults (`SparseAttentionConfig()` if None).
        options: other per-request overrides of `WanSparseAttention.begin` (tile, dense_fraction, dense_layers).

    Yields the shared `SparseState` (counters tell which path ran). Raises ValueError on invalid options.
    """
    if isinstance(transformers, torch.nn.Module):
        transformers = [transformers]
    controller = None
    try:
        for transformer in transformers:
            if controller is None:
                controller = WanSparseAttention.install(transformer, config)
            else:
                controller.add(transformer)
        with controller.session(num_inference_steps=num_inference_steps, sparsity=sparsity, **options) as state:
            yield state
    finally:
        if controller is not None:
            controller.remove()
