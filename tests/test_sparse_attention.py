"""Block-sparse self-attention for Wan (video/sparse/): exactness, mask invariants, pipeline wiring.

Small real-architecture random-weight diffusers models (WanAttention, WanTransformer3DModel, AutoencoderKLWan);
no mocks. Both backends are checked: the gather backend (the CPU default) and flex_attention, compiled on a few
shapes (a few seconds of compile each) and eager.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from video.sparse import (
    SparseAttentionConfig,
    WanSparseAttention,
    WanSparseAttnProcessor,
    SparseState,
    block_sparse_attention,
    gathered_block_attention,
    block_locality,
    make_block_mask,
    select_blocks,
    sparse_attention,
    tile_ids,
    tile_layout,
)

torch.set_num_threads(2)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

U = 2.0**-24  # fp32 unit roundoff


def attention_tolerance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Bound on |a - b| for two fp32 evaluations of the same (masked) softmax attention in different reduction
    orders (SDPA vs blockwise flex/gather with online softmax; whatever CPU runs the suite).

    q, k: ``(B, H, N, D)``, v: ``(B, H, N, Dv)``. A length-n sum in any order has a relative rounding error of
    order sqrt(n)*u (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019). A score q.k/sqrt(D) is off by at most
    sqrt(D)*u*sum|q_i k_i|/sqrt(D) <= u*|q|*|k| (Cauchy-Schwarz); softmax turns a score error e into at most 2e of
    probability mass (its Jacobian is diag(p) - pp^T), which moves the output by 2e*max|v|; the weighted sum over
    N keys adds sqrt(N)*u*max|v|, the exponentials, rescalings and the division a few u more (4u). Both
    evaluations err, hence the factor 2. Randn inputs of these sizes give 1e-4 or so; measured differences are
    at most 7e-7."""
    qn, kn = float(q.norm(dim=-1).max()), float(k.norm(dim=-1).max())
    n = k.shape[-2]
    return 2 * (2 * U * qn * kn + math.sqrt(n) * U + 4 * U) * float(v.abs().max())


def network_tolerance(reductions: int, length: int, magnitude: float) -> float:
    """Bound on |a - b| for two fp32 evaluations of the same network in different reduction orders: ``reductions``
    sequential reductions (projections, norms, attention scores and sums), each of length <= ``length``, add
    their sqrt(n)*u relative errors in quadrature, on outputs of size ``magnitude`` (max |output|); factor 2 for
    the two evaluations (the argument of ``tests/test_chat_api.py::logprob_tolerance``)."""
    return 2 * math.sqrt(reductions * length) * U * magnitude


# --------------------------------------------------------------------------------------------- tile layout

# The real latent grids: Wan's VAE downsamples 4x in time (first frame kept: 1 + (frames - 1) / 4 latent frames)
# and 8x (Wan2.1, Wan2.2-A14B) or 16x (Wan2.2-TI2V-5B's VAE) in space; the transformer patches 1x2x2.
REAL_GRIDS = {
    "Wan2.1/2.2-A14B 480p 480x832x81": (21, 30, 52),
    "Wan2.1/2.2-A14B 720p 720x1280x81": (21, 45, 80),
    "Wan2.2-TI2V-5B 480p 480x832x121": (31, 15, 26),
    "Wan2.2-TI2V-5B 720p 704x1280x121": (31, 22, 40),
}


