"""Real-size smoke run on the CPU: each real architecture at its real widths, truncated depth, random weights,
end to end through Chimera's own engines at the smallest valid input.

Families (one process each, one after another, so peak memory is one family's):
- ``vlm``: MoonViT (27 x 1152, Kimi K2.5's tower) + projector + GLM-4-9B-0414, ``VLMEngine`` (transformers
  backend): one image answer (a 56 x 56 image: 4 x 4 patches -> 4 LLM tokens after the 2x2 merge).
- ``video``: Wan2.2-TI2V-5B (transformer, UMT5-XXL text encoder, the 4x16x16 VAE at full depth), ``VideoEngine``:
  one 17-frame 256 x 256 text-to-video clip, 2 steps, block-sparse self-attention at keep 0.125 (tile 2x8x8:
  3 blocks, 2 kept per row).
- ``tts``: Orpheus 3B (Llama-3.2-3B sizes) + SNAC 24 kHz (full), ``TTSEngine``: one spoken sentence.

Sizes come from ``configs/published`` (the published config.json files, laid out like the hub repos); depth is cut
to ``--layers`` (default 1) transformer layers; the tokenizers are the cpu profile's (SmolLM2's, ids < every
real vocabulary). Weights are seeded random, written with ``save_pretrained`` to a temporary directory and loaded
by the engines with ``from_pretrained``, as real checkpoints are. Transformer weights are bfloat16 (the gpu
profile's dtype), the VAE and SNAC float32.

Run: ``make smoke-fullsize`` (or ``python bench/smoke_fullsize.py [--family vlm|video|tts]``). Prints, per
family, build and run seconds and the peak RSS of its process. Needs the cpu profile prepared (``make prepare``)
for the tokenizers. On a shared machine run it under the e2e lock (the Makefile target does).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "configs" / "published"  # the published config.json files, laid out like the hub repos
FAMILIES = ("vlm", "video", "tts")
# short name -> the published file it reads (configs/published/README.md says what each holds)
FULLSIZE = {
    "moonvit": "moonshotai/Kimi-K2.5/config.json",  # its vision_config
    "glm4_9b_0414": "THUDM/GLM-4-9B-0414/config.json",
    "umt5_xxl": "Wan-AI/Wan2.2-TI2V-5B-Diffusers/text_encoder/config.json",
    "wan22_ti2v_5b_transformer": "Wan-AI/Wan2.2-TI2V-5B-Diffusers/transformer/config.json",
    "wan22_vae": "Wan-AI/Wan2.2-TI2V-5B-Diffusers/vae/config.json",
    "wan21_t2v_1_3b_transformer": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers/transformer/config.json",
    "wan21_vae": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers/vae/config.json",
    "orpheus_3b": "canopylabs/orpheus-3b-0.1-ft/config.json",
    "snac_24khz": "hubertsiuzdak/snac_24khz/config.json",
}
_NOT_ARCHITECTURE = ("architectures", "model_type", "torch_dtype")  # file metadata, not constructor arguments


def fullsize_config(name: str) -> dict:
    """The architecture values of the published ``config.json`` that ``FULLSIZE[name]`` names under
    configs/published (MoonViT: the checkpoint's ``vision_config``), as constructor keyword arguments: metadata
    keys (``_class_name``, ``architectures``, ``model_type``, ``torch_dtype``) dropped. Raises KeyError for an
    unknown name."""
    data = json.loads((PUBLISHED / FULLSIZE[name]).read_text())
    data = data.get("vision_config", data)
    return {k: v for k, v in data.items() if not k.startswith("_") and k not in _NOT_ARCHITECTURE}


def _copy(src: Path, dst: Path, names: list[str]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (src / n).exists():
            shutil.copy(src / n, dst / n)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def smoke_vlm(work: Path, cpu_dir: Path, profile, layers: int) -> dict:
    """Build MoonViT + projector + GLM-4-9B-0414 (``layers`` layers each), answer one image question."""
    import torch
    from transformers import Glm4Config, Glm4ForCausalLM, Kimi_K25VisionConfig, Kimi_K25VisionModel

    from grafting.engine import VLMEngine
    from grafting.projector import GraftProjector, GraftProjectorConfig

    t0 = time.perf_counter()
    torch.manual_seed(0)
    vit = fullsize_config("moonvit") | {"num_hidden_layers": layers}
    Kimi_K25VisionModel(Kimi_K25VisionConfig(**vit)).eval().save_pretrained(work / "tower")
    _copy(cpu_dir / "vlm" / "tower", work / "tower", ["preprocessor_config.json"])
    glm = fullsize_config("glm4_9b_0414") | {"num_hidden_layers": layers}
    torch.set_default_dtype(torch.bfloat16)
    llm = Glm4ForCausalLM(Glm4Config(**glm)).eval()
    torch.set_default_dtype(torch.float32)
    llm.save_pretrained(work / "llm")
    params = sum(p.numel() for p in llm.parameters())
    del llm
    _copy(cpu_dir / "vlm" / "llm", work / "llm", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
    GraftProjector(GraftProjectorConfig(vision_hidden_size=vit["hidden_size"], merge_size=4,
                                        llm_hidden_size=glm["hidden_size"])).save_pretrained(work / "projector")
    cfg = profile.vlm.engine.model_copy(update={
        "tower": "tower", "llm": "llm", "projector": "projector", "dtype": "bfloat16", "device": "cpu",
        "backend": "transformers", "build": None})
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    engine = VLMEngine.from_config(cfg, work, backend="transformers")
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 60, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What colour is this?"}]}]
    out = engine.complete(messages, max_tokens=4, temperature=0.0)
    engine.close()
    return {"build_s": build_s, "run_s": time.perf_counter() - t1,
            "detail": f"GLM-4-9B {layers} layer(s), {params / 1e9:.2f}B params bf16; answer "
                      f"{out.completion_tokens} tokens, finish {out.finish_reason}"}


def smoke_video(work: Path, cpu_dir: Path, profile, layers: int) -> dict:
    """Build Wan2.2-TI2V-5B (``layers`` transformer and UMT5 layers, full VAE), one sparse-attention clip."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    from video.engine import VideoEngine
    from video.request import VideoRequest

    t0 = time.perf_counter()
    src = cpu_dir / "video" / "wan"
    tok = AutoTokenizer.from_pretrained(src / "tokenizer")
    torch.manual_seed(0)
    vae_cfg = fullsize_config("wan22_vae")
    z = vae_cfg["z_dim"]  # latents_mean/std: 0 / 1 (see the config's note; diffusers' default is Wan2.1's 16)
    vae = AutoencoderKLWan(**vae_cfg, latents_mean=[0.0] * z, latents_std=[1.0] * z).eval()
    torch.set_default_dtype(torch.bfloat16)
    te_cfg = fullsize_config("umt5_xxl") | {"num_layers": layers, "pad_token_id": tok.pad_token_id,
                                            "eos_token_id": tok.eos_token_id, "decoder_start_token_id": 0}
    text_encoder = UMT5EncoderModel(UMT5Config(**te_cfg)).eval()
    transformer = WanTransformer3DModel(**fullsize_config("wan22_ti2v_5b_transformer") | {"num_layers": layers})
    torch.set_default_dtype(torch.float32)
    scheduler = UniPCMultistepScheduler.from_pretrained(src / "scheduler")
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, transformer=transformer.eval(), vae=vae,
                       scheduler=scheduler, expand_timesteps=True)
    pipe.save_pretrained(work / "wan")
    del pipe, text_encoder, transformer, vae
    base = profile.video.engine
    cfg = base.model_copy(update={
        "model": "wan", "variant": "ti2v", "dtype": "bfloat16", "vae_dtype": "float32", "device": "cpu",
        "fast": None, "build": None,
        "sparse_attention": base.sparse_attention.model_copy(update={
            "sparsity": 0.125, "tile": (2, 8, 8), "dense_fraction": 0.0, "backend": "auto"})})
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    engine = VideoEngine(cfg, work)
    seen: list[str] = []
    attn = engine.t2v.transformer.blocks[0].attn1
    hook = attn.register_forward_pre_hook(lambda m, a: seen.append(type(m.processor).__name__))
    req = VideoRequest(prompt="a red kite over a beach", negative_prompt="", width=256, height=256,
                       frames_per_clip=17, num_clips=1, fps=8, num_inference_steps=2, guidance_scale=5.0, seed=0,
                       sparsity=0.125)
    result = engine.generate(req)
    hook.remove()
    sparse = seen.count("WanSparseAttnProcessor")
    if sparse == 0:
        raise RuntimeError(f"sparse attention did not run (processors seen: {sorted(set(seen))})")
    frames = result.frames
    return {"build_s": build_s, "run_s": time.perf_counter() - t1,
            "detail": f"Wan2.2-TI2V-5B {layers} layer(s) + UMT5-XXL {layers} layer(s) + full VAE; clip "
                      f"{tuple(frames.shape)}, sparse self-attention calls {sparse}/{len(seen)}"}


