"""The gather backend (the CPU default): each query block's kept key/value blocks gathered into one buffer and
attended by a `cpu_kernels` kernel, on the real tokens only; the first frame's shared blocks in one dense call.

Parts merge exactly through their log-sum-exps (FlashAttention's blockwise softmax, Dao et al. 2022,
arXiv:2205.14135; Sparse VideoGen's sink/rest split, Xi et al. 2025, arXiv:2502.01776).
"""

from __future__ import annotations

import torch

from . import cpu_kernels
from .cpu_kernels import _EXP_RANGE, _FLASH_CPU, LOG2E, _attend, _attend_rows, _score_bound
from .plan import _pair_blocks, _ranges, _rows_of, _tile_plan
from .select import _check_valid



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
    cache: dict | None = None,
) -> torch.Tensor:
    """Block-sparse attention on the real tokens only, at the rate of the fused dense kernel (the CPU backend).

    Block b holds the tokens order[starts[b] : starts[b] + counts[b]] (starts = exclusive cumsum of counts; with
    `order` None, rows starts[b] : ... of the inputs): no padding anywhere, so no mask is needed and padding costs
    nothing. Strided inputs (e.g. transposed [B, N, H, D] projections) are read where they lie: one gather of q
    (scaled in place) into tile order, by an index cached in `cache`, and the key/value buffers below gathered
    straight from the inputs' rows. Two parts, merged exactly through their log-sum-exps (out = lerp(out_var,
    out_shared, sigmoid(lse_shared - lse_var))), the idea of FlashAttention's blockwise softmax (Dao et al. 2022,
    arXiv:2205.14135) and of Sparse VideoGen's sink/rest split (arXiv:2502.01776):
    - shared: the `shared_blocks` leading key blocks every query block keeps (the first latent frame); all query
      rows of all heads attend to them in one call of the fused kernel (a dense [N x P] problem: its best tiles).
    - variable: the other kept blocks of each (head, query block). A head's query blocks are paired greedily by
      the keys their kept blocks share (neighbouring blocks keep mostly the same ones); a pair's keys and values
      are gathered once into one buffer ordered [only A's, both, only B's], so that each block's keys are one
      contiguous slice of it, and each block runs one call [rows, D] x [keys, D] on `kernel` (the second one
      reads the shared keys from cache), writing into tile-order output and log-sum-exp buffers.
    Outputs land in [B, N, H, Dv] memory order, the processor's next layout; one gather (the cached inverse
    permutation) puts them there.

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
        cache: a dict kept with `order` (`TileLayout.cache`) where the index lists that depend only on the layout,
            the shapes and the strides are kept between calls; None: built per call.

    Returns:
        [B, H, N, Dv] float32 (memory order [B, N, H, Dv]); softmax scale 1/sqrt(D).
    """
    kernel = cpu_kernels.check_kernel(kernel or cpu_kernels.cpu_kernel())
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

    # One element per (head, query block): its query rows against the keys of its variable kept blocks. q is
    # first put in tile order, one contiguous [N, D] run per head (one gather; the index is cached per layout): a
    # block's queries are then a slice and its outputs land in a slice; the key and value gathers read the inputs'
    # rows where they lie, in runs of neighbouring rows. Query blocks of a head are paired by how many variable
    # keys they share (`_pair_blocks`); a pair's keys are gathered once, ordered [only A's | both | only B's], so
    # that A's keys are the buffer's head and B's its tail, each contiguous, and B reads the shared ones from cache.
    plan = _tile_plan(cache, order, counts, query, key, value)
    var = indices[..., shared_blocks:n_keep].reshape(BH, nb, n_var).long().cpu()
    pairs, union_blocks, spans = _pair_blocks(var, plan.counts)
    ub = torch.tensor(union_blocks, dtype=torch.int64)
    ub_head = torch.tensor([p[0] for p in pairs], dtype=torch.int64).repeat_interleave(
        torch.tensor([p[3] for p in pairs], dtype=torch.int64))
    tile_rows = _ranges(ub_head * N + plan.starts[ub], plan.counts[ub]).to(dev)  # tile-order rows of the buffers
    # the buffers are gathered straight from the inputs' rows (no tile-order copy of k and v)
    k_idx, v_idx = plan.rows["k"][tile_rows], plan.rows["v"][tile_rows]
    out_t = None if kernel == "flash" and D == Dv else query.new_empty(BH * N, Dv)
    # [BH * N, D], tile order; scaled for `_attend_rows`'s base-2 scores on "bmm", for `_attend` otherwise
    qt = torch.index_select(_rows_of(query), 0, plan.rows["q"]).mul_(scale if out_t is None else scale * LOG2E)
    k_rows, v_rows = _rows_of(key), _rows_of(value)

    lse_t = query.new_empty(BH * N)
    max_keys = max(p[2] for p in pairs)
    k_buf, v_buf = query.new_empty(max_keys, D), query.new_empty(max_keys, Dv)
    scratch = None if out_t is None else query.new_empty(max(plan.counts_l) * max(s[3] for s in spans))
    starts, cnt = plan.starts_l, plan.counts_l
    outs = [] if out_t is None else None
    total = query.new_empty(max(cnt))
    k0 = 0
    for h, first, n_union, _, n_elems in pairs:
        kb = torch.index_select(k_rows, 0, k_idx[k0:k0 + n_union], out=k_buf[:n_union])
        vb = torch.index_select(v_rows, 0, v_idx[k0:k0 + n_union], out=v_buf[:n_union])
        k0 += n_union
        for e in range(first, first + n_elems):
            _, b, off, n = spans[e]
            r0 = h * N + starts[b]
            r1 = r0 + cnt[b]
            if out_t is not None:  # "bmm": in place, straight into the tile-order output and lse
                _attend_rows(qt[r0:r1], kb[off:off + n], vb[off:off + n], out_t[r0:r1], lse_t[r0:r1], scratch,
                             total, bounded)
                continue
            o, lse = _attend(qt[None, r0:r1], kb[None, off:off + n], vb[None, off:off + n], 1.0, kernel, None,
                             bounded, scratch)
            outs.append((r0, o[0]))
            lse_t[r0:r1] = lse[0]
    if out_t is None:
        out_t = query.new_empty(BH * N, Dv)
        for r0, o in outs:
            out_t[r0:r0 + o.shape[0]] = o
    # tile order -> [B, N, H] order: one gather by the cached inverse permutation
    out = out_t.index_select(0, plan.inv).view(B, N, H, Dv)
    if shared_blocks:
        lse = lse_t.index_select(0, plan.inv).view(B, N, H)
        out.lerp_(out_s.transpose(1, 2), torch.sigmoid(lse_s.transpose(1, 2) - lse)[..., None])
    return out.transpose(1, 2)


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
