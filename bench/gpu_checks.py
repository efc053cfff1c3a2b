"""GPU checks behind bench/gpu_check.sh (``check``) and bench/gpu_scale.sh (``scale``); ``--dry-run`` on the CPU.

``check``: the cpu profile's models (``chimera prepare`` output) through Chimera's engines on CUDA, end to end:
one image answer (VLMEngine, transformers backend), one sparse-attention video clip (VideoEngine, flex_attention
on CUDA), one spoken sentence (TTSEngine). Minutes.

``scale``: real-size architectures, full depth, random weights (``configs/published``), bf16, on one GPU:
- Wan2.1-T2V-1.3B at 480x832x81 (21 x 30 x 52 = 32,760 tokens): one denoising step (two transformer calls, CFG)
  dense vs block-sparse at keep 0.125, and ``--video-steps`` steps end to end (+ the Wan2.1 VAE decode); then
  bench/video_speed.py's lever table on the same transformer (:func:`wan21_step_table`): ``--table-steps``-step
  Euler loops, one call a step, dense, sparse 0.125, each step cache (mag / first_block / taylorseer), sparse +
  cache, the gpu profile's distilled step count (3): loop time, time per step, speed-up vs dense;
- Orpheus 3B + SNAC 24 kHz through TTSEngine: time to first audio (TTFA) and 1/2/4 concurrent streams, each
  stream's real-time factor (audio seconds per wall second; >= 1 keeps up);
- MoonViT (27 x 1152) + projector + GLM-4-9B-0414 through VLMEngine (transformers backend): image-QA TTFT and
  decode tokens/s.
Prints one table. Random weights: the point is time and memory at the real sizes, not the output.

Time budget (estimated, not measured: no GPU has run it yet). One Wan2.1-1.3B call at 32,760 tokens is ~2.8e14
FLOPs (30 blocks: linear layers 2 x 32,760 x 41.7M weights = 0.82e14 in all, self-attention 4 x 32,760^2 x 1536
= 2.0e14 in all, cross-attention 0.03e14); at 40% of the H200's 989 TFLOP/s dense bf16 that is ~0.7 s, with a 2x
margin 1.4 s. The Wan part makes at most 56 calls (per-step rows and two 10-step CFG runs) + 2 VAE decodes, the
lever table at most 187 (MagCache calibration 20, sparse warm-up 4, 8 rows of 20, distilled 3; cached and sparse
rows compute less): 243 calls, ~3 min nominal, ~6 min with the margin, leaving ~4 min for the VAE decodes,
Orpheus and GLM-4-9B, so the run stays under 10 minutes at the default ``--table-steps 20`` (50, Wan's default
count, makes the table ~460 calls: over budget with the margin; per-step times scale to it).

``--dry-run`` (CPU, seconds, no CUDA call): imports, argument parsing, the profile and the fullsize configs,
every real-size model built on the meta device (parameter counts and shapes), the latent grid and tile layout
of the 480x832x81 clip, and the lever table's rows run once on a tiny Wan on the CPU (the gpu profile's cache
options and fast profile resolved through video/cache.py and video/lora.py; no figure printed).
Usage: ``python bench/gpu_checks.py check|scale [--dry-run]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import math
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.smoke_fullsize import fullsize_config  # noqa: E402

WAN21_480P = (480, 832, 81)


def _image_messages(side: int = 56) -> list[dict]:
    """One user turn: a ``side`` x ``side`` PNG (data URL) and a question."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 60, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe the image."}]}]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _meta_or(device: str):
    """``torch.device(device)`` as a context (meta on a dry run): modules are built directly there."""
    import torch

    return torch.device(device)


# ----------------------------------------------------------------------------------------------------- check