def latent_grid(height, width, frames, vae_stride, patch=(1, 2, 2)):
    """Token grid of a Wan clip: (1 + (frames - 1) / 4, height / s / 2, width / s / 2)."""
    t, s = vae_stride
    return (1 + (frames - 1) // t // patch[0], height // s // patch[1], width // s // patch[2])


def test_real_grids_follow_from_the_vae_strides_and_patch_size():
    assert latent_grid(480, 832, 81, (4, 8)) == REAL_GRIDS["Wan2.1/2.2-A14B 480p 480x832x81"]
    assert latent_grid(720, 1280, 81, (4, 8)) == REAL_GRIDS["Wan2.1/2.2-A14B 720p 720x1280x81"]
    assert latent_grid(480, 832, 121, (4, 16)) == REAL_GRIDS["Wan2.2-TI2V-5B 480p 480x832x121"]
    assert latent_grid(704, 1280, 121, (4, 16)) == REAL_GRIDS["Wan2.2-TI2V-5B 720p 704x1280x121"]


@pytest.mark.parametrize("grid", [(1, 1, 1), (3, 5, 7), (4, 16, 16), (6, 9, 20), *REAL_GRIDS.values()])
def test_tile_layout_round_trips_exactly_and_pads_inside_tiles(grid):
    layout = tile_layout(grid, (2, 8, 8))
    n = math.prod(grid)
    slots, valid = layout.slots, layout.valid
    assert slots.dtype == torch.int64 and slots.numel() == layout.n_blocks * 128
    assert torch.equal(torch.sort(slots[valid]).values, torch.arange(n))  # each token once
    assert torch.equal(valid, slots >= 0) and int(valid.sum()) == n
    x = torch.randn(1, 2, n, 3)
    tiled = layout.to_tiles(x)
    assert tiled.shape == (1, 2, slots.numel(), 3)
    assert torch.equal(layout.from_tiles(tiled), x)
    assert not tiled[:, :, ~valid].any()  # padding slots hold zeros
    # frame 0 fills the leading blocks, and only those
    first = layout.first_frame_blocks * 128
    assert torch.equal(torch.sort(slots[:first][valid[:first]]).values, torch.arange(grid[1] * grid[2]))
    assert layout.first_frame_blocks == -(-grid[1] // 8) * -(-grid[2] // 16)


@pytest.mark.parametrize("name", REAL_GRIDS)
def test_on_real_grids_every_block_is_one_tile(name):
    """No block straddles two tiles (the old packed order had 243 of 243 straddling after frame 0 at 21x30x52);
    every block's real tokens fill their bounding box; the block count is the tile count."""
    grid = REAL_GRIDS[name]
    T, H, W = grid
    layout = tile_layout(grid, (2, 8, 8))
    loc = block_locality(layout.slots, grid, (2, 8, 8), 128)
    assert loc["straddling"] == 0
    assert loc["bbox_volume"] == 1.0  # a block's tokens are exactly a box: a tile cut by the grid's edges
    assert layout.n_blocks == -(-H // 8) * -(-W // 16) + -(-(T - 1) // 2) * -(-H // 8) * -(-W // 8)
    # tokens of one block are in one tile, and the tile's tokens are in one block
    ids = tile_ids(grid, (2, 8, 8))
    block_of = torch.empty(math.prod(grid), dtype=torch.int64)
    block_of[layout.slots[layout.valid]] = torch.nonzero(layout.valid).squeeze(1) // 128
    assert torch.equal(block_of, ids)


@pytest.mark.parametrize("name", REAL_GRIDS)
def test_on_real_grids_keep_fraction_and_keep_all_mask(name):
    """Index math on the real grids: at keep 0.125 the kept block fraction is within half a block of 0.125 per
    row and every row keeps its diagonal and frame 0; at keep 1.0 the mask covers every real (query, key) pair
    and no padding key, so sparse attention is dense attention there (checked numerically below)."""
    grid = REAL_GRIDS[name]
    layout = tile_layout(grid, (2, 8, 8))
    nb, first = layout.n_blocks, layout.first_frame_blocks
    g = torch.Generator().manual_seed(0)
    q, k = (layout.to_tiles(torch.randn(1, 1, math.prod(grid), 4, generator=g)) for _ in range(2))
    forced = torch.arange(nb) < first
    idx, n_keep = select_blocks(q, k, 128, 0.125, forced, layout.valid)
    assert abs(n_keep / nb - 0.125) <= 0.5 / nb
    kept = torch.zeros(nb, nb, dtype=torch.bool).scatter_(-1, idx[0, 0, :, :n_keep].long(), True)
    assert kept.diagonal().all() and kept[:, :first].all() and (kept.sum(-1) == n_keep).all()
    idx, n_keep = select_blocks(q, k, 128, 1.0, forced, layout.valid)
    assert n_keep == nb
    mask = make_block_mask(idx, n_keep, layout.valid, 128)
    assert (mask.kv_num_blocks + mask.full_kv_num_blocks == nb).all()
    has_pad = ~layout.valid.view(nb, 128).all(-1)
    assert (mask.kv_num_blocks == int(has_pad.sum())).all()  # edge tiles are the partial blocks
    b = torch.zeros(1, dtype=torch.long)
    pad_slot = int(torch.nonzero(~layout.valid)[0]) if has_pad.any() else None
    if pad_slot is not None:
        assert not bool(mask.mask_mod(b, b, torch.tensor(0), torch.tensor(pad_slot)))


def test_keep_all_equals_dense_on_a_real_grid():
    """Wan2.2-TI2V-5B 480p (31 x 15 x 26 = 12,090 tokens, 24% padding slots): keep 1.0 through the gather backend
    equals SDPA within `attention_tolerance` (derived there); padding never attended to, never returned."""
    grid = REAL_GRIDS["Wan2.2-TI2V-5B 480p 480x832x121"]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 1, math.prod(grid), 8, generator=g) for _ in range(3))
    out = block_sparse_attention(q, k, v, grid, 1.0, backend="gather")
    assert out.shape == q.shape
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() <= attention_tolerance(q, k, v)


# ------------------------------------------------------------------------------------------------- block mask


def _mask_for(grid, sparsity, tile=(2, 8, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    layout = tile_layout(grid, tile)
    q, k = (layout.to_tiles(torch.randn(1, 2, math.prod(grid), 32, generator=g)) for _ in range(2))
    nb, first = layout.n_blocks, layout.first_frame_blocks
    idx, n_keep = select_blocks(q, k, layout.block_size, sparsity, torch.arange(nb) < first, layout.valid)
    dense = make_block_mask(idx, n_keep, layout.valid, layout.block_size).to_dense().bool()  # [1, 2, nb, nb]
    return dense, nb, first, n_keep


@pytest.mark.parametrize("grid", [(9, 16, 24), (6, 9, 20), (21, 12, 16)])
@pytest.mark.parametrize("sparsity", [0.125, 0.25, 0.5, 1.0])
def test_mask_keeps_diagonal_first_frame_and_requested_fraction(grid, sparsity):
    dense, nb, first, n_keep = _mask_for(grid, sparsity)
    assert dense.shape == (1, 2, nb, nb)
    assert dense.diagonal(dim1=-2, dim2=-1).all()
    assert dense[..., :first].all()
    kept = dense.sum(-1).float()  # kept key blocks per query block row
    assert (kept == n_keep).all()
    forced = first + 1
    if sparsity * nb >= forced:  # the request is reachable: within one block per row
        assert (kept - sparsity * nb).abs().max() <= 1.0
    else:  # forced blocks take priority
        assert (kept <= forced).all()


def test_padded_keys_are_masked():
    grid = (6, 9, 20)  # 1080 tokens in 22 tiles of 128 slots: padding inside edge tiles
    layout = tile_layout(grid, (2, 8, 8))
    g = torch.Generator().manual_seed(1)
    q, k = (layout.to_tiles(torch.randn(1, 1, math.prod(grid), 16, generator=g)) for _ in range(2))
    idx, n_keep = select_blocks(q, k, 128, 1.0, valid=layout.valid)
    mask = make_block_mask(idx, n_keep, layout.valid, 128)
    b = torch.zeros(1, dtype=torch.long)
    real, pad = int(torch.nonzero(layout.valid)[-1]), int(torch.nonzero(~layout.valid)[0])
    assert bool(mask.mask_mod(b, b, torch.tensor(0), torch.tensor(real)))
    assert not bool(mask.mask_mod(b, b, torch.tensor(0), torch.tensor(pad)))
    with pytest.raises(ValueError, match="padding only"):
        select_blocks(q, k, 128, 1.0, valid=torch.zeros_like(layout.valid))


BACKENDS = [("gather", True), ("flex", False),  # (backend, compiled); compiling flex takes ~20 s: slow layer
            pytest.param("flex", True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("backend,compiled", BACKENDS)
def test_sparse_attention_matches_masked_sdpa(backend, compiled):
    """Each backend computes kept blocks only; its output equals SDPA with the same mask expanded to tokens."""
    grid, tile = (6, 9, 20), (2, 8, 8)
    n, bs = math.prod(grid), 128
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g) for _ in range(3))
    out = block_sparse_attention(q, k, v, grid, 0.25, tile, compiled=compiled, backend=backend)

    layout = tile_layout(grid, tile)
    qp, kp, vp = (layout.to_tiles(x) for x in (q, k, v))
    nb, valid = layout.n_blocks, layout.valid
    idx, n_keep = select_blocks(qp, kp, bs, 0.25, torch.arange(nb) < layout.first_frame_blocks, valid)
    blocks = make_block_mask(idx, n_keep, valid, bs).to_dense().bool()
    token_mask = blocks.repeat_interleave(bs, -2).repeat_interleave(bs, -1) & valid
    ref = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=token_mask)
    tol = attention_tolerance(q, k, v)
    assert (out - layout.from_tiles(ref)).abs().max() <= tol
    dense = F.scaled_dot_product_attention(q, k, v)
    assert (out - dense).abs().max() > 10 * tol  # it did drop blocks


@pytest.mark.parametrize("backend,compiled", BACKENDS)
def test_full_keep_equals_dense_sdpa(backend, compiled):
    grid = (5, 9, 20)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, math.prod(grid), 64, generator=g) for _ in range(3))
    out = block_sparse_attention(q, k, v, grid, 1.0, compiled=compiled, backend=backend)
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() <= attention_tolerance(q, k, v)


