"""Video engine without Ray: request validation, chaining seams, drift correction, NaN handling, LAB colour.

Uses the cpu profile's small random-weight Wan2.2-TI2V-style pipeline (loaded with ``from_pretrained``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from video.chaining import NonFiniteOutputError, chain_clips, clip_seeds
from video.drift import color_stats, lab_to_rgb, match_color, mean_luma, rgb_to_lab
from video.request import RequestError, plan_request

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cfg(profile):
    return profile.video.engine


@pytest.fixture(scope="module")
def engine(cfg, model_dir):
    from video.engine import VideoEngine

    return VideoEngine(cfg, model_dir)


@pytest.fixture(scope="module")
def photo(astronaut):
    from video.media import image_to_tensor

    return image_to_tensor(astronaut, 64, 64)


# ---- request validation ---------------------------------------------------------------------------------------
def test_plan_defaults_and_chaining(cfg):
    r = plan_request(cfg, {"prompt": "a cat"})
    assert (r.width, r.height, r.frames_per_clip, r.num_clips, r.fps) == (64, 64, 9, 1, 2)
    assert r.total_frames == 9
    r = plan_request(cfg, {"prompt": "a cat", "seconds": "12", "size": "96x64"})
    assert (r.width, r.height, r.num_clips, r.total_frames) == (96, 64, 3, 24)
    # vLLM-Omni field names, strings as multipart sends them
    r = plan_request(cfg, {"prompt": "x", "width": "32", "height": "64", "num_frames": "13", "fps": "4",
                           "seconds": "6", "drift_correction": "false", "sparsity": "0.5"})
    assert (r.width, r.height, r.frames_per_clip, r.num_clips, r.drift_correction, r.sparsity) == \
        (32, 64, 13, 2, False, 0.5)


@pytest.mark.parametrize("fields,param,needle", [
    ({"size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"size": "64x"}, "size", "WIDTHxHEIGHT"),
    ({"size": "48x64"}, "size", "multiple of 32"),
    ({"size": "1024x1024"}, "size", "limit"),
    ({"size": "64x64", "width": 32}, "size", "disagrees"),
    ({"seconds": 0}, "seconds", "greater than 0"),
    ({"seconds": "-1"}, "seconds", "greater than 0"),
    ({"seconds": 33}, "seconds", "limit"),
    ({"seconds": "abc"}, "seconds", "number"),
    ({"num_frames": 10}, "num_frames", "4k+1"),
    ({"num_frames": 1}, "num_frames", "at least 5 frames"),
    ({"num_frames": 4}, "num_frames", "at least 5 frames"),
    ({"num_frames": 0}, "num_frames", "at least 5 frames"),
    ({"num_frames": 37}, "num_frames", "limit"),
    ({"num_inference_steps": 0}, "num_inference_steps", "between"),
    ({"sparsity": 0}, "sparsity", "(0, 1]"),
    ({"sparsity": 1.5}, "sparsity", "(0, 1]"),
    ({"prompt": "x" * 2001}, "prompt", "limit"),
    ({"prompt": "   "}, "prompt", "empty"),
])
def test_plan_rejects(cfg, fields, param, needle):
    with pytest.raises(RequestError) as e:
        plan_request(cfg, {"prompt": "a cat", **fields})
    assert e.value.param == param
    assert needle in str(e.value)


@pytest.mark.parametrize("fields,code", [
    ({"size": "big"}, "invalid_size"), ({"size": "1024x1024"}, "invalid_size"),
    ({"num_frames": 10}, "invalid_frame_count"), ({"num_frames": 37}, "invalid_frame_count"),
    ({"seconds": 0}, "invalid_duration"), ({"seconds": 33}, "invalid_duration"),
    ({"prompt": "x" * 2001}, "prompt_too_long"), ({"sparsity": 0}, "invalid_value"),
    ({"seconds": "abc"}, "invalid_value"), ({"prompt": None}, "invalid_value"),
    ({"num_frames": 1}, "invalid_frame_count"), ({"num_frames": "3"}, "invalid_frame_count"),
    ({"response_format": "mp4"}, "unsupported_parameter"), ({"n": 2}, "unsupported_parameter"),
    ({"prompt": "a \ud800 cat"}, "invalid_unicode"), ({"negative_prompt": "\udfff"}, "invalid_unicode"),
])
def test_plan_errors_carry_a_stable_code_across_processes(cfg, fields, code):
    import pickle

    with pytest.raises(RequestError) as e:
        plan_request(cfg, {"prompt": "a cat", **fields})
    back = pickle.loads(pickle.dumps(e.value))  # as Ray carries it
    assert (back.code, back.param, str(back)) == (code, e.value.param, str(e.value)) and back.status_code == 400
    with pytest.raises(RequestError) as e:
        plan_request(cfg, {"size": "64x64"})
    assert (e.value.param, e.value.code) == ("prompt", "missing_required_parameter")


def test_media_errors_carry_a_stable_code():
    import pickle

    from core.media import ImageInputError, decode_image
    from video.media import MediaError, decode_video

    with pytest.raises(ImageInputError) as e:  # the one image decoder (core.media): chat's codes
        decode_image(b"not an image", 10**6, "input_reference", 1000)
    assert (e.value.status_code, e.value.code) == (415, "unsupported_image_type")
    with pytest.raises(ImageInputError) as e:
        decode_image(b"x" * 2000, 10**6, "input_reference", 1000)
    assert (e.value.status_code, e.value.code) == (413, "image_too_large")
    back = pickle.loads(pickle.dumps(e.value))
    assert (type(back), back.status_code, back.code, back.param) == (ImageInputError, 413, "image_too_large",
                                                                     "input_reference")
    with pytest.raises(MediaError) as e:
        decode_video(b"not a video")
    assert (e.value.status_code, e.value.code, e.value.param) == (415, "unsupported_media_type", "video")
    back = pickle.loads(pickle.dumps(e.value))
    assert (type(back), back.status_code, back.code, back.param) == (MediaError, 415, "unsupported_media_type",
                                                                     "video")


def test_num_frames_error_suggests_neighbours(cfg):
    with pytest.raises(RequestError, match="use 9 or 13"):
        plan_request(cfg, {"prompt": "a", "num_frames": 11})


@pytest.mark.parametrize("n", [1, 2, 3, 4, 0, -7])
def test_too_few_frames_is_not_called_a_bad_form(cfg, n):
    """``num_frames: 1`` is 4*0+1, so "not of the form 4k+1" was wrong: a clip has at least 5 frames."""
    with pytest.raises(RequestError) as e:
        plan_request(cfg, {"prompt": "a", "num_frames": n})
    assert (e.value.param, e.value.code) == ("num_frames", "invalid_frame_count")
    assert f"num_frames {n} is too few: a clip has at least 5 frames" in str(e.value)
    assert "not of the form" not in str(e.value)


def test_unknown_fields_are_refused_by_name(cfg):
    """No field is accepted and silently ignored: the first one not implemented is named."""
    for name in ("response_format", "style", "remix_video_id", "num_videos"):
        with pytest.raises(RequestError) as e:
            plan_request(cfg, {"prompt": "a", "seconds": "4", name: "x"})
        assert (e.value.param, e.value.code) == (name, "unsupported_parameter"), name
        assert name in str(e.value)


# ---- duration: the rule of video.request, against both profiles' configs (no model needed) -------------------
def _profile_cfg(name):
    from services.config.profiles import load_profile

    return load_profile(name).video.engine


# (profile, fields, expected frames T, clips N, last clip frames); the figures first
DURATIONS = [
    ("cpu", {"seconds": "5"}, 10, 2, 5),             # was 17 frames = 8.5 s
    ("cpu", {"seconds": "3.5"}, 7, 1, 9),            # was 9 frames = 4.5 s
    ("cpu", {"seconds": "4"}, 8, 1, 9),
    ("cpu", {"seconds": "8"}, 16, 2, 9),
    ("cpu", {"seconds": "12"}, 24, 3, 9),
    ("cpu", {"seconds": "32"}, 64, 8, 9),
    ("cpu", {}, 9, 1, 9),                            # no seconds: one full clip, 4.5 s
    ("cpu", {"seconds": "2", "num_frames": 13, "fps": 4}, 8, 1, 9),
    ("gpu", {"seconds": 8}, 192, 2, 73),             # was 241 frames = 10.04 s
    ("gpu", {"seconds": 3, "fps": 5}, 15, 1, 17),    # was 121 frames = 24.2 s
    ("gpu", {"seconds": "4"}, 96, 1, 97),
    ("gpu", {"seconds": 60}, 1440, 12, 121),
    ("gpu", {}, 121, 1, 121),
]


@pytest.mark.parametrize("profile_name,fields,frames,clips,last", DURATIONS)
def test_duration_is_what_was_asked(profile_name, fields, frames, clips, last):
    cfg = _profile_cfg(profile_name)
    r = plan_request(cfg, {"prompt": "a cat", **fields})
    assert (r.total_frames, r.num_clips, r.last_clip_frames) == (frames, clips, last)
    assert r.duration_s == frames / r.fps
    if "seconds" in fields:  # within half a frame of the request (exact here: seconds * fps is whole)
        assert r.duration_s == float(fields["seconds"])
    assert r.generated_frames - 4 <= r.total_frames <= r.generated_frames  # the cut drops at most 4 frames


@pytest.mark.parametrize("profile_name", ["cpu", "gpu"])
@pytest.mark.parametrize("continuation", [False, True])
def test_duration_rule_holds_on_a_grid(profile_name, continuation):
    """Every accepted (seconds, fps, num_frames) on a grid: each clip is 4k+1 frames in [5, F], the clips join
    into at least the T frames asked (at most 4 more, then cut), the fewest clips are used, and T / fps is within
    half a frame of ``seconds`` (T is a whole number of frames: |T - seconds * fps| <= 1/2; when T is raised
    to 1 for a very short request, within one frame)."""
    cfg = _profile_cfg(profile_name)
    lim, checked = cfg.limits, 0
    for fps in (1, 2, 5, 16, 24, 30, 60):
        for frames in sorted({5, 9, 17, cfg.defaults.frames_per_clip}):
            for tenth in range(1, int(lim.max_seconds * 10) + 1, 7):
                s = tenth / 10
                try:
                    r = plan_request(cfg, {"prompt": "x", "seconds": s, "fps": fps, "num_frames": frames},
                                     continuation=continuation)
                except RequestError as e:
                    assert e.code == "invalid_duration" and "clips" in str(e), (s, fps, frames, e)
                    continue
                checked += 1
                per_clip = [r.clip_frames(k) for k in range(r.num_clips)]
                assert all((f - 1) % 4 == 0 and 5 <= f <= frames for f in per_clip), per_clip
                assert per_clip[:-1] == [frames] * (r.num_clips - 1)
                assert r.total_frames <= r.generated_frames <= r.total_frames + 4
                fewer = r.generated_frames - (per_clip[-1] - 1)  # the same without the last clip
                assert r.num_clips == 1 or fewer < r.total_frames
                bound = 1 / fps if r.total_frames == 1 else 0.5 / fps
                assert abs(r.duration_s - s) <= bound + 1e-9, (s, fps, frames, r.total_frames)
    assert checked > 300  # not vacuous: 372-1148 accepted requests per case


def test_extension_seconds_are_the_added_frames(cfg):
    """An extension's clips all drop their first frame (the source's last frame): ``seconds`` 4 at 2 fps adds 8
    frames, one 9-frame clip."""
    r = plan_request(cfg, {"prompt": "on", "seconds": "4"}, continuation=True)
    assert (r.total_frames, r.num_clips, r.generated_frames, r.continuation) == (8, 1, 8, True)
    r = plan_request(cfg, {"prompt": "on", "seconds": "5"}, continuation=True)
    assert (r.total_frames, r.num_clips, r.last_clip_frames, r.generated_frames) == (10, 2, 5, 12)


def test_requests_stored_before_the_rule_keep_their_length(cfg):
    """A queued job written by the previous version (no ``target_frames``) still runs: all clips kept."""
    d = plan_request(cfg, {"prompt": "x", "seconds": "8"}).to_dict()
    for k in ("target_frames", "last_clip_frames", "continuation"):
        d.pop(k)
    from video.request import VideoRequest

    old = VideoRequest.from_dict(d)
    assert (old.total_frames, old.num_clips, old.clip_frames(1)) == (17, 2, 9)


# ---- colour ---------------------------------------------------------------------------------------------------
def test_lab_matches_skimage_and_round_trips(photo):
    from skimage.color import rgb2lab

    lab = rgb_to_lab(photo)
    ref = rgb2lab(photo.permute(1, 2, 0).numpy())
    # Bounds: skimage differs only in float rounding of the same formulas (its own constants, float64); measured
    # 1.7e-4 L*a*b* units, a 6x margin to 1e-3 (0.001 of an L* step of 100). The round trip runs in float64
    # (eps 2.2e-16); measured 8e-16, far under 1e-6.
    assert np.abs(lab.permute(1, 2, 0).numpy() - ref).max() < 1e-3
    assert (lab_to_rgb(lab) - photo).abs().max() < 1e-6


def test_match_color_restores_statistics(photo):
    clip = photo[None].repeat(3, 1, 1, 1)
    ref = color_stats(clip)
    dark = (clip * 0.8 + torch.tensor([0.0, 0.0, 0.1]).view(3, 1, 1)).clamp(0, 1)
    fixed = match_color(dark, ref)
    got = color_stats(fixed)
    # The shift/scale is exact in L*a*b*; the only loss is the clip to [0, 1] of the pixels it puts out of gamut.
    # Measured: mean off by 0.105 and std by 0.029 L*a*b* units at most (ref mean ~48/14/12, std ~29/17/18), so
    # atol 0.6 (well under a just-noticeable difference, Delta E ~ 2.3) has a >= 5x margin; mean luma off 4.6e-4.
    assert np.allclose(got.mean, ref.mean, atol=0.6) and np.allclose(got.std, ref.std, atol=0.6)
    assert abs(mean_luma(fixed) - mean_luma(clip)) < 0.005


# ---- chaining -------------------------------------------------------------------------------------------------
def test_chain_seams_and_seeds():
    seen = []

    def clip_fn(k, cond, seed):
        seen.append((k, None if cond is None else float(cond.frame.mean()), seed))
        frames = torch.full((9, 3, 8, 8), 0.1 * (k + 1))
        frames[-1] = 0.05 * (k + 1)  # last frame marks the seam
        return frames

    seeds = clip_seeds(7, 3)
    res = chain_clips(clip_fn, 3, seeds, drift_correction=False)
    assert res.frames.shape[0] == 1 + 3 * 8 and res.kept_per_clip == [9, 8, 8]
    assert len(set(seeds)) == 3 and seeds[0] == 7
    assert [s for _, _, s in seen] == seeds
    # each clip is conditioned on the float last frame of the previous one, passed in memory
    assert seen[0][1] is None and seen[1][1] == pytest.approx(0.05) and seen[2][1] == pytest.approx(0.10)
    # continuation drops clip 0's first frame too (it repeats the frame being continued)
    res = chain_clips(clip_fn, 2, seeds, first_image=torch.zeros(3, 8, 8), continuation=True,
                      drift_correction=False)
    assert res.kept_per_clip == [8, 8]


def test_chain_cut_to_total_frames():
    """``total_frames`` cuts the end of the last clip; the last frame kept is the one a later extension starts from."""
    def clip_fn(k, cond, seed):
        return torch.arange(9, dtype=torch.float32).view(9, 1, 1, 1).expand(9, 3, 2, 2) / 10 + k

    res = chain_clips(clip_fn, 2, clip_seeds(0, 2), drift_correction=False, total_frames=12)
    assert res.frames.shape[0] == 12 and res.kept_per_clip == [9, 3]
    assert float(res.frames[-1].mean()) == pytest.approx(1.3)  # clip 1, frame 3
    with pytest.raises(ValueError, match="fewer than"):
        chain_clips(clip_fn, 2, clip_seeds(0, 2), drift_correction=False, total_frames=18)


def _darker(fn):
    """The model, wrapped so that each clip comes out 5% darker than its conditioning frame."""
    def wrapped(k, cond, seed):
        out = fn(k, cond, seed)  # a Clip
        if cond is None:
            return out
        return (cond.frame[None] * 0.95).expand_as(out.frames).clone()
    return wrapped


def test_drift_correction_keeps_luma_over_four_clips(engine, cfg, photo):
    req = plan_request(cfg, {"prompt": "an astronaut", "seconds": 16, "num_inference_steps": 2, "seed": 1})
    assert req.num_clips == 4 and req.total_frames == 32

    def first_is_photo(fn):
        inner = _darker(fn)
        return lambda k, cond, seed: photo[None].repeat(9, 1, 1, 1) if k == 0 else inner(k, cond, seed)

    on = engine.generate(req, wrap=first_is_photo)
    req.drift_correction = False
    off = engine.generate(req, wrap=first_is_photo)
    first = mean_luma(on.frames[:9])
    last_on, last_off = mean_luma(on.frames[-8:]), mean_luma(off.frames[-8:])
    assert on.frames.shape == off.frames.shape == (32, 3, 64, 64)
    assert abs(last_on - first) / first < 0.02
    assert (first - last_off) / first > 0.12


# ---- the engine -----------------------------------------------------------------------------------------------
def test_text_and_image_to_video(engine, cfg, photo):
    events = []
    req = plan_request(cfg, {"prompt": "a cat", "seconds": 8, "num_inference_steps": 2, "seed": 3})
    res = engine.generate(req, on_progress=events.append)
    assert res.frames.shape == (16, 3, 64, 64) and res.frames.dtype == torch.float32  # 8 s at 2 fps
    assert 0 <= float(res.frames.min()) and float(res.frames.max()) <= 1
    assert [e.done for e in events][-1] == events[-1].total - 1 == 6  # 2 clips x (2 steps + decode); encode left
    assert {e.phase for e in events} == {"denoising", "decoding", "encoding"}
    again = engine.generate(req)
    assert torch.equal(again.frames, res.frames)  # seeded

    req = plan_request(cfg, {"prompt": "an astronaut", "num_inference_steps": 2, "seed": 3}, has_image=True)
    res = engine.generate(req, image=photo)
    assert res.frames.shape == (9, 3, 64, 64)


def test_short_last_clip_and_continuation_lengths(engine, cfg, photo):
    """5 s at 2 fps: a full clip then a 5-frame image-to-video clip, cut to 10 frames; an extension of 4 s from
    a frame adds exactly 8 frames (its first frame, the source's last, is not repeated)."""
    req = plan_request(cfg, {"prompt": "a cat", "seconds": "5", "num_inference_steps": 2, "seed": 4})
    res = engine.generate(req)
    assert res.frames.shape == (10, 3, 64, 64) and res.kept_per_clip == [9, 1]
    ext = plan_request(cfg, {"prompt": "on", "seconds": "4", "num_inference_steps": 2, "seed": 4},
                       continuation=True)
    res = engine.generate(ext, image=photo)
    assert res.frames.shape == (8, 3, 64, 64) and res.kept_per_clip == [8]


def test_sparse_attention_request(engine, cfg):
    req = plan_request(cfg, {"prompt": "a cat", "num_inference_steps": 4, "seed": 3, "size": "128x128",
                             "sparsity": 0.5})
    dense = plan_request(cfg, {"prompt": "a cat", "num_inference_steps": 4, "seed": 3, "size": "128x128"})
    eng = engine
    assert cfg.sparse_attention.sparsity == 1.0  # the cpu profile's default: dense unless a request asks
    assert cfg.sparse_attention.tile == (1, 2, 2)  # small tiles, so that the small cpu latent grids have blocks
    a, b = eng.generate(req).frames, eng.generate(dense).frames
    assert a.shape == b.shape == (9, 3, 128, 128)
    assert torch.isfinite(a).all() and not torch.equal(a, b)  # the sparse path ran

    # What ran, per call: 128x128 px, 9 frames -> latent grid 3 x 4 x 4 = 48 tokens = 12 blocks of 4; keep 0.5 ->
    # 6 blocks per row; 1 of 4 steps dense; 2 layers; guidance off: one call per step and layer.
    from video.sparse import sparse_attention

    with sparse_attention(eng.t2v.transformer, sparsity=0.5, num_inference_steps=4,
                          config=cfg.sparse_attention) as state:
        eng.t2v(prompt_embeds=eng.encode_prompt("a cat", None, 1.0)[0], height=128, width=128, num_frames=9,
                num_inference_steps=4, guidance_scale=1.0, output_type="latent")
        assert state.grid == (3, 4, 4)
        assert state.dense_calls == 1 * 2 and state.sparse_calls == 3 * 2
    # processors are dense again afterwards
    assert type(next(iter(engine.t2v.transformer.attn_processors.values()))).__name__ == "WanAttnProcessor"


def test_non_finite_output_fails_clearly(engine, cfg):
    req = plan_request(cfg, {"prompt": "a cat", "num_inference_steps": 2})
    hook = engine.t2v.transformer.register_forward_hook(lambda m, i, o: (o[0] * float("nan"),) + tuple(o[1:]))
    try:
        with pytest.raises(NonFiniteOutputError, match="non-finite"):
            engine.generate(req)
    finally:
        hook.remove()
    assert engine.generate(req).frames.isfinite().all()


def test_real_wan22_ti2v_5b_shapes_on_meta():
    """The GPU profile's Wan2.2-TI2V-5B: its published transformer/VAE configs, built on the meta device (nothing
    downloaded), have about 5B transformer params and a 16x VAE stride x 2x2 patch: sizes multiples of 32, as the
    ``ti2v`` variant validates."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    with init_empty_weights():
        tr = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128,
                                   in_channels=48, out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=14336,
                                   num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                   rope_max_seq_len=1024)
        vae = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4],
                               num_res_blocks=2, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                               scale_factor_spatial=16, scale_factor_temporal=4,
                               latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    n = sum(p.numel() for p in tr.parameters())
    assert 4.8e9 < n < 5.2e9, n
    from services.config.profiles import load_profile

    cfg = load_profile("gpu").video.engine
    assert cfg.variant == "ti2v" and cfg.size_multiple == vae.config.scale_factor_spatial * tr.config.patch_size[1]
    d = cfg.defaults
    assert d.width % cfg.size_multiple == 0 and d.height % cfg.size_multiple == 0 and (d.frames_per_clip - 1) % 4 == 0