def smoke_tts(work: Path, cpu_dir: Path, profile, layers: int) -> dict:
    """Build Orpheus 3B (``layers`` layers) with the real token layout and a full SNAC 24 kHz; one sentence."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from audio.build import build_snac
    from audio.config import TokenLayoutConfig
    from audio.engine import SpeechAudio, TTSEngine
    from audio.layout import TokenLayout

    t0 = time.perf_counter()
    layout = TokenLayoutConfig()  # the real Orpheus ids (audio codes from 128266)
    orpheus = fullsize_config("orpheus_3b") | {"num_hidden_layers": layers, "eos_token_id": layout.end_of_speech,
                                               "pad_token_id": layout.pad}
    assert TokenLayout(layout).vocab_size_needed <= orpheus["vocab_size"]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    lm = LlamaForCausalLM(LlamaConfig(**orpheus)).eval()
    torch.set_default_dtype(torch.float32)
    lm.save_pretrained(work / "lm")
    params = sum(p.numel() for p in lm.parameters())
    del lm
    _copy(cpu_dir / "tts" / "lm", work / "lm", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
    build_snac(work / "snac", seed=0)
    cfg = profile.tts.engine.model_copy(update={"lm": "lm", "snac": "snac", "dtype": "bfloat16", "device": "cpu",
                                                "layout": layout, "build": None, "backend": "transformers"})
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    engine = TTSEngine.from_config(cfg, work)
    samples = sum(int(ev.audio.size) for ev in engine.synthesize("Hello there.", seed=0)
                  if isinstance(ev, SpeechAudio))
    return {"build_s": build_s, "run_s": time.perf_counter() - t1,
            "detail": f"Orpheus 3B {layers} layer(s), {params / 1e9:.2f}B params bf16 + SNAC 24 kHz; "
                      f"{samples} samples ({samples / 24000:.2f} s of audio)"}


def run_family(family: str, layers: int, threads: int) -> dict:
    """Build and run one family in this process; returns its figures (seconds, peak RSS in GiB, detail)."""
    import torch

    from services.config.profiles import load_profile

    torch.set_num_threads(threads)
    profile = load_profile("cpu")
    cpu_dir = profile.resolved_model_dir()
    fn = {"vlm": smoke_vlm, "video": smoke_video, "tts": smoke_tts}[family]
    with tempfile.TemporaryDirectory(prefix=f"chimera-fullsize-{family}-") as tmp:
        out = fn(Path(tmp), cpu_dir, profile, layers)
    return {"family": family, **out, "peak_rss_gib": _peak_rss_gib()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    ap.add_argument("--layers", type=int, default=1, help="transformer layers kept per model (default 1)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.family != "all":
        print(json.dumps(run_family(args.family, args.layers, args.threads)), flush=True)
        return 0
    print(f"real-size smoke run: real widths, {args.layers} layer(s), random weights, through the engines")
    print(f"{'family':<7} {'build s':>8} {'run s':>8} {'peak RSS GiB':>13}  detail")
    failed = []
    for family in FAMILIES:
        proc = subprocess.run([sys.executable, __file__, "--family", family, "--layers", str(args.layers),
                               "--threads", str(args.threads)], capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            failed.append(family)
            print(f"{family:<7} FAILED (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(lines[-1])
        print(f"{family:<7} {r['build_s']:>8.1f} {r['run_s']:>8.1f} {r['peak_rss_gib']:>13.2f}  {r['detail']}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
