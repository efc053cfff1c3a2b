"""Video speed options without Ray: step caches (``cache``), the step-distilled LoRA profile (``quality: "fast"``)
and latent chaining, on the cpu profile's small random-weight Wan2.2-TI2V-style pipeline.

Bounds on cached frames are not derivable from first principles (a cache replaces block outputs by a cached or
extrapolated residual); they are set from measured values on this seeded model with the margin stated.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_video_engine import cfg, engine, photo  # noqa: F401  (the module-scoped engine fixtures)
from video.chaining import Clip, chain_clips, clip_seeds
from video.drift import mean_luma
from video.request import RequestError, plan_request

torch.set_num_threads(1)


def _gpu_cfg():
    from services.config.profiles import load_profile

    return load_profile("gpu").video.engine


# ---- request fields -------------------------------------------------------------------------------------------
def test_quality_and_cache_fields(cfg):
    r = plan_request(cfg, {"prompt": "a"})
    assert (r.quality, r.cache) == ("full", None)
    for c in ("mag", "first_block", "taylorseer"):
        assert plan_request(cfg, {"prompt": "a", "cache": c}).cache == c
    for null in ("", "none", "null", None):  # multipart cannot send JSON null
        assert plan_request(cfg, {"prompt": "a", "cache": null, "quality": null}).cache is None
    # the gpu profile's fast profile: its steps and guidance are the defaults; explicit fields still win
    g = _gpu_cfg()
    r = plan_request(g, {"prompt": "a", "quality": "fast"})
    assert (r.quality, r.num_inference_steps, r.guidance_scale) == ("fast", 3, 1.0)
    r = plan_request(g, {"prompt": "a", "quality": "fast", "num_inference_steps": 6, "guidance_scale": 2})
    assert (r.num_inference_steps, r.guidance_scale) == (6, 2.0)
    assert plan_request(g, {"prompt": "a", "quality": "full"}).num_inference_steps == 40


@pytest.mark.parametrize("profile_name,fields,param,code", [
    ("cpu", {"quality": "ultra"}, "quality", "invalid_value"),
    ("cpu", {"quality": 3}, "quality", "invalid_value"),
    ("cpu", {"cache": "tea"}, "cache", "invalid_value"),
    ("cpu", {"cache": ["mag"]}, "cache", "invalid_value"),
    ("cpu", {"quality": "fast"}, "quality", "unsupported_value"),   # the cpu profile has no fast profile
    ("gpu", {"cache": "mag"}, "cache", "unsupported_value"),        # no MagCache ratios for TI2V-5B
])
def test_quality_and_cache_errors(cfg, profile_name, fields, param, code):
    import pickle

    c = cfg if profile_name == "cpu" else _gpu_cfg()
    with pytest.raises(RequestError) as e:
        plan_request(c, {"prompt": "a", **fields})
    back = pickle.loads(pickle.dumps(e.value))
    assert (back.param, back.code, back.status_code) == (param, code, 400)


# ---- step caches ----------------------------------------------------------------------------------------------
def _hooks_left(transformer) -> list[str]:
    return [n for n, m in transformer.named_modules()
            if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.hooks]


def test_no_cache_is_todays_frames_exactly(engine, cfg):
    """``cache`` null, ``quality`` full: the frames of a direct diffusers pipeline call (output "pt"), bit for bit
    (the engine now denoises to latents and decodes itself, as the pipeline does)."""
    req = plan_request(cfg, {"prompt": "a cat", "num_inference_steps": 4, "seed": 3})
    got = engine.generate(req).frames
    pe, ne = engine.encode_prompt("a cat", "", 5.0)
    ref = engine.t2v(prompt_embeds=pe, negative_prompt_embeds=ne, height=64, width=64, num_frames=9,
                     num_inference_steps=4, guidance_scale=5.0, output_type="pt",
                     generator=torch.Generator().manual_seed(3)).frames[0]
    assert torch.equal(got, ref.to(torch.float32))


@pytest.mark.parametrize("kind", ["mag", "first_block", "taylorseer"])
def test_cache_composes_with_sparse_attention_and_chaining(engine, cfg, kind):
    """Two chained clips, 8 steps, guidance on (2 transformer calls a step): the cache skips block computations
    (counted on the last block's FFN), sparse attention still changes the result under it, the difference to the
    uncached frames is bounded, and no cache state or hook outlives a clip or a job."""
    tr = engine.t2v.transformer
    calls = [0]
    h = tr.blocks[-1].ffn.register_forward_hook(lambda m, i, o: calls.__setitem__(0, calls[0] + 1))
    base = {"prompt": "a cat", "num_inference_steps": 8, "seed": 3, "seconds": 8}

    def run(**kw):
        calls[0] = 0
        res = engine.generate(plan_request(cfg, {**base, **kw}))
        return res.frames, calls[0]

    try:
        ref, n_ref = run()
        cached, n_cached = run(cache=kind)
        both, n_both = run(cache=kind, sparsity=0.5)
        sparse, _ = run(sparsity=0.5)
        other, _ = run(cache=kind, prompt="a dog", seed=9)  # another job in between
        again, n_again = run(cache=kind)
        one, n_one = run(cache=kind, seconds=None)  # a single clip
        after, _ = run()
    finally:
        h.remove()
    assert n_ref == 2 * 8 * 2 and ref.shape == (16, 3, 64, 64)
    assert n_cached < n_ref and n_both < n_ref  # blocks skipped, also under sparse attention
    if kind != "first_block":  # step-indexed schedules (first_block's depends on the data)
        assert n_both == n_cached
    assert not torch.equal(both, cached) and not torch.equal(both, sparse)  # both levers act
    # Bounds: frames in [0, 1]; measured mean |diff| vs uncached dense <= 0.0032 and max <= 0.051 over the three
    # caches (sparse 0.5 alone: 0.0032 / 0.050): 3x margins.
    for x in (cached, both):
        d = (x - ref).abs()
        assert float(d.mean()) < 0.01 and float(d.max()) < 0.15, (kind, float(d.mean()), float(d.max()))
    # per clip and per job: state reset and hooks removed, so a job repeats exactly and nothing stays installed
    assert torch.equal(again, cached) and n_again == n_cached and torch.equal(after, ref)
    assert tr._cache_config is None and _hooks_left(tr) == []
    if kind != "first_block":  # clip 2 starts its schedule afresh
        assert n_cached == 2 * n_one


def test_mag_ratios_of_the_tiny_model_are_the_profiles(engine, cfg):
    """The cpu profile's MagCache ratios are this model's calibration (configs/cpu.yaml says how they were made);
    printed to 4 decimals, so they agree within 5e-5."""
    from video.cache import calibrate_mag_ratios

    pe, ne = engine.encode_prompt("a cat", "", 5.0)
    got = calibrate_mag_ratios(engine.t2v, 20, prompt_embeds=pe, negative_prompt_embeds=ne, height=64, width=64,
                               num_frames=9, guidance_scale=5.0, generator=torch.Generator().manual_seed(0))
    assert len(got) == 20 and got[0] == 1.0
    assert max(abs(a - b) for a, b in zip(got, cfg.cache.mag.mag_ratios)) < 5e-5


# ---- the step-distilled LoRA profile --------------------------------------------------------------------------
_TARGETS = ("blocks.0.attn1.to_q", "blocks.1.attn2.to_v", "blocks.1.ffn.net.2")


def _lora(engine, path, zero: bool, rank: int = 4):
    """A diffusers/peft-format LoRA file for the tiny transformer; returns {module: B @ A}."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    sd, deltas = {}, {}
    mods = dict(engine.t2v.transformer.named_modules())
    for name in _TARGETS:
        w = mods[name].weight
        a = torch.randn(rank, w.shape[1], generator=g) * 0.1
        b = torch.zeros(w.shape[0], rank) if zero else torch.randn(w.shape[0], rank, generator=g) * 0.1
        sd[f"transformer.{name}.lora_A.weight"], sd[f"transformer.{name}.lora_B.weight"] = a, b
        deltas[name] = b @ a
    save_file(sd, str(path))
    return deltas


def _fast_engine(cfg, model_dir, lora_path, scale=1.0):
    from video.config import FastProfile
    from video.engine import VideoEngine

    # the full path's scheduler, steps and guidance, so that only the weights differ
    fast = FastProfile(lora=str(lora_path), lora_scale=scale, scheduler="unipc", flow_shift=cfg.flow_shift,
                       num_inference_steps=cfg.defaults.num_inference_steps,
                       guidance_scale=cfg.defaults.guidance_scale)
    return VideoEngine(cfg.model_copy(update={"fast": fast}), model_dir)


def test_zero_lora_is_identity(engine, cfg, model_dir, tmp_path):
    """A LoRA with B = 0 fuses into weights equal to the base ones, and quality fast gives the full frames."""
    _lora(engine, tmp_path / "zero.safetensors", zero=True)
    eng = _fast_engine(cfg, model_dir, tmp_path / "zero.safetensors")
    full, fast = eng.t2v.transformer, eng.fast_t2v.transformer
    assert fast is not full and eng.fast_i2v.transformer is fast
    fs, ws = dict(fast.named_parameters()), dict(full.named_parameters())
    assert fs.keys() == ws.keys()  # fused and unloaded: no peft layers left
    assert all(torch.equal(fs[k], ws[k]) for k in ws)
    fields = {"prompt": "a cat", "seed": 3, "seconds": 8}
    a = eng.generate(plan_request(eng.cfg, {**fields, "quality": "fast"})).frames
    b = eng.generate(plan_request(eng.cfg, fields)).frames
    assert torch.equal(a, b)


def test_known_lora_is_the_weight_delta_applied_by_hand(engine, cfg, model_dir, tmp_path):
    """``W + scale * B A`` on the three target Linear layers, nothing else changed; the fast path's frames equal
    a pipeline whose transformer copy got the delta by hand (same fp32 ops: bit for bit)."""
    deltas = _lora(engine, tmp_path / "lora.safetensors", zero=False)
    eng = _fast_engine(cfg, model_dir, tmp_path / "lora.safetensors", scale=0.5)
    full_before = {k: v.clone() for k, v in eng.t2v.transformer.state_dict().items()}
    fast = dict(eng.fast_t2v.transformer.named_parameters())
    by_hand = copy.deepcopy(eng.t2v.transformer)
    with torch.no_grad():
        for name, d in deltas.items():
            dict(by_hand.named_modules())[name].weight += 0.5 * d
    for k, v in by_hand.named_parameters():
        changed = k.removesuffix(".weight") in deltas
        # fp32: peft computes W + (B A) * scale as we do; bound 1e-6 (weights ~0.1-1, eps 1.2e-7), measured 0
        assert torch.allclose(fast[k], v, atol=1e-6, rtol=0), k
        assert changed == (not torch.equal(fast[k], full_before[k])), k

    from diffusers import WanPipeline

    ref_pipe = WanPipeline.from_pipe(eng.t2v, transformer=by_hand)
    ref_pipe.set_progress_bar_config(disable=True)
    req = plan_request(eng.cfg, {"prompt": "a cat", "seed": 3, "quality": "fast"})
    got = eng.generate(req).frames
    pe, ne = eng.encode_prompt("a cat", "", req.guidance_scale)
    ref = ref_pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=64, width=64, num_frames=9,
                   num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
                   output_type="pt", generator=torch.Generator().manual_seed(3)).frames[0].to(torch.float32)
    assert (got - ref).abs().max() < 1e-5  # fp32 forward of weights equal to 1e-6; measured 0
    full = eng.generate(plan_request(eng.cfg, {"prompt": "a cat", "seed": 3})).frames
    assert not torch.equal(full, got)  # the LoRA changed the output ...
    assert all(torch.equal(v, full_before[k]) for k, v in eng.t2v.transformer.state_dict().items())  # ... not full