@pytest.mark.parametrize("grid", [(6, 9, 20), (1, 9, 20), (1, 16, 16), (21, 12, 16)])
@pytest.mark.parametrize("sparsity", [0.125, 0.5])
def test_gather_backend_equals_flex_on_the_same_mask(grid, sparsity):
    """Padded last block, a single frame (every kept block is a shared first-frame block), 21 latent frames."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, math.prod(grid), 32, generator=g) for _ in range(3))
    gather = block_sparse_attention(q, k, v, grid, sparsity, backend="gather")
    flex = block_sparse_attention(q, k, v, grid, sparsity, backend="flex", compiled=False)
    assert gather.shape == q.shape and gather.dtype == q.dtype
    assert (gather - flex).abs().max() <= attention_tolerance(q, k, v)
    # bf16 inputs are computed in fp32 and rounded once at the end: against fp32 on the same (bf16-rounded)
    # inputs, which select the same blocks, the error is the fp32 bound plus bf16's unit roundoff 2^-8 relative
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    half = block_sparse_attention(q16, k16, v16, grid, sparsity, backend="gather")
    ref = block_sparse_attention(q16.float(), k16.float(), v16.float(), grid, sparsity, backend="gather")
    bound = attention_tolerance(q16.float(), k16.float(), v16.float()) + 2.0**-8 * ref.abs()
    assert half.dtype == torch.bfloat16 and ((half.float() - ref).abs() <= bound).all()


def test_gather_backend_groups_heads_and_takes_another_value_dim():
    """Value head dim 48 != query head dim 16 (the shared part then runs on "bmm"; a tiny budget cuts it into
    64-row chunks); 2 x 3 heads."""
    n, bs = 1000, 128  # 8 blocks, 24 padded positions
    nb = -(-n // bs)
    g = torch.Generator().manual_seed(5)
    q, k = (F.pad(torch.randn(2, 3, n, 16, generator=g), (0, 0, 0, nb * bs - n)) for _ in range(2))
    v = F.pad(torch.randn(2, 3, n, 48, generator=g), (0, 0, 0, nb * bs - n))
    valid = torch.arange(nb * bs) < n
    idx, n_keep = select_blocks(q, k, bs, 0.5, torch.arange(nb) < 2, valid)
    blocks = make_block_mask(idx, n_keep, valid, bs).to_dense().bool()
    token_mask = blocks.repeat_interleave(bs, -2).repeat_interleave(bs, -1)[..., :n, :n]
    ref = F.scaled_dot_product_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], attn_mask=token_mask)
    for budget in (1, 8 << 20):
        out = gathered_block_attention(q, k, v, idx, n_keep, bs, valid, shared_blocks=2, budget_bytes=budget)
        assert out.shape == (2, 3, nb * bs, 48)
        assert (out[:, :, :n] - ref).abs().max() <= attention_tolerance(q[:, :, :n], k[:, :, :n], v[:, :, :n])


def test_gather_backend_rejects_a_block_of_padding_only():
    q = torch.randn(1, 1, 512, 8)
    idx = torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4).contiguous()
    with pytest.raises(ValueError, match="padding only"):
        gathered_block_attention(q, q, q, idx, 4, 128, torch.arange(512) < 200)  # blocks 2 and 3 hold no token
    with pytest.raises(ValueError, match="multiple"):
        gathered_block_attention(q[:, :, :500], q[:, :, :500], q[:, :, :500], idx, 4, 128)


def test_gather_backend_checks_the_shared_prefix():
    q = torch.randn(1, 1, 256, 8)
    idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)  # row 0 does not start with block 0
    with pytest.raises(ValueError, match="shared"):
        gathered_block_attention(q, q, q, idx, 2, 128, shared_blocks=1)


# ------------------------------------------------------------- gather kernels against a float64 reference

KERNELS = ["flash", "bmm"]  # video.sparse.cpu_kernel() picks one per CPU; both are tested everywhere


@pytest.fixture
def kernel(request, monkeypatch):
    import video.sparse.cpu_kernels as ck

    monkeypatch.setattr(ck, "cpu_kernel", lambda: request.param)
    return request.param


def _masked_reference(q, k, v, grid, sparsity, tile=(2, 8, 8)):
    """float64 attention with the same block mask (expanded to tokens, padding excluded), frame-major."""
    layout = tile_layout(grid, tile)
    qp, kp, vp = (layout.to_tiles(x) for x in (q, k, v))
    nb, valid = layout.n_blocks, layout.valid
    idx, n_keep = select_blocks(qp, kp, layout.block_size, sparsity, torch.arange(nb) < layout.first_frame_blocks,
                                valid)
    blocks = make_block_mask(idx, n_keep, valid, layout.block_size).to_dense().bool()
    token_mask = blocks.repeat_interleave(layout.block_size, -2).repeat_interleave(layout.block_size, -1) & valid
    ref = F.scaled_dot_product_attention(qp.double(), kp.double(), vp.double(), attn_mask=token_mask)
    return layout.from_tiles(ref)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("grid,sparsity,gain", [((6, 9, 20), 0.25, 1.0), ((21, 12, 16), 0.125, 1.0),
                                                 ((6, 9, 20), 0.5, 12.0)])
def test_gather_backend_equals_a_float64_reference_on_the_same_mask(kernel, grid, sparsity, gain):
    """fp32 gather output vs float64 attention on the same mask and the same (fp32) inputs. One fp32 evaluation
    against an exact one: half of `attention_tolerance`'s two-evaluation bound (scores: u |q| |k| each; softmax
    moves the output by at most 2x the score error times max |v|; the sums over the kept keys sqrt(n) u max|v|;
    exp, the division and the log-sum-exp merge of the shared part a few u). gain 12 makes scores exceed the
    bmm kernel's +-64 range (|q| |k| / sqrt(d) up to ~900), so its max-subtracting path runs too."""
    g = torch.Generator().manual_seed(11)
    n = math.prod(grid)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g) for _ in range(3))
    q = q * gain
    from video.sparse.cpu_kernels import _EXP_RANGE, _score_bound

    assert (_score_bound(q, k, 64**-0.5) > _EXP_RANGE) == (gain > 1)
    out = block_sparse_attention(q, k, v, grid, sparsity, backend="gather")
    ref = _masked_reference(q, k, v, grid, sparsity)
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= attention_tolerance(q, k, v) / 2


