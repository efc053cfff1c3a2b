"""The per-block attention kernels of the CPU (gather) backend, and the choice of one per instruction set.

Two kernels compute softmax attention with its log-sum-exp (so that partial results merge exactly, the blockwise
softmax of FlashAttention, Dao et al. 2022, arXiv:2205.14135): "bmm" (two BLAS GEMMs with the softmax between)
and "flash" (ATen's fused CPU flash-attention kernel). `cpu_kernel()` picks one once per process from ATen's CPU
capability; `check_kernel()` refuses any other name with the reason.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from core.cpu import cpu_flags

KERNELS = ("flash", "bmm")
CPU_FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "amx_tile", "amx_bf16", "amx_int8")

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@lru_cache(maxsize=1)
def cpu_kernel() -> str:
    """The kernel the gather backend runs its query blocks on, chosen once per process from the CPU.

    - "bmm": scores by one GEMM per query block (whole 128-row blocks: each K tile is packed once per block),
      exp2 in place of base-2 scores (`_attend_rows`; without the max subtraction when the scores are provably
      within +-64, see `_attend`), row sums, P @ V by a second GEMM and one division per output row.
    - "flash": ATen's fused CPU flash-attention kernel (what dense `F.scaled_dot_product_attention` runs), per
      query block. Below 192 query rows it tiles the rows by 32, so each of its GEMMs re-packs a 512-key tile
      of K for 32 rows only.

    Returns "bmm" where ATen's CPU capability (`torch.backends.cpu.get_cpu_capability()`, which honours
    ATEN_CPU_CAPABILITY) is AVX2 or AVX512: measured faster on both (`bench/sparse_attention.py` times both kernels
    side by side and prints the CPU's model, flags and capability; at 16,380 tokens, 1 thread, thread CPU time, AMD
    EPYC (Zen 4): 473 vs 503 ms on AVX512, 484 vs 516 ms with AVX2 emulated on the same CPU; on an Intel Xeon: 300
    vs 319 ms and 444 vs 479 ms; docs/benchmarks.md). "flash" elsewhere (not measured; the fused kernel is the
    portable choice). The shared first-frame part always runs on "flash" where the
    value head dim equals the query's (a dense [N x P] problem, its best shape; faster than "bmm" on both ISAs). Both
    kernels are exact to fp32 rounding (tests/test_sparse_attention.py, against a float64 reference).
    """
    capability = torch.backends.cpu.get_cpu_capability()
    return "bmm" if capability.startswith(("AVX2", "AVX512")) else "flash"


def check_kernel(kernel: str) -> str:
    """`kernel` if the gather backend has it; ValueError naming the supported kernels and why otherwise.

    Called before any work, so an unknown kernel fails at the start of a call rather than running another one.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unsupported CPU sparse-attention kernel {kernel!r}: the gather backend has "
                         f"{', '.join(KERNELS)} ({cpu_description()})")
    return kernel


def cpu_description() -> str:
    """One line: the CPU's model and SIMD/AMX flags (`cpu_flags`), ATen's CPU capability (which the kernel choice
    reads: it honours ATEN_CPU_CAPABILITY, so an emulated ISA is chosen for as it runs) and the chosen kernel."""
    model, flags = cpu_flags()
    shown = [f for f in CPU_FLAGS_SHOWN if f in flags]
    return (f"cpu: {model}; flags: {' '.join(shown) or 'none of avx2/avx512f/amx'}; ATen capability: "
            f"{torch.backends.cpu.get_cpu_capability()}; gather kernel chosen: {cpu_kernel()}")


# |score| <= _EXP_RANGE keeps exp(score) and sums of up to 1e10 such terms inside float32's normal range
# (e^64 = 6.2e27, e^-64 = 1.6e-28; the normal range is 1.2e-38 .. 3.4e38)
_EXP_RANGE = 64.0
# base change of `_attend_rows`: scores in log2 units (q * scale * LOG2E), exp2 of them, lse back by LN2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 scratch: torch.Tensor, total: torch.Tensor, bounded: bool) -> None:
    """The "bmm" kernel of `_attend` for one block, in 2-D and in place, in base 2: no allocation, few tensor calls.

    q [M, D] (already scaled by softmax scale * log2(e), `LOG2E`), k [L, D], v [L, Dv] float32 with a contiguous
    last dim; writes softmax(q k^T) v into out [M, Dv] and its natural-log log-sum-exp into lse [M] (both may be
    slices of larger buffers). The scores are in log2 units, so exp2 gives exp(scale * q.k) up to float rounding, a
    change of base (the FlashAttention-2 CUDA kernels' exp2 trick, Dao 2023, arXiv:2307.08691); ATen's exp2 is ~3x
    faster than its exp on CPU (0.06 vs 0.19 ms for 128 x 1,632 scores, 1 thread, AVX512; both Sleef 1-ulp). scratch
    (>= M * L floats) and total (>= M floats): contiguous float32 work space. `bounded` as in `_attend` (the bound
    is on the natural-unit scores; exp2 of the log2-unit ones reaches the same values).
    """
    M, L = q.shape[0], k.shape[0]
    s = torch.mm(q, k.t(), out=scratch[:M * L].view(M, L))
    if bounded:
        s.exp2_()
    else:
        m = s.amax(-1, keepdim=True)
        s.sub_(m).exp2_()
    t = torch.sum(s, -1, out=total[:M])
    torch.mm(s, v, out=out).div_(t[:, None])
    torch.log(t, out=lse)
    if not bounded:
        lse.add_(m[:, 0], alpha=LN2)