# ---- latent chaining ------------------------------------------------------------------------------------------
def test_latent_chaining_hands_over_the_last_latent_frame(engine, cfg, photo):
    """Three chained clips (12 s at 2 fps = 24 frames): clip k+1's first latent frame IS clip k's last (bit for
    bit, no VAE encode: the encoder runs only for an input image), and the joined frames are clip 0's 9 then
    8 new ones per later clip, cut to 24: no repeated or lost frame at a join."""
    assert cfg.chaining == "latent"
    seen = []

    def record(fn):
        def wrapped(k, cond, seed):
            out = fn(k, cond, seed)
            seen.append((cond, out))
            return out
        return wrapped

    encodes = [0]
    h = engine.t2v.vae.encoder.register_forward_hook(lambda m, i, o: encodes.__setitem__(0, encodes[0] + 1))
    try:
        req = plan_request(cfg, {"prompt": "a cat", "seconds": 12, "num_inference_steps": 2, "seed": 1,
                                 "drift_correction": False})
        res = engine.generate(req, wrap=record)
        n_text = encodes[0]
        seen_text, seen[:] = list(seen), []
        req_img = plan_request(cfg, {"prompt": "a cat", "seconds": 8, "num_inference_steps": 2, "seed": 1},
                               has_image=True)
        engine.generate(req_img, image=photo, wrap=record)
        n_image = encodes[0] - n_text
        pixel = engine.cfg
        engine.cfg = cfg.model_copy(update={"chaining": "pixel"})
        try:
            encodes[0] = 0
            engine.generate(req)
            n_pixel = encodes[0]
        finally:
            engine.cfg = pixel
    finally:
        h.remove()
    # Wan's causal VAE encoder runs once per latent chunk: a single frame is one call
    assert (n_text, n_image, n_pixel) == (0, 1, 2)
    assert [c is None for c, _ in seen_text] == [True, False, False]
    for (_, prev), (cond, out) in zip(seen_text, seen_text[1:]):
        assert torch.equal(cond.latents, prev.latents[:, :, -1:])
        assert torch.equal(out.latents[:, :, :1], cond.latents)
        assert out.latents.shape == prev.latents.shape == (1, 48, 3, 4, 4)
    clips = [out.frames for _, out in seen_text]
    assert res.frames.shape == (24, 3, 64, 64) and res.kept_per_clip == [9, 8, 7]
    assert torch.equal(res.frames, torch.cat([clips[0], clips[1][1:], clips[2][1:]])[:24])