def test_an_unsupported_cpu_kernel_is_refused_at_the_start_with_the_reason(monkeypatch):
    """A kernel name the gather backend lacks is a ValueError before any work, naming the supported kernels and the
    CPU (model, flags, ATen capability); it never silently runs another kernel."""
    import video.sparse.cpu_kernels as ck

    q = torch.randn(1, 1, 256, 16)
    idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"unsupported CPU sparse-attention kernel 'amx'.*flash, bmm.*ATen capability"):
        gathered_block_attention(q, q, q, idx, 2, 128, kernel="amx")
    monkeypatch.setattr(ck, "cpu_kernel", lambda: "avx1")
    with pytest.raises(ValueError, match="unsupported CPU sparse-attention kernel 'avx1'"):
        block_sparse_attention(q, q, q, (1, 16, 16), 1.0, tile=(1, 8, 8), backend="gather")


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
def test_gather_kernels_keep_all_equals_dense_and_never_read_padding(kernel):
    """keep 1.0 == dense SDPA (within the two-evaluation bound) for each kernel; padding slots hold 1e4 garbage
    in keys and values and the output is unchanged (they are never read) and zero there (never returned)."""
    grid = (5, 9, 20)  # 900 tokens in 14 tiles: padding inside edge tiles
    g = torch.Generator().manual_seed(12)
    n = math.prod(grid)
    q, k, v = (torch.randn(2, 2, n, 32, generator=g) for _ in range(3))
    out = block_sparse_attention(q, k, v, grid, 1.0, backend="gather")
    assert (out - F.scaled_dot_product_attention(q, k, v)).abs().max() <= attention_tolerance(q, k, v)

    layout = tile_layout(grid, (2, 8, 8))
    qp, kp, vp = (layout.to_tiles(x) for x in (q, k, v))
    pad = ~layout.valid
    assert pad.any()
    kp[:, :, pad], vp[:, :, pad] = 1e4, 1e4
    nb = layout.n_blocks
    idx, n_keep = select_blocks(qp, layout.to_tiles(k), 128, 0.5, torch.arange(nb) < layout.first_frame_blocks,
                                layout.valid)
    clean = gathered_block_attention(qp, layout.to_tiles(k), layout.to_tiles(v), idx, n_keep, 128, layout.valid,
                                     layout.first_frame_blocks)
    dirty = gathered_block_attention(qp, kp, vp, idx, n_keep, 128, layout.valid, layout.first_frame_blocks)
    assert torch.equal(clean, dirty)
    assert (dirty[:, :, pad] == 0).all()


