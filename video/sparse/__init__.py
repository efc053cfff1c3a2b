"""Block-sparse self-attention for the Wan transformer (diffusers `WanTransformer3DModel`): the public API.

One concern per module: `layout` (3-D tiles, one block = one tile), `select` (which key blocks each query block
keeps), `flex` (BlockMask + compiled flex_attention), `cpu_kernels` (the per-block CPU kernels and their choice per
instruction set), `plan` (index construction of the gather backend), `gather` (the gather backend), `attention`
(`block_sparse_attention`, the SDPA drop-in), `processor` (the diffusers attention processor and its shared state),
`controller` (install on a transformer, per-request sessions, `sparse_attention`).

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


from ..config import SparseAttentionConfig  # defined with the profile schema, re-exported here
from .attention import block_sparse_attention
from .controller import WanSparseAttention, sparse_attention
from .cpu_kernels import KERNELS, check_kernel, cpu_description, cpu_kernel
from .flex import make_block_mask
from .gather import compact_block_attention, gathered_block_attention
from .layout import Grid, TileLayout, block_locality, tile_ids, tile_layout
from .processor import SparseState, WanSparseAttnProcessor
from .select import pool_blocks, rank_blocks, select_blocks

__all__ = [
    "KERNELS",
    "Grid",
    "SparseAttentionConfig",
    "SparseState",
    "TileLayout",
    "WanSparseAttention",
    "WanSparseAttnProcessor",
    "block_locality",
    "block_sparse_attention",
    "check_kernel",
    "compact_block_attention",
    "cpu_description",
    "cpu_kernel",
    "gathered_block_attention",
    "make_block_mask",
    "pool_blocks",
    "rank_blocks",
    "select_blocks",
    "sparse_attention",
    "tile_ids",
    "tile_layout",
]
