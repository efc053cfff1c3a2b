"""Index construction of the gather backend: row views of strided q/k/v, token ranges of blocks, and the
pairing of query blocks that share one gathered key/value buffer.
"""

from __future__ import annotations

import torch


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
