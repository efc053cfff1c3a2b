"""Video speed levers side by side in one run: dense, block-sparse attention, each step cache, sparse + cache, and
the step-distilled (LoRA, no guidance) step count; time and speed-up vs dense at the full step count.

A. Per job on the cpu profile (in-process engine, its small random-weight Wan2.2-TI2V-style model): one
   two-clip job (latent chaining) at --size px, --steps steps with guidance (2 transformer calls a step); the
   fast row is the real quality-"fast" path: a random rank-8 LoRA fused at load, --fast-steps steps, Euler,
   guidance off.
B. Denoising steps of a real-width Wan2.1-T2V-1.3B transformer (dim 1536 = 12 heads x 128, FFN 8960, text dim
   4096; random weights, --layers of its 30 blocks) on a latent grid --grid (default 21x30x52 = 32,760 tokens:
   480x832, 81 frames, on CUDA; the CPU default is 960 tokens, see --grid): a flow-matching Euler loop of --steps
   steps, one transformer call a step (no guidance: it would double every row but the distilled one alike),
   median time per job. MagCache ratios are calibrated on this random model first
   (video.cache.calibrate_mag_ratios). Caches skip by what they see in random weights, so their speed-ups here
   show the mechanism's cost, not a quality setting.

    .venv/bin/python bench/video_speed.py          # CPU: A (8 steps), then B at 5x12x16 tokens, 2 layers, 6 steps
    .venv/bin/python bench/video_speed.py --device cuda --fast-steps 4   # B at 480p tokens, 30 layers, 50 steps
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from video.cache import calibrate_mag_ratios, step_cache
from video.config import FastProfile, StepCacheConfig

CACHES = ("mag", "first_block", "taylorseer")


def timed(fn, rounds: int) -> float:
    """Median wall time of ``fn()`` over ``rounds`` runs (s); CUDA is synchronised around each run."""
    out = []
    for _ in range(rounds):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def table(title: str, rows: list[tuple[str, float]]) -> None:
    """Print ``rows`` of (name, seconds) with the speed-up vs the first row."""
    print(title)
    print(f"  {'':34s} {'time':>10s} {'speed-up':>9s}")
    for name, t in rows:
        print(f"  {name:34s} {t * 1e3:8.1f} ms {rows[0][1] / t:8.2f}x")


def random_lora(transformer, path: Path, rank: int = 8, seed: int = 0) -> None:
    """A random diffusers/peft-format LoRA (``transformer.<module>.lora_A/B.weight``) on every attention
    projection of ``transformer``, small (|B A| ~ 1e-2 of W), written to ``path`` (safetensors)."""
    from safetensors.torch import save_file

    g, sd = torch.Generator().manual_seed(seed), {}
    for name, m in transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and ".attn1.to_" in name and not name.endswith("to_out"):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.01
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.01
    save_file(sd, str(path))


def per_job(args) -> None:
    """Part A (module doc)."""
    from services.config.profiles import load_profile
    from video.build import prepare
    from video.engine import VideoEngine
    from video.request import plan_request

    prof = load_profile("cpu")
    cfg, model_dir = prof.video.engine, prof.resolved_model_dir()
    prepare(cfg, model_dir)
    engine = VideoEngine(cfg, model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        random_lora(engine.t2v.transformer, Path(tmp) / "fast.safetensors")
        fast = FastProfile(lora=str(Path(tmp) / "fast.safetensors"), num_inference_steps=args.fast_steps)
        fast_engine = VideoEngine(cfg.model_copy(update={"fast": fast}), model_dir)
    F, fps = cfg.defaults.frames_per_clip, cfg.defaults.fps
    base = {"prompt": "a lighthouse at dusk", "size": f"{args.size}x{args.size}", "seed": 0,
            "seconds": (1 + 2 * (F - 1)) / fps, "num_inference_steps": args.steps}
    rows = [("dense", {}), ("sparse 0.125", {"sparsity": 0.125})]
    rows += [(f"cache {c}", {"cache": c}) for c in CACHES]
    rows += [(f"sparse 0.125 + {c}", {"sparsity": 0.125, "cache": c}) for c in CACHES]
    out = []
    engine.generate(plan_request(cfg, base))  # warm-up
    for name, extra in rows:
        req = plan_request(cfg, {**base, **extra})
        out.append((name, timed(lambda: engine.generate(req), args.rounds)))
    req = plan_request(fast_engine.cfg, {**base, "quality": "fast", "num_inference_steps": None})
    fast_engine.generate(req)
    out.append((f"fast: LoRA, {req.num_inference_steps} steps, no guidance",
                timed(lambda: fast_engine.generate(req), args.rounds)))
    table(f"A. cpu profile, one job: 2 chained clips of {F} frames, {args.size}x{args.size}, {args.steps} steps "
          f"with guidance, median of {args.rounds}", out)


class Loop:
    """A flow-matching Euler denoising loop around a bare ``WanTransformer3DModel`` (the ``pipe`` interface that
    :func:`video.cache.calibrate_mag_ratios` calls): latents ``(1, 16, f, 2h, 2w)``, text ``(1, 512, 4096)``."""

    def __init__(self, transformer, grid, device, dtype):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.transformer = transformer
        f, h, w = grid
        g = torch.Generator().manual_seed(0)
        self.latents = torch.randn(1, 16, f, 2 * h, 2 * w, generator=g).to(device, dtype)
        self.text = torch.randn(1, 512, 4096, generator=g).to(device, dtype)
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)

    @torch.no_grad()
    def __call__(self, num_inference_steps: int, output_type: str = "latent", **_):
        self.scheduler.set_timesteps(num_inference_steps, device=self.latents.device)
        x = self.latents.clone()
        for i, t in enumerate(self.scheduler.timesteps):
            with self.transformer.cache_context("cond", step_index=i, num_inference_steps=num_inference_steps):
                v = self.transformer(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=self.text,
                                     return_dict=False)[0]
            x = self.scheduler.step(v, t, x, return_dict=False)[0]
        return x


def step_rows(tr, grid, steps: int, fast_steps: int, rounds: int, options: StepCacheConfig | None = None,
              sparsity: float = 0.125) -> list[tuple[str, int, float]]:
    """Part B's measurement on the ``WanTransformer3DModel`` ``tr`` (any width/depth >= 2 blocks, on its own
    device and dtype) over the latent token grid ``grid`` (F, H, W): MagCache ratios calibrated on ``tr`` first
    (into a copy of ``options``, default ``StepCacheConfig()``), warm-up, then per row (name, steps, median wall
    seconds of ``rounds`` Euler loops of ``steps`` calls): dense, sparse ``sparsity``, each cache, sparse + each
    cache, and dense at ``fast_steps`` (the distilled step count). Raises ValueError as ``video.cache`` does."""
    from video.config import SparseAttentionConfig
    from video.sparse import sparse_attention

    p = next(tr.parameters())
    loop = Loop(tr, grid, p.device, p.dtype)
    options = (options or StepCacheConfig()).model_copy(deep=True)
    options.mag.mag_ratios = calibrate_mag_ratios(loop, steps)  # also the dense warm-up
    sparse_cfg = SparseAttentionConfig()

    def job(sparse=None, cache=None, n=steps):
        def run():
            with step_cache(tr, cache, options, n):
                if sparse is None:
                    loop(n)
                else:
                    with sparse_attention(tr, sparsity=sparse, num_inference_steps=n, config=sparse_cfg):
                        loop(n)
        return run

    job(sparsity, n=min(steps, 4))()  # warm-up of the sparse path (flex_attention compilation on CUDA)
    rows = [("dense", steps, job()), (f"sparse {sparsity}", steps, job(sparsity))]
    rows += [(f"cache {c}", steps, job(cache=c)) for c in CACHES]
    rows += [(f"sparse {sparsity} + {c}", steps, job(sparsity, c)) for c in CACHES]
    rows += [(f"distilled: {fast_steps} steps", fast_steps, job(n=fast_steps))]
    return [(name, n, timed(fn, rounds)) for name, n, fn in rows]


def per_step(args) -> None:
    """Part B (module doc)."""
    from diffusers import WanTransformer3DModel

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    tr = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                               out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=args.layers,
                               cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)
    tr = tr.to(device, dtype).eval()
    out = [(name, t) for name, _, t in step_rows(tr, args.grid, args.steps, args.fast_steps, args.rounds)]
    f, h, w = args.grid
    table(f"B. real-width Wan2.1-1.3B transformer, {args.layers} of 30 layers, {f}x{h}x{w} = {f * h * w:,} tokens, "
          f"{args.steps} steps (1 call each), {dtype}, {device}, median of {args.rounds}", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=128, help="part A: square size in px")
    ap.add_argument("--steps", type=int, default=None, help="full step count (default 8; part B on the CPU: 6)")
    ap.add_argument("--fast-steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--grid", default=None, help="part B latent token grid FxHxW (default 21x30x52 on CUDA, "
                                                 "5x12x16 on the CPU: 480p is ~3 min per dense layer call there)")
    ap.add_argument("--layers", type=int, default=None, help="part B transformer blocks, >= 2 (default 30 CUDA, "
                                                             "2 CPU)")
    ap.add_argument("--skip-job", action="store_true", help="part B only")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    a.grid = tuple(int(x) for x in (a.grid or ("21x30x52" if cuda else "5x12x16")).split("x"))
    a.layers = max(2, a.layers or (30 if cuda else 2))  # first_block cache needs a first and a remaining block
    if not cuda:
        torch.set_num_threads(1)
    steps = a.steps
    if not a.skip_job:
        a.steps = steps or 8
        per_job(a)
    a.steps = steps or (50 if cuda else 6)
    per_step(a)


if __name__ == "__main__":
    main()