# ---------------------------------------------------------------------------------------------------- processor


def _attention(cross=False):
    torch.manual_seed(0)
    return WanAttention(dim=64, heads=2, dim_head=32, eps=1e-6,
                        cross_attention_dim_head=32 if cross else None).eval()


def _rope(grid, head_dim=32):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), 1024)
    return rope(torch.zeros(1, 1, grid[0], grid[1] * 2, grid[2] * 2))


@torch.no_grad()
def test_processor_at_full_keep_equals_dense_processor():
    grid = (4, 12, 16)  # 768 tokens, 6 blocks
    attn, x = _attention(), torch.randn(1, math.prod(grid), 64)
    rope = _rope(grid)
    dense = WanAttnProcessor()(attn, x, None, None, rope)
    state = SparseState(config=SparseAttentionConfig(), sparsity=1.0, grid=grid, step=0)
    out = WanSparseAttnProcessor(state)(attn, x, None, None, rope)
    assert state.sparse_calls == 1 and state.dense_calls == 0
    # q/k/v projections and their RMS norms, scores, softmax sum, weighted sum, output projection: 8 reductions of
    # at most 768 (the keys)
    tol = network_tolerance(8, math.prod(grid), float(dense.abs().max()))
    assert (out - dense).abs().max() <= tol
    state.sparsity = 0.34
    sparse = WanSparseAttnProcessor(state)(attn, x, None, None, rope)
    assert state.sparse_calls == 2 and (sparse - dense).abs().max() > 10 * tol