def run_check(dry_run: bool) -> list[tuple[str, str, str]]:
    """The cpu profile on CUDA through the three engines; rows (what, figure, note)."""
    import torch

    from services.config.profiles import load_profile

    profile = load_profile("cpu")
    model_dir = profile.resolved_model_dir()
    device = "cuda"
    vlm_cfg = profile.vlm.engine.model_copy(update={"device": device, "backend": "transformers"})
    video_cfg = profile.video.engine.model_copy(update={"device": device, "torch_threads": None})
    tts_cfg = profile.tts.engine.model_copy(update={"device": device, "backend": "transformers"})
    missing = [p for p in (vlm_cfg.llm, video_cfg.model, tts_cfg.lm) if not (model_dir / p).exists()]
    if missing:
        raise FileNotFoundError(f"run `chimera prepare --profile cpu` first: missing {missing} in {model_dir}")
    if dry_run:
        return [("cpu profile", str(model_dir), "vlm, video, tts configs valid with device cuda; models present")]
    from audio.engine import SpeechAudio, TTSEngine
    from grafting.engine import VLMEngine
    from video.engine import VideoEngine
    from video.request import VideoRequest

    rows = []
    t = time.perf_counter()
    vlm = VLMEngine.from_config(vlm_cfg, model_dir, backend="transformers")
    out = vlm.complete(_image_messages(), max_tokens=16, temperature=0.0)
    vlm.close()
    rows.append(("vlm image answer", f"{time.perf_counter() - t:.1f} s", f"{out.completion_tokens} tokens, "
                                                                          f"TTFT {out.ttft_s * 1e3:.0f} ms"))
    t = time.perf_counter()
    video = VideoEngine(video_cfg, model_dir, device=device)
    req = VideoRequest(prompt="a kite", negative_prompt="", width=128, height=128, frames_per_clip=9, num_clips=1,
                       fps=8, num_inference_steps=4, guidance_scale=5.0, seed=0, sparsity=0.5)
    frames = video.generate(req).frames
    rows.append(("video clip, sparse 0.5", f"{time.perf_counter() - t:.1f} s", f"frames {tuple(frames.shape)}"))
    t = time.perf_counter()
    tts = TTSEngine.from_config(tts_cfg, model_dir)
    n = sum(ev.audio.size for ev in tts.synthesize("Hello from the GPU.", seed=0) if isinstance(ev, SpeechAudio))
    rows.append(("tts sentence", f"{time.perf_counter() - t:.1f} s", f"{n / 24000:.2f} s of audio"))
    rows.append(("peak GPU memory", f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", ""))
    return rows


# ----------------------------------------------------------------------------------------------------- scale


def wan21_video(device: str, dry_run: bool, steps: int, keep: float, table_steps: int,
                table_rounds: int) -> list[tuple[str, str, str]]:
    """Wan2.1-1.3B at 480x832x81: per step and end to end, dense vs sparse; then :func:`wan21_step_table`."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    from video.sparse import sparse_attention, tile_layout

    h, w, f = WAN21_480P
    grid = (1 + (f - 1) // 4, h // 8 // 2, w // 8 // 2)
    layout = tile_layout(grid, (2, 8, 8))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with _meta_or(device):
        transformer = WanTransformer3DModel(**fullsize_config("wan21_t2v_1_3b_transformer")).eval()
    torch.set_default_dtype(torch.float32)
    with _meta_or(device):
        vae = AutoencoderKLWan(**fullsize_config("wan21_vae")).eval()
    params = sum(p.numel() for p in transformer.parameters())
    rows = [("Wan2.1-1.3B transformer", f"{params / 1e9:.2f}B params",
             f"grid {grid} = {math.prod(grid)} tokens, {layout.n_blocks} blocks of 128")]
    if dry_run:
        return rows + wan21_step_table(None, grid, True, table_steps, table_rounds, keep)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=5.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device).manual_seed(0)
    pe, ne = (torch.randn(1, 512, 4096, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(1, 16, grid[0], 2 * grid[1], 2 * grid[2], generator=g, device=device, dtype=torch.bfloat16)
    t_step = torch.tensor([500.0], device=device)

    @torch.no_grad()
    def one_step():
        for ctx in (pe, ne):
            transformer(x, t_step, ctx)

    def timed(fn, repeats=3):
        fn()  # warm-up (compiles flex_attention on the first sparse call)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / repeats

    dense = timed(one_step)
    with sparse_attention(transformer, sparsity=keep, num_inference_steps=None, dense_fraction=0.0):
        sparse = timed(one_step)
    rows.append(("Wan2.1 step (CFG), dense", f"{dense:.2f} s", ""))
    rows.append((f"Wan2.1 step (CFG), sparse {keep}", f"{sparse:.2f} s", f"{dense / sparse:.2f}x"))

    @torch.no_grad()
    def run(sparse_on: bool):
        ctx = (sparse_attention(transformer, sparsity=keep, num_inference_steps=steps) if sparse_on
               else nullcontext())
        with ctx:
            _sync(device)
            t0 = time.perf_counter()
            pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=h, width=w, num_frames=f,
                 num_inference_steps=steps, guidance_scale=5.0, output_type="pt",
                 generator=torch.Generator(device).manual_seed(1))
            _sync(device)
            return time.perf_counter() - t0

    e2e_dense, e2e_sparse = run(False), run(True)
    rows.append((f"Wan2.1 {steps} steps + VAE, dense", f"{e2e_dense:.1f} s", ""))
    rows.append((f"Wan2.1 {steps} steps + VAE, sparse", f"{e2e_sparse:.1f} s",
                 f"{e2e_dense / e2e_sparse:.2f}x (first 25% of steps dense)"))
    del pipe, vae
    torch.cuda.empty_cache()
    rows += wan21_step_table(transformer, grid, False, table_steps, table_rounds, keep)
    del transformer
    return rows


def wan21_step_table(transformer, grid: tuple[int, int, int], dry_run: bool, steps: int, rounds: int,
                     keep: float) -> list[tuple[str, str, str]]:
    """bench/video_speed.py's part B table (:func:`bench.video_speed.step_rows`) on ``transformer`` (the full
    30-block Wan2.1-1.3B, bf16, CUDA) at the token ``grid``: Euler loops of ``steps`` steps, one call a step (no
    CFG), dense, sparse ``keep``, each step cache with the gpu profile's cache options (MagCache ratios calibrated
    on these weights first), sparse + cache, and the gpu profile's distilled step count (``video.engine.fast``;
    a fused LoRA has the base weights' shapes, so the row is the step count's cost). Rows: loop time (the whole
    denoising loop; text encoding and VAE decode are the same for every row), time per step, speed-up vs dense.

    ``dry_run``: ``transformer`` is unused; the gpu profile's cache and fast configs are resolved (every
    diffusers cache config, the fast scheduler of ``video/lora.py``) and the same rows run once on the CPU on a
    tiny Wan (2 blocks, 2 x 16 heads, 2 x 8 x 16 tokens, 4 steps): seconds, no figure printed."""
    import torch
    from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

    from bench.video_speed import step_rows
    from services.config.profiles import load_profile
    from video.lora import fast_scheduler

    video = load_profile("gpu").video.engine
    base = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=video.flow_shift)
    fast_name = type(fast_scheduler(base, video.fast)).__name__
    n_fast = video.fast.num_inference_steps
    if dry_run:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        tiny = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64}
        transformer = WanTransformer3DModel(**(fullsize_config("wan21_t2v_1_3b_transformer") | tiny)).eval()
        grid, steps, rounds = (2, 8, 16), 4, 1
    measured = step_rows(transformer, grid, steps, n_fast, rounds, video.cache, keep)
    rows = [("Wan2.1 loop table", f"{steps} Euler steps", f"{math.prod(grid)} tokens, 1 call/step, no CFG, median "
             f"of {rounds}; distilled = gpu profile fast: {n_fast} steps, {fast_name}")]
    dense = measured[0][2]
    for name, n, t in measured:
        if dry_run:
            rows.append((f"Wan2.1 loop: {name}", "ran (tiny, CPU)", f"{n} steps"))
        else:
            rows.append((f"Wan2.1 loop: {name}", f"{t:.1f} s", f"{t / n:.2f} s/step, {dense / t:.2f}x vs dense"))
    return rows


def orpheus_tts(device: str, dry_run: bool, streams: tuple[int, ...]) -> list[tuple[str, str, str]]:
    """Orpheus 3B (full depth) + SNAC through TTSEngine: TTFA and concurrent streams."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from audio.config import TokenLayoutConfig
    from audio.engine import SpeechAudio, TTSEngine
    from audio.snac_stream import load_snac
    from services.config.profiles import load_profile

    profile = load_profile("cpu")
    model_dir = profile.resolved_model_dir()
    layout = TokenLayoutConfig()
    cfg_lm = fullsize_config("orpheus_3b") | {"eos_token_id": layout.end_of_speech, "pad_token_id": layout.pad}
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with _meta_or(device):
        lm = LlamaForCausalLM(LlamaConfig(**cfg_lm)).eval()
    torch.set_default_dtype(torch.float32)
    rows = [("Orpheus 3B LM", f"{sum(p.numel() for p in lm.parameters()) / 1e9:.2f}B params", "")]
    if dry_run:
        return rows
    cfg = profile.tts.engine.model_copy(update={"device": device, "dtype": "bfloat16", "layout": layout,
                                                "build": None, "max_frames": 96, "frames_per_char": 2.0,
                                                "backend": "transformers"})  # the in-process reference
    tok = AutoTokenizer.from_pretrained(model_dir / profile.tts.engine.lm)
    from audio.layout import TokenLayout
    from audio.local_client import TransformersSpeechClient

    client = TransformersSpeechClient(lm, TokenLayout(cfg.layout))
    engine = TTSEngine(cfg, client, tok, load_snac(model_dir / profile.tts.engine.snac, device=device))
    text = "The quick brown fox jumps over the lazy dog near the river bank."

    def stream(out: list, idx: int):
        t0, first, n = time.perf_counter(), None, 0
        for ev in engine.synthesize(text, seed=idx):
            if isinstance(ev, SpeechAudio):
                first = first or time.perf_counter() - t0
                n += ev.audio.size
        out[idx] = (first, n / 24000, time.perf_counter() - t0)

    for n_streams in streams:
        res = [None] * n_streams
        threads = [threading.Thread(target=stream, args=(res, i)) for i in range(n_streams)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        ttfa = max(r[0] or float("nan") for r in res)
        rtf = min(r[1] / r[2] for r in res)
        rows.append((f"Orpheus {n_streams} stream(s)", f"TTFA {ttfa * 1e3:.0f} ms",
                     f"worst real-time factor {rtf:.2f} ({'keeps up' if rtf >= 1 else 'falls behind'})"))
    return rows


def moonvit_glm(device: str, dry_run: bool, max_tokens: int) -> list[tuple[str, str, str]]:
    """MoonViT + projector + GLM-4-9B-0414 (full depth) through VLMEngine: image-QA TTFT and tokens/s."""
    import torch
    from transformers import AutoTokenizer, Glm4Config, Glm4ForCausalLM, Kimi_K25ImageProcessor
    from transformers import Kimi_K25VisionConfig, Kimi_K25VisionModel

    from grafting.engine import VLMEngine
    from grafting.model import GraftedVLM
    from grafting.processor import GraftProcessor, ImageLimitsView
    from grafting.projector import GraftProjector, GraftProjectorConfig
    from services.config.profiles import load_profile

    profile = load_profile("cpu")
    model_dir = profile.resolved_model_dir()
    vit, glm = fullsize_config("moonvit"), fullsize_config("glm4_9b_0414")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with _meta_or(device):
        tower = Kimi_K25VisionModel(Kimi_K25VisionConfig(**vit)).eval()
        llm = Glm4ForCausalLM(Glm4Config(**glm)).eval()
    torch.set_default_dtype(torch.float32)
    with _meta_or(device):
        projector = GraftProjector(GraftProjectorConfig(vision_hidden_size=vit["hidden_size"], merge_size=4,
                                                        llm_hidden_size=glm["hidden_size"])).eval()
    rows = [("MoonViT tower", f"{sum(p.numel() for p in tower.parameters()) / 1e6:.0f}M params", ""),
            ("GLM-4-9B-0414", f"{sum(p.numel() for p in llm.parameters()) / 1e9:.2f}B params", "")]
    if dry_run:
        return rows
    cfg = profile.vlm.engine.model_copy(update={"device": device, "dtype": "bfloat16", "backend": "transformers",
                                                "max_image_side": 448, "build": None})
    tokenizer = AutoTokenizer.from_pretrained(model_dir / cfg.llm)
    image_processor = Kimi_K25ImageProcessor.from_pretrained(
        model_dir / cfg.tower, size={"max_height": cfg.max_image_side // 14, "max_width": cfg.max_image_side // 14})
    lim = cfg.limits
    processor = GraftProcessor(
        tokenizer, image_processor, (cfg.image_tokens.start, cfg.image_tokens.image, cfg.image_tokens.end),
        ImageLimitsView(lim.max_image_bytes, lim.max_image_pixels, lim.max_images, tuple(lim.allowed_image_hosts)),
        max_prompt_tokens=cfg.max_prompt_tokens)
    from grafting.local_client import TransformersClient

    engine = VLMEngine(GraftedVLM(tower, projector, llm, processor.image_token_ids), processor, cfg,
                       TransformersClient(llm, tokenizer, cfg.max_batch_size))
    engine.complete(_image_messages(448), max_tokens=2, temperature=0.0)  # warm-up
    out = engine.complete(_image_messages(448), max_tokens=max_tokens, temperature=0.0)
    engine.close()
    tps = (out.completion_tokens - 1) / max(out.total_s - out.ttft_s, 1e-9)
    rows.append(("image QA 448x448", f"TTFT {out.ttft_s * 1e3:.0f} ms",
                 f"{tps:.1f} tokens/s over {out.completion_tokens} tokens, {out.prompt_tokens} prompt tokens"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("check", "scale"))
    ap.add_argument("--dry-run", action="store_true", help="CPU only: imports, configs, meta-device shapes")
    ap.add_argument("--video-steps", type=int, default=10, help="denoising steps of the end-to-end Wan2.1 run")
    ap.add_argument("--keep", type=float, default=0.125)
    ap.add_argument("--table-steps", type=int, default=20, help="full step count of the Wan2.1 loop table")
    ap.add_argument("--table-rounds", type=int, default=1, help="loops timed per row of that table (median)")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --dry-run to check the script on the CPU)")
        return 0
    device = "meta" if args.dry_run else "cuda"
    t0 = time.perf_counter()
    if args.mode == "check":
        rows = run_check(args.dry_run)
    else:
        rows = wan21_video(device, args.dry_run, args.video_steps, args.keep, args.table_steps,
                           args.table_rounds)
        if not args.dry_run:
            torch.cuda.empty_cache()
        rows += orpheus_tts(device, args.dry_run, tuple(int(s) for s in args.streams.split(",")))
        if not args.dry_run:
            torch.cuda.empty_cache()
        rows += moonvit_glm(device, args.dry_run, args.max_tokens)
        if not args.dry_run:
            rows.append(("peak GPU memory", f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", ""))
    name = f"gpu_{args.mode}{' --dry-run' if args.dry_run else ''}"
    print(f"{name}: {'CPU, meta device' if args.dry_run else torch.cuda.get_device_name()}, "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"{'what':<40} {'figure':>18}  note")
    for what, fig, note in rows:
        print(f"{what:<40} {fig:>18}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
