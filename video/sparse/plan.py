"""Index construction of the gather backend: row views of strided q/k/v, the tile-order plan of a layout (cached
with it), token ranges of blocks, and the pairing of query blocks that share one gathered key/value buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _row_strides(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """x [B, H, N, D] (any strides) -> (x itself where its rows can be read in place, a contiguous copy otherwise;
    the strides of its B, H, N dims in rows of D elements, 0 along dims of size 1). In place means: a contiguous
    last dim and the other strides whole, non-negative multiples of D (e.g. transposed [B, N, H, D] views)."""
    D = x.shape[-1]
    strides = [s if n > 1 else 0 for s, n in zip(x.stride(), x.shape)]
    if (x.stride(-1) != 1 and D > 1) or any(s % D for s in strides[:3]) or min(strides[:3]) < 0:
        x = x.contiguous()
        strides = [s if n > 1 else 0 for s, n in zip(x.stride(), x.shape)]
    return x, tuple(s // D for s in strides[:3])


def _row_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, N, D] (any strides) -> (rows [R, D], a view of x's storage where possible (a copy otherwise),
    int64 [B * H, N]: the row of rows holding x[b, h, n]). Lets the gathers read transposed [B, N, H, D] views in
    place."""
    B, H, N, D = x.shape
    x, (sb, sh, sn) = _row_strides(x)
    dev = x.device
    index = (torch.arange(B, device=dev)[:, None, None] * sb + torch.arange(H, device=dev)[None, :, None] * sh
             + torch.arange(N, device=dev)[None, None, :] * sn).view(B * H, N)
    return x.as_strided((int(index.max()) + 1, D), (D, 1)), index


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """The rows [R, D] of `_row_view(x)` without its index (the index depends only on shape and strides)."""
    B, H, N, D = x.shape
    x, (sb, sh, sn) = _row_strides(x)
    extent = (B - 1) * sb + (H - 1) * sh + (N - 1) * sn + 1
    return x.as_strided((extent, D), (D, 1))


@dataclass
class TilePlan:
    """What the gather backend needs of a layout besides the kept blocks; depends on the layout, the shapes and
    the strides only, so it is built once and kept in the layout's cache.

    Attributes:
        counts, starts: int64 [nb] (CPU): tokens per block and their exclusive cumsum; counts_l, starts_l: the same
            as lists.
        rows: "q", "k", "v" -> int64 [B * H * N] (device of the inputs): the row of `_rows_of(x)` holding the token
            at tile position p of head bh, at index bh * N + p (the gather into tile order).
        inv: int64 [B * N * H] (device): the tile-order row of each [B, N, H] output row (`out = out_t[inv]`).
    """

    counts: torch.Tensor
    starts: torch.Tensor
    counts_l: list
    starts_l: list
    rows: dict
    inv: torch.Tensor


def _tile_plan(cache: dict | None, order: torch.Tensor, counts: torch.Tensor, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor) -> TilePlan:
    """The `TilePlan` of `order` (int64 [N], token at each tile position) and `counts` (int64 [nb]) for inputs
    of these shapes and strides ([B, H, N, D]), from `cache` (a dict owned by the layout) or built and put there.
    """
    B, H, N, _ = query.shape
    dev = query.device
    sig = (str(dev), N, B, H, tuple(counts.tolist()) if cache is None else counts.numel())
    cache_key = ("tile_plan", sig, *((tuple(x.shape), x.stride()) for x in (query, key, value)))
    if cache is not None and cache_key in cache:
        return cache[cache_key]
    counts_c = counts.cpu().to(torch.int64)
    starts_c = counts_c.cumsum(0) - counts_c
    order = order.to(device=dev, dtype=torch.int64)
    rows = {}
    for name, x in (("q", query), ("k", key), ("v", value)):
        rows[name] = _row_view(x)[1][:, order].reshape(-1)
    bh = torch.arange(B * H, device=dev)
    dest = (((bh // H)[:, None] * N + order[None, :]) * H + (bh % H)[:, None]).reshape(-1)
    inv = torch.empty_like(dest)
    inv[dest] = torch.arange(B * H * N, device=dev)
    plan = TilePlan(counts_c, starts_c, counts_c.tolist(), starts_c.tolist(), rows, inv)
    if cache is not None:
        if len(cache) > 16:
            cache.clear()
        cache[cache_key] = plan
    return plan


def _ranges(base: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """int64: arange(base[0], base[0] + lens[0]), arange(base[1], ...), ... concatenated."""
    offsets = lens.cumsum(0) - lens
    return torch.repeat_interleave(base - offsets, lens) + torch.arange(int(lens.sum()), device=base.device)


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