@torch.no_grad()
def test_cross_attention_and_dense_layers_run_the_dense_processor_exactly():
    grid = (2, 8, 8)
    state = SparseState(config=SparseAttentionConfig(), sparsity=0.125, grid=grid, step=5,
                        dense_layers=frozenset({1}))
    cross, x, ctx = _attention(cross=True), torch.randn(1, 128, 64), torch.randn(1, 7, 64)
    assert torch.equal(WanSparseAttnProcessor(state)(cross, x, ctx), WanAttnProcessor()(cross, x, ctx))
    attn, rope = _attention(), _rope(grid)
    out = WanSparseAttnProcessor(state, layer_index=1)(attn, x, None, None, rope)
    assert torch.equal(out, WanAttnProcessor()(attn, x, None, None, rope))
    assert state.sparse_calls == 0 and state.dense_calls == 1


# ------------------------------------------------------------------------------------------ tiny Wan pipeline


@pytest.fixture(scope="module")
def tiny_pipe():
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, rope_max_seq_len=64)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe):
    g = torch.Generator().manual_seed(0)
    pe = torch.randn(1, 8, 32, generator=g)
    ne = torch.randn(1, 8, 32, generator=g)
    # 9 frames of 192x256 px -> latent 3 x 24 x 32 -> tokens 3 x 12 x 16 (patch 1x2x2). The output is the
    # denoised latent (the VAE decode after it is the same deterministic function either way).
    return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=192, width=256, num_frames=9,
                num_inference_steps=4, guidance_scale=4.0, generator=torch.Generator().manual_seed(1),
                output_type="latent").frames