def _stand_in(model_gain: float, roundtrip_gain: float, photo: torch.Tensor, F: int = 9):
    """A scripted model + VAE that misbehave on purpose: the VAE is the identity on a "latent" that is the frames
    themselves ((1, 3, F, H, W)), except that ENCODING a frame scales it by ``roundtrip_gain`` (the decode -> encode
    round trip's loss); the model reproduces its conditioning content scaled by ``model_gain``. Clip 0 is the
    photo."""
    def clip_fn(k, cond, seed):
        if cond is None:
            content = photo
        elif cond.latents is not None:          # latent handover: no encode
            content = cond.latents[0, :, 0] * model_gain
        else:                                   # pixel handover: the frame is encoded again
            content = (cond.frame * roundtrip_gain).clamp(0, 1) * model_gain
        frames = content[None].expand(F, -1, -1, -1).clone()
        return Clip(frames, frames.permute(1, 0, 2, 3)[None].clone())
    return clip_fn


@pytest.mark.parametrize("model_gain,roundtrip_gain", [(1.0, 0.95), (0.95, 1.0)])
def test_latent_chaining_keeps_luma_over_five_clips(photo, model_gain, roundtrip_gain):
    """The darkening-model test over 5 clips, in both places a chain can darken: the VAE round trip of the
    conditioning frame (5% a clip) and the model itself (5% darker than its conditioning). Measured luma change of
    the last clip vs the first (1 - 0.95^4 = 18.5% when nothing counters it):

    ====================  ==========  ============  ==========  ============
    darkening in          latent on   latent off    pixel on    pixel off
    ====================  ==========  ============  ==========  ============
    VAE round trip        0.000%      0.000%        +0.073%     -18.55%
    the model             +0.079%     -18.55%       +0.073%     -18.55%
    ====================  ==========  ============  ==========  ============

    Latent chaining removes the round trip; drift correction (first clip = colour reference) stays the safety net
    against a model that drifts by itself. Bound: 2% (the issue's), measured at most 0.08%."""
    out = {}
    for latent in (True, False):
        for corr in (True, False):
            res = chain_clips(_stand_in(model_gain, roundtrip_gain, photo), 5, clip_seeds(0, 5),
                              drift_correction=corr, latent=latent)
            assert res.frames.shape[0] == 1 + 5 * 8 and res.kept_per_clip == [9, 8, 8, 8, 8]
            first, last = mean_luma(res.frames[:9]), mean_luma(res.frames[-8:])
            out[latent, corr] = (last - first) / first
    assert abs(out[True, True]) < 0.02
    if roundtrip_gain < 1:  # the round trip is gone: no drift even without correction
        assert abs(out[True, False]) < 0.02 and out[False, False] < -0.15
    else:  # the model drifts by itself: only the correction holds it
        assert out[True, False] < -0.15
    assert abs(out[False, True]) < 0.02
