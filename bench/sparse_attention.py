"""Dense SDPA vs block-sparse attention (video/sparse/), side by side in one run.

For growing latent grids of an 81-frame Wan clip (21 latent frames; 4k, 8k, 16k tokens on the CPU, Wan2.1's
21 x 30 x 52 = 32,760 with --gpu-sizes), with Wan's 128-dim heads:
- time of `F.scaled_dot_product_attention` vs `block_sparse_attention` (tile permutation + pooled top-k block
  selection + block-sparse attention + inverse permutation, all included) at keep 0.125, and the ratio, for each
  backend: compiled flex_attention ("flex", the CUDA default) and gathered blocks with batched GEMMs ("gather",
  the CPU default; skipped on CUDA unless asked for with --backends);
- the fitted growth exponent of each (time ~ tokens^p): dense ~2; sparse at a fixed kept *fraction* is still
  quadratic (kept blocks per row grow with length), so a fixed kept *budget* (2048 keys per query, = 0.125 at 16k)
  is timed too (default backend of the device): that one grows ~linearly;
- relative error ||sparse - dense|| / ||dense|| at keep 0.125 / 0.25 / 0.5 on attention inputs with real
  spatio-temporal structure: scikit-image's `no_time_for_that_tiny.gif` clip resampled to the latent grid,
  through a seeded random 3x3x3 conv (local features) and q/k/v projections with RMS norm and Wan's 3-D RoPE
  (diffusers' WanRotaryPosEmbed), as in a Wan self-attention layer; the same on i.i.d. noise for contrast.

First it prints the tile layout on the real Wan latent grids (Wan2.1 / Wan2.2-A14B at 480p and 720p, Wan2.2-TI2V-5B
at 480p and 720p): blocks, padding, blocks straddling two tiles (ours vs the old packed order, which cut tiles
short and packed them back to back), mean block extent, and the kept fraction at --keep (of blocks, and of real
keys). `--layout-only` prints just that (index math, a second or two).

Run: `python bench/sparse_attention.py` (CPU, 1 thread by default: the machine is shared; ratios are taken side by
side so they hold; `--clock cpu` times by the thread's CPU time where other load makes wall time useless).
`bench/sparse_attention_gpu.sh` runs it on a GPU at 32,760 tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

# --isa avx2 emulates an AVX2-only CPU: ATen's kernels, MKL and oneDNN are capped before torch is imported
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}}
if "--isa-child" in sys.argv:
    os.environ.update(ISA_ENV.get(sys.argv[sys.argv.index("--isa-child") + 1], {}))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from video.sparse import (  # noqa: E402
    block_locality,
    block_sparse_attention,
    cpu_description,
    make_block_mask,
    select_blocks,
    tile_layout,
)
from video.sparse import cpu_kernels  # noqa: E402
from video.sparse.layout import _tile_slots  # noqa: E402

CPU_GRIDS = [(21, 12, 16), (21, 18, 22), (21, 26, 30)]  # 4,032 / 8,316 / 16,380 tokens
GPU_GRIDS = [(21, 12, 16), (21, 18, 22), (21, 26, 30), (21, 30, 52)]  # + Wan2.1 480x832x81: 32,760


# (name, (height, width, frames), VAE (temporal, spatial) stride); patch 1x2x2 for all of them.
REAL_VIDEOS = [
    ("Wan2.1 / 2.2-A14B 480p", (480, 832, 81), (4, 8)),
    ("Wan2.1 / 2.2-A14B 720p", (720, 1280, 81), (4, 8)),
    ("Wan2.2-TI2V-5B 480p", (480, 832, 121), (4, 16)),
    ("Wan2.2-TI2V-5B 720p", (704, 1280, 121), (4, 16)),
]


def latent_grid(height: int, width: int, frames: int, stride: tuple[int, int]) -> tuple[int, int, int]:
    """Token grid (frames, rows, cols) of a Wan clip: VAE stride (t, s) with the first frame kept, then 1x2x2."""
    t, s = stride
    return (1 + (frames - 1) // t, height // s // 2, width // s // 2)


def packed_slots(grid, tile=(2, 8, 8)) -> torch.Tensor:
    """The old token order: frame 0 in (1, h, w) tiles, edge tiles cut short, all packed back to back and padded
    at the end (int64 [S_pad], -1 = padding). For the comparison only."""
    T, H, W = grid
    index = torch.arange(T * H * W).view(T, H, W)
    parts = [_tile_slots(index[:1], (1, tile[1], tile[2]))] + ([_tile_slots(index[1:], tile)] if T > 1 else [])
    order = torch.cat(parts)
    order = order[order >= 0]
    bs = math.prod(tile)
    return torch.cat([order, torch.full(((-order.numel()) % bs,), -1, dtype=torch.int64)])


def layout_report(keep: float, tile=(2, 8, 8)) -> None:
    """Print blocks, padding, straddling blocks (ours / old packed order), mean block extent and kept fractions
    at `keep` on each real latent grid (random pooled scores: the fractions do not depend on them much)."""
    bs = math.prod(tile)
    print(f"tile layout on the real latent grids, tile {'x'.join(map(str, tile))} ({bs}-token blocks), keep {keep}:")
    print(f"{'model, resolution':<24} {'grid':>9} {'tokens':>7} {'blocks':>6} {'pad':>6} {'straddle':>9} "
          f"{'(old)':>9} {'extent t x h x w':>17} {'kept blk':>9} {'kept keys':>9}")
    for name, (h, w, f), stride in REAL_VIDEOS:
        grid = latent_grid(h, w, f, stride)
        layout = tile_layout(grid, tile)
        ours = block_locality(layout.slots, grid, tile, bs)
        old = block_locality(packed_slots(grid, tile), grid, tile, bs)
        g = torch.Generator().manual_seed(0)
        q, k = (layout.to_tiles(torch.randn(1, 1, math.prod(grid), 8, generator=g)) for _ in range(2))
        forced = torch.arange(layout.n_blocks) < layout.first_frame_blocks
        idx, n_keep = select_blocks(q, k, bs, keep, forced, layout.valid)
        kept = make_block_mask(idx, n_keep, layout.valid, bs).to_dense()[0, 0].bool()  # [nb, nb]
        real_per_block = layout.valid.view(-1, bs).sum(-1).float()
        key_frac = float((kept.float() @ real_per_block).mean()) / math.prod(grid)
        ext = " x ".join(f"{e:.1f}" for e in ours["bbox"])
        print(f"{name:<24} {'x'.join(map(str, grid)):>9} {math.prod(grid):>7} {layout.n_blocks:>6} "
              f"{1 - ours['fill']:>6.1%} {ours['straddling']:>4}/{ours['blocks']:<4} "
              f"{old['straddling']:>4}/{old['blocks']:<4} {ext:>17} {n_keep / layout.n_blocks:>9.3f} "
              f"{key_frac:>9.3f}", flush=True)


def clip_features(grid, heads: int, head_dim: int, device, dtype, seed: int = 0):
    """q, k, v [1, heads, N, head_dim] from the real GIF clip resampled to `grid` (frames, height, width)."""
    import imageio.v3 as iio
    import skimage
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from video.sparse.processor import _apply_rotary_emb

    path = os.path.join(os.path.dirname(skimage.__file__), "data", "no_time_for_that_tiny.gif")
    frames = torch.from_numpy(np.asarray(iio.imread(path))).float() / 255.0  # [24, 25, 14, 3]
    video = frames.permute(3, 0, 1, 2)[None]  # [1, 3, T, H, W]
    video = F.interpolate(video, size=grid, mode="trilinear", align_corners=False)
    video = (video - video.mean()) / video.std()
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(64, 3, 3, 3, 3, generator=g) / math.sqrt(81)
    feats = F.gelu(F.conv3d(video, conv, padding=1))[0].flatten(1).T  # [N, 64], frame-major
    feats = F.layer_norm(feats, (64,))
    inner = heads * head_dim
    wq = torch.randn(64, inner, generator=g) / 8
    wk = wq + 0.5 * torch.randn(64, inner, generator=g) / 8  # similar content -> high q.k
    wv = torch.randn(64, inner, generator=g) / 8

    def heads_of(x):  # [N, inner] -> [1, N, heads, head_dim]
        return x.view(1, -1, heads, head_dim)

    q = heads_of(F.rms_norm(feats @ wq, (inner,)))
    k = heads_of(F.rms_norm(feats @ wk, (inner,)))
    v = heads_of(feats @ wv)
    rope = WanRotaryPosEmbed(head_dim, (1, 2, 2), 1024)(torch.zeros(1, 1, grid[0], 2 * grid[1], 2 * grid[2]))
    q, k = _apply_rotary_emb(q, *rope), _apply_rotary_emb(k, *rope)
    return [x.transpose(1, 2).contiguous().to(device, dtype) for x in (q, k, v)]


def timed(fns: dict, repeats: int, device, clock=time.perf_counter) -> dict:
    """Median seconds per call of each function in `fns`, called in turn (interleaved, so that load from other
    processes hits all alike), after one warm-up call each (which also compiles). `clock`: wall time
    (`time.perf_counter`) or this thread's CPU time (`time.thread_time`: with 1 thread on a CPU, the time the work
    itself took, without the time other processes held the core)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = {name: [] for name in fns}
    for r in range(repeats + 1):
        for name, fn in fns.items():
            sync()
            t = clock()
            fn()
            sync()
            if r:
                times[name].append(clock() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def with_kernel(kernel: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the gather backend's kernel forced to `kernel` ("flash" or "bmm")."""
    chosen = cpu_kernels.cpu_kernel
    cpu_kernels.cpu_kernel = lambda: kernel
    try:
        return fn(*args, **kwargs)
    finally:
        cpu_kernels.cpu_kernel = chosen


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, in float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def slope(xs, ys) -> float:
    """Least-squares slope of log(ys) against log(xs): the growth exponent."""
    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(lx, ly, 1)[0])


def cpu_header() -> str:
    """The CPU's model name and its SIMD/AMX flags from /proc/cpuinfo, ATen's CPU capability and the gather kernel
    chosen (`video.sparse.cpu_description`), and the ISA emulation variables where set."""
    env = " ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                     "DNNL_MAX_CPU_ISA") if k in os.environ)
    return cpu_description() + (f" (emulated: {env})" if env else "")


def kept_flops(q: torch.Tensor, k: torch.Tensor, grid, keep: float, tile=(2, 8, 8)) -> float:
    """FLOPs of the kept blocks, real tokens only: sum over heads and query blocks of 4 * rows * keys * head_dim
    (the same count as dense: 4 * N^2 * head_dim per head)."""
    layout = tile_layout(tuple(grid), tile)
    qt, kt = (layout.to_tiles(x.float()) for x in (q, k))
    forced = torch.arange(layout.n_blocks, device=q.device) < layout.first_frame_blocks
    idx, n_keep = select_blocks(qt, kt, layout.block_size, keep, forced, layout.valid.to(q.device), zero_padding=True)
    counts = layout.valid.view(-1, layout.block_size).sum(-1).to(q.device)
    keys = counts[idx[..., :n_keep].long()].sum(-1)  # [B, H, nb]
    return float((4 * q.shape[-1] * counts * keys).sum())


def run_isas(isas: list[str]) -> None:
    """Re-run this bench once per instruction set in a subprocess (the env must be set before torch loads)."""
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--isa")
    del argv[i:i + 2]
    for isa in isas:
        print(f"=== ISA {isa}{' (emulated on this CPU: same cores, caches, memory and clocks)' if isa in ISA_ENV else ''}",
              flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--isa-child", isa], check=True)



@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="wall time, or the thread's CPU time (CPU device, 1 thread: for a loaded shared machine)")
    ap.add_argument("--keep", type=float, default=0.125)
    ap.add_argument("--budget", type=int, default=2048, help="kept keys per query for the fixed-budget series")
    ap.add_argument("--gpu-sizes", action="store_true", help="add Wan2.1's 21x30x52 = 32,760 tokens")
    ap.add_argument("--backends", default=None, help="comma-separated: flex,gather (CPU default), flex (CUDA)")
    ap.add_argument("--layout-only", action="store_true", help="print the tile layout table only")
    ap.add_argument("--kernels", default=None,
                    help="gather backend kernels to time, comma-separated: flash,bmm (CPU default: both)")
    ap.add_argument("--isa", default=None, help="comma-separated: native, avx2 (emulated); each in a subprocess")
    ap.add_argument("--sizes", default=None, help="comma-separated indices into the grid list (default: all)")
    ap.add_argument("--isa-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.isa and not args.isa_child:
        run_isas(args.isa.split(","))
        return
    if not args.isa_child:
        layout_report(args.keep)
    if args.layout_only:
        return

    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (args.threads != 1 or args.device != "cpu"):
        ap.error("--clock cpu counts this thread's CPU time only: it needs --device cpu and --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    grids = GPU_GRIDS if args.gpu_sizes else CPU_GRIDS
    if args.sizes:
        grids = [grids[int(i)] for i in args.sizes.split(",")]
    backends = (args.backends or ("flex" if device.type == "cuda" else "flex,gather")).split(",")
    if args.isa_child in ISA_ENV and not args.backends:
        # compiled flex failed under the emulation here (inductor CPU kernel: index out of bounds at 4,032 tokens)
        backends = ["gather"]
    if "gather" in backends and device.type == "cpu":  # one column per gather kernel
        kernels = (args.kernels or "flash,bmm").split(",")
        i = backends.index("gather")
        backends[i:i + 1] = [f"gather-{kn}" for kn in kernels]
    default = "flex" if device.type == "cuda" else "gather"
    if device.type == "cpu":
        print(cpu_header())
    print(f"torch {torch.__version__}, device {device}, {dtype}, {args.heads} heads x {args.head_dim}, "
          f"threads {torch.get_num_threads()}, tile 2x8x8 (128-token blocks), median of {args.repeats}, "
          f"{'thread CPU time' if args.clock == 'cpu' else 'wall time'}; "
          f"ratio = dense time / sparse time; GF/s = dense FLOPs (4 N^2 d per head) / dense time, and kept FLOPs "
          f"(4 rows keys d per head and kept block, real tokens only) / sparse time")
    header = f"{'tokens':>7} {'grid':>12} {'dense ms':>9} {'GF/s':>6} {'kept':>6}"
    for b in backends:
        header += f" {b + ' ms':>15} {'ratio':>6} {'GF/s':>6}"
    print(header + f"   {'budget keep':>11} {'budget ms':>10} {'ratio':>6}")
    sizes, times, last = [], {}, None
    for grid in grids:
        n = math.prod(grid)
        q, k, v = clip_features(grid, args.heads, args.head_dim, device, dtype)
        budget_keep = min(1.0, args.budget / n)
        fns = {"dense": lambda: F.scaled_dot_product_attention(q, k, v)}
        for b in backends:
            if b.startswith("gather-"):
                fns[b] = lambda b=b: with_kernel(b[7:], block_sparse_attention, q, k, v, grid, args.keep,
                                                 backend="gather")
            else:
                fns[b] = lambda b=b: block_sparse_attention(q, k, v, grid, args.keep, backend=b)
        fns["budget"] = lambda: block_sparse_attention(q, k, v, grid, budget_keep)
        t = timed(fns, args.repeats, device, clock)
        sizes.append(n)
        for name, seconds in t.items():
            times.setdefault(name, []).append(seconds)
        dense_flops = 4.0 * n * n * args.head_dim * args.heads * q.shape[0]
        kept = kept_flops(q, k, grid, args.keep)
        line = (f"{n:>7} {'x'.join(map(str, grid)):>12} {t['dense'] * 1e3:>9.1f} {dense_flops / t['dense'] / 1e9:>6.1f}"
                f" {kept / dense_flops:>6.3f}")
        for b in backends:
            line += f" {t[b] * 1e3:>15.1f} {t['dense'] / t[b]:>5.2f}x {kept / t[b] / 1e9:>6.1f}"
        print(line + f"   {budget_keep:>11.3f} {t['budget'] * 1e3:>10.1f} {t['dense'] / t['budget']:>5.2f}x",
              flush=True)
        last = (grid, q, k, v)

    if len(sizes) > 1:
        exps = ", ".join(f"sparse keep {args.keep} {b} {slope(sizes, times[b]):.2f}" for b in backends)
        print(f"growth exponent (time ~ tokens^p): dense {slope(sizes, times['dense']):.2f}, {exps}, "
              f"sparse fixed budget {args.budget} keys ({default}) {slope(sizes, times['budget']):.2f}")

    grid, q, k, v = last
    n = math.prod(grid)
    dense = F.scaled_dot_product_attention(q, k, v)
    g = torch.Generator().manual_seed(1)
    noise = [torch.randn(q.shape, generator=g).to(device, dtype) for _ in range(3)]
    noise_dense = F.scaled_dot_product_attention(*noise)
    print(f"relative error ||sparse - dense|| / ||dense|| at {n} tokens:")
    for keep in (0.125, 0.25, 0.5):
        clip = rel_err(block_sparse_attention(q, k, v, grid, keep), dense)
        rand = rel_err(block_sparse_attention(*noise, grid, keep), noise_dense)
        print(f"  keep {keep:<5}: clip features {clip:.4f}   (i.i.d. noise inputs {rand:.4f})")


if __name__ == "__main__":
    main()