@torch.no_grad()
@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_pipeline_end_to_end_full_keep_equals_dense_and_sparse_runs(tiny_pipe, backend):
    before = dict(tiny_pipe.transformer.attn_processors)
    dense = _run(tiny_pipe)
    cfg = SparseAttentionConfig(backend=backend, compile=False)
    with sparse_attention(tiny_pipe.transformer, sparsity=1.0, num_inference_steps=4, config=cfg,
                          full_is_dense=False, dense_fraction=0.0) as state:
        full = _run(tiny_pipe)
        assert state.grid == (3, 12, 16)  # 576 tokens, 5 blocks of 128
        assert state.step == 3  # 4 steps, classifier-free guidance counted once per step
        assert state.sparse_calls == 4 * 2 * 2 and state.dense_calls == 0  # steps x (cond, uncond) x layers
    # 4 steps x (cond, uncond) x (patch embedding, 2 layers x (8 self-attention + 6 cross-attention + 2 norm and
    # 2 feed-forward reductions), output projection) = 296 reductions of at most 576 (the tokens)
    assert abs(full - dense).max() <= network_tolerance(4 * 2 * (1 + 2 * 18 + 1), 576, float(abs(dense).max()))

    with sparse_attention(tiny_pipe.transformer, sparsity=0.125, num_inference_steps=4, config=cfg) as state:
        sparse = _run(tiny_pipe)
        assert state.dense_calls == 1 * 2 * 2 and state.sparse_calls == 3 * 2 * 2  # first 25% of steps dense
    assert sparse.shape == dense.shape and abs(sparse).max() < float("inf")
    assert abs(sparse - dense).max() > 0
    after = tiny_pipe.transformer.attn_processors
    assert all(type(after[n]) is type(before[n]) for n in before)  # dense processors are back


# ------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("sparsity", [0.0, -0.5, 1.5])
def test_out_of_range_sparsity_is_a_value_error(sparsity):
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1)
    with pytest.raises(ValueError):
        with sparse_attention(transformer, sparsity=sparsity, num_inference_steps=4):
            pass
    assert all(type(p) is WanAttnProcessor for p in transformer.attn_processors.values())
    with pytest.raises(ValueError):
        block_sparse_attention(*(torch.randn(1, 1, 64, 8) for _ in range(3)), (1, 8, 8), sparsity)


@torch.no_grad()
def test_backend_can_be_chosen_per_call():
    grid = (3, 8, 8)  # 192 tokens
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1).eval()
    x = torch.randn(1, 16, grid[0], 2 * grid[1], 2 * grid[2], generator=torch.Generator().manual_seed(6))
    ctx, t = torch.randn(1, 8, 32), torch.tensor([500.0])
    outs = {}
    for backend in ("gather", "flex"):
        with sparse_attention(transformer, sparsity=0.5, backend=backend, compile=False, tile=(1, 4, 4)) as state:
            outs[backend] = transformer(x, t, ctx).sample
            assert state.backend == backend and state.sparse_calls == 1 and state.grid == grid
    # patch embedding, 1 layer x 18 reductions (see the pipeline test above), output projection; 192 tokens
    tol = network_tolerance(20, 192, float(outs["flex"].abs().max()))
    assert (outs["gather"] - outs["flex"]).abs().max() <= tol
    with pytest.raises(ValueError):
        with sparse_attention(transformer, sparsity=0.5, backend="triton"):
            pass


def test_bad_grid_tile_and_backend_are_value_errors():
    q = torch.randn(1, 1, 64, 8)
    with pytest.raises(ValueError, match="does not match"):
        block_sparse_attention(q, q, q, (2, 8, 8), 0.5)
    with pytest.raises(ValueError, match="backend"):
        block_sparse_attention(q, q, q, (1, 8, 8), 0.5, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        SparseAttentionConfig(backend="triton")
    with pytest.raises(ValueError):
        tile_layout((2, 8, 8), (0, 8, 8))
    with pytest.raises(ValueError):
        SparseAttentionConfig(tile=(2, 0, 8))
    with pytest.raises(ValueError):
        WanSparseAttention(SparseState(config=SparseAttentionConfig())).begin(dense_fraction=1.5)


# ------------------------------------------------------------------------------------------------------ notebook


@pytest.mark.slow
def test_notebook_executes():
    """notebooks/sparse_attention.ipynb runs top to bottom (its cells assert keep 1.0 = dense, error falls)."""
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient

    root = Path(__file__).resolve().parents[1]
    nb = nbformat.read(root / "notebooks" / "sparse_attention.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "keep 1.0" in text and "rel. error 0.0000" in text
