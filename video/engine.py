"""The video engine: diffusers' Wan pipelines for text- and image-to-video, chained into long videos.

- ``WanPipeline`` (text-to-video) and ``WanImageToVideoPipeline`` (image-to-video) from diffusers >= 0.35
  (Wan-AI/Wan2.1, Wan-AI/Wan2.2 models). A Wan2.2-TI2V-style checkpoint (``expand_timesteps``) does both with
  one transformer: the I2V pipeline is built from the T2V one with ``from_pipe`` (shared weights).
- The prompt is encoded once per job (UMT5) and passed to every clip as ``prompt_embeds``.
- The VAE is loaded and run in ``vae_dtype`` (fp32 by default) whatever the transformer's dtype.
- Progress comes from ``callback_on_step_end``, which also stops a job early on NaN/Inf latents.
- Each clip is denoised to latents (``output_type="latent"``) and decoded here exactly as the pipeline would,
  so the clip's latents can be handed to the next clip (latent chaining, :mod:`video.chaining`; ``cfg.chaining``).
- Per request: ``quality`` (``fast``: the LoRA-fused copy of the transformer, :mod:`video.lora`), ``cache`` (a
  diffusers step cache for each clip, :mod:`video.cache`) and ``sparsity`` (:mod:`video.sparse`).
One instance is used by the service's job workers, tests, notebooks and benchmarks alike.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from diffusers import WanImageToVideoPipeline
from diffusers.utils.torch_utils import randn_tensor

from core.memory import DTYPES

from .cache import step_cache
from .chaining import ChainResult, Clip, ClipFn, Handover, NonFiniteOutputError, chain_clips, clip_seeds
from .config import VideoConfig
from .drift import ColorStats
from .request import VideoRequest



@dataclass
class Progress:
    """A progress report: ``phase`` (``denoising`` | ``decoding`` | ``encoding``), work units done/total
    (one unit per denoising step of every clip, one per clip decode, one for the MP4 encode) and clips done."""

    phase: str
    done: int
    total: int
    clips_done: int
    clips_total: int

    @property
    def percent(self) -> int:
        """Integer 0-100 (100 only when everything is done)."""
        return min(100, int(100 * self.done / max(1, self.total)))


def progress_units(req: VideoRequest) -> int:
    """Total work units of a job: ``num_clips * (steps + 1) + 1``."""
    return req.num_clips * (req.num_inference_steps + 1) + 1


class JobCancelled(RuntimeError):
    """Raised inside the denoising loop when the caller's ``should_stop()`` turns true."""


class LatentConditionedI2V(WanImageToVideoPipeline):
    """diffusers' ``WanImageToVideoPipeline`` that, while ``condition_latents`` is set, conditions on those
    latents instead of VAE-encoding ``image`` (``image`` is then only checked and resized, never encoded).

    ``condition_latents``: ``(1, C, 1, h, w)`` normalised latents (a previous clip's last latent frame). Only the
    ``expand_timesteps`` (Wan2.2-TI2V) layout conditions on one clean latent frame; others raise ValueError.
    Otherwise identical to the parent (``prepare_latents`` signature and returns as in diffusers 0.42)."""

    condition_latents: torch.Tensor | None = None

    def prepare_latents(self, image, batch_size, num_channels_latents=16, height=480, width=832, num_frames=81,
                        dtype=None, device=None, generator=None, latents=None, last_image=None):
        cond = self.condition_latents
        if cond is None:
            return super().prepare_latents(image, batch_size, num_channels_latents, height, width, num_frames,
                                           dtype, device, generator, latents, last_image)
        if not self.config.expand_timesteps:
            raise ValueError("latent conditioning needs the expand_timesteps (TI2V) layout")
        f = (num_frames - 1) // self.vae_scale_factor_temporal + 1
        h, w = height // self.vae_scale_factor_spatial, width // self.vae_scale_factor_spatial
        if tuple(cond.shape[1:]) != (num_channels_latents, 1, h, w):
            raise ValueError(f"condition latents {tuple(cond.shape)} do not fit a {num_frames}x{height}x{width} clip")
        if latents is None:
            latents = randn_tensor((batch_size, num_channels_latents, f, h, w), generator=generator, device=device,
                                   dtype=dtype)
        mask = torch.ones(1, 1, f, h, w, dtype=dtype, device=device)
        mask[:, :, 0] = 0
        return latents.to(device=device, dtype=dtype), cond.to(device=device, dtype=dtype).repeat(
            batch_size, 1, 1, 1, 1), mask


class VideoEngine:
    """Wan text/image-to-video with clip chaining and drift correction.

    ``cfg``: the profile's video engine config; ``model_dir``: where relative model paths live.
    ``device``: overrides ``cfg.device`` (job workers pass ``cuda`` when Ray gave them a GPU).
    Raises OSError/ValueError from ``from_pretrained`` when the checkpoint is missing or malformed.
    """

    def __init__(self, cfg: VideoConfig, model_dir: str | Path, device: str | None = None):
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

        self.cfg = cfg
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = torch.device(device or cfg.device)
        dtype, vae_dtype = DTYPES[cfg.dtype], DTYPES[cfg.vae_dtype]
        path = cfg.resolve(model_dir, cfg.model)
        vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", dtype=vae_dtype)
        self.t2v = WanPipeline.from_pretrained(path, vae=vae, dtype=dtype)
        self.t2v.scheduler = UniPCMultistepScheduler.from_config(self.t2v.scheduler.config, flow_shift=cfg.flow_shift)
        if self.device.type != "cpu":
            self.t2v.to(self.device)
        self.t2v.set_progress_bar_config(disable=True)
        self.i2v = None
        if cfg.variant == "ti2v":
            self.i2v = LatentConditionedI2V.from_pipe(self.t2v)
        elif cfg.i2v_model:
            self.i2v = LatentConditionedI2V.from_pretrained(
                cfg.resolve(model_dir, cfg.i2v_model), vae=self.t2v.vae, text_encoder=self.t2v.text_encoder,
                tokenizer=self.t2v.tokenizer, dtype=dtype).to(self.device)
            self.i2v.scheduler = UniPCMultistepScheduler.from_config(self.i2v.scheduler.config,
                                                                     flow_shift=cfg.flow_shift)
        if self.i2v is not None:
            self.i2v.set_progress_bar_config(disable=True)
        self.fast_t2v = self.fast_i2v = None
        if cfg.fast is not None:  # loaded and fused once, here; requests only pick the pipeline
            from .lora import fused_fast_pipeline

            self.fast_t2v = fused_fast_pipeline(self.t2v, cfg.fast, cfg.resolve(model_dir, cfg.fast.lora))
            if cfg.variant == "ti2v":
                self.fast_i2v = LatentConditionedI2V.from_pipe(self.fast_t2v)
                self.fast_i2v.set_progress_bar_config(disable=True)
        self.size_multiple = self.t2v.vae_scale_factor_spatial * self.t2v.transformer.config.patch_size[1]

    @torch.no_grad()
    def encode_prompt(self, prompt: str, negative_prompt: str, guidance_scale: float):
        """UMT5 embeddings ``(1, max_sequence_length, text_dim)`` of the prompt and negative prompt
        (the latter None when ``guidance_scale <= 1``: classifier-free guidance off)."""
        pe, ne = self.t2v.encode_prompt(prompt, negative_prompt=negative_prompt,
                                        do_classifier_free_guidance=guidance_scale > 1.0,
                                        max_sequence_length=self.cfg.max_sequence_length, device=self.device)
        return pe, ne

    def pipelines(self, quality: str = "full"):
        """``(text-to-video, image-to-video or None)`` pipelines of ``quality`` (``full`` | ``fast``).
        Raises ValueError when ``fast`` is asked of an engine without a fast profile."""
        if quality == "fast":
            if self.fast_t2v is None:
                raise ValueError("this engine has no fast (step-distilled) profile")
            return self.fast_t2v, self.fast_i2v
        return self.t2v, self.i2v

    def transformers(self, quality: str = "full") -> list[torch.nn.Module]:
        """The distinct transformers the pipelines of ``quality`` run."""
        t2v, i2v = self.pipelines(quality)
        out = [t2v.transformer]
        if i2v is not None and i2v.transformer is not t2v.transformer:
            out.append(i2v.transformer)
        return out

    @contextlib.contextmanager
    def attention(self, sparsity: float, num_inference_steps: int, quality: str = "full"):
        """Block-sparse self-attention (:mod:`video.sparse`) keeping ``sparsity`` of the key blocks
        for one clip (its dense warm-up counts that clip's steps) on the transformers of ``quality``; 1.0: dense,
        nothing installed. Raises ValueError on an out-of-range option."""
        if sparsity >= 1.0:
            yield
            return
        from .sparse import sparse_attention

        with sparse_attention(self.transformers(quality), sparsity=sparsity,
                              num_inference_steps=num_inference_steps, config=self.cfg.sparse_attention):
            yield

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents ``(1, C, f, h, w)`` -> frames float32 ``(4(f-1)+1, 3, H, W)`` in [0, 1] on the CPU,
        exactly as diffusers' Wan pipelines decode (de-normalise with the VAE's latents_mean/std, decode in the
        VAE's dtype, ``postprocess_video``)."""
        vae = self.t2v.vae
        x = latents.to(device=next(vae.parameters()).device, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(x.device, x.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(x.device, x.dtype)
        video = vae.decode(x / (1.0 / std) + mean, return_dict=False)[0]
        return self.t2v.video_processor.postprocess_video(video, output_type="pt")[0].to(torch.float32).cpu()

    @torch.no_grad()
    def generate_clip(self, req: VideoRequest, cond: Handover | torch.Tensor | None, seed: int, embeds,
                      on_step: Callable[[int], None] | None = None, num_frames: int | None = None) -> Clip:
        """One clip of ``num_frames`` (default ``req.frames_per_clip``; 4k+1) frames: a Clip of frames float32
        ``(F, 3, H, W)`` in [0, 1] and latents ``(1, C, (F-1)/4+1, h, w)`` (normalised, the pipeline's dtype).

        ``cond``: None (text-to-video), a conditioning frame float ``(3, H, W)`` in [0, 1] (image-to-video; VAE
        encoded), or a Handover (its ``latents``, when set, condition the clip directly: no encode).
        ``embeds``: from :meth:`encode_prompt`. ``on_step(i)`` runs after denoising step ``i`` (0-based).
        The request's ``quality``, ``cache`` and ``sparsity`` pick the pipeline, step cache and attention.
        Raises NonFiniteOutputError on NaN/Inf latents, ValueError when image input is not supported."""
        pe, ne = embeds
        image = cond.frame if isinstance(cond, Handover) else cond
        cond_latents = cond.latents if isinstance(cond, Handover) else None
        t2v, i2v = self.pipelines(req.quality)

        def callback(pipe, i, t, kw):
            if not torch.isfinite(kw["latents"]).all():
                raise NonFiniteOutputError(f"non-finite latents (NaN/Inf) at denoising step {i + 1}")
            if on_step is not None:
                on_step(i)
            return {}

        common = dict(prompt_embeds=pe, negative_prompt_embeds=ne, height=req.height, width=req.width,
                      num_frames=num_frames or req.frames_per_clip, num_inference_steps=req.num_inference_steps,
                      guidance_scale=req.guidance_scale, output_type="latent",
                      generator=torch.Generator(device="cpu").manual_seed(seed),
                      callback_on_step_end=callback)
        if image is not None and i2v is None:
            raise ValueError("this model has no image-to-video pipeline")
        steps = req.num_inference_steps
        with self.attention(req.sparsity, steps, req.quality), \
                step_cache(self.transformers(req.quality), req.cache, self.cfg.cache, steps):
            if image is None:
                latents = t2v(**common).frames
            else:
                i2v.condition_latents = cond_latents
                try:
                    latents = i2v(image=image.to(torch.float32).clamp(0, 1), **common).frames
                finally:
                    i2v.condition_latents = None
        return Clip(self.decode(latents), latents)

    def generate(self, req: VideoRequest, image: torch.Tensor | None = None, reference: ColorStats | None = None,
                 continuation: bool | None = None, on_progress: Callable[[Progress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 wrap: Callable[[ClipFn], ClipFn] | None = None) -> ChainResult:
        """The whole video: ``req.num_clips`` chained clips (clip ``k`` of ``req.clip_frames(k)`` frames), joined,
        drift-corrected and cut to ``req.total_frames`` frames (the duration rule of :mod:`video.request`).

        ``image``: float ``(3, H, W)`` in [0, 1] for image-to-video or continuing a video (``continuation``,
        default ``req.continuation``: its frame is not repeated). Clips after the first are conditioned on the
        previous clip's last latent frame when ``cfg.chaining`` is ``latent``, else on its last decoded frame.
        ``reference``: drift reference of a video being extended.
        ``on_progress``: called per denoising step and per decode. ``should_stop``: polled every step
        (raises JobCancelled). ``wrap``: wraps the per-clip function (tests and notebooks make the model
        misbehave on purpose with it). Returns a ChainResult (frames float32 ``(T, 3, H, W)``).
        Raises NonFiniteOutputError, JobCancelled, ValueError.
        """
        seed = req.seed if req.seed is not None else random.randrange(2**62)
        seeds = clip_seeds(seed, req.num_clips)
        steps, total = req.num_inference_steps, progress_units(req)
        embeds = self.encode_prompt(req.prompt, req.negative_prompt, req.guidance_scale)
        state = {"clip": 0}

        def report(phase: str, done: int):
            if on_progress is not None:
                on_progress(Progress(phase, done, total, state["clip"], req.num_clips))

        def on_step(i: int):
            if should_stop is not None and should_stop():
                raise JobCancelled("cancelled")
            base = state["clip"] * (steps + 1)
            report("decoding" if i + 1 == steps else "denoising", base + i + 1)

        def clip_fn(k: int, cond: Handover | None, s: int) -> Clip:
            state["clip"] = k
            report("denoising", k * (steps + 1))
            return self.generate_clip(req, cond, s, embeds, on_step, num_frames=req.clip_frames(k))

        def on_clip_done(k: int):
            state["clip"] = k + 1
            report("denoising" if k + 1 < req.num_clips else "encoding", (k + 1) * (steps + 1))

        fn = wrap(clip_fn) if wrap is not None else clip_fn
        continuation = req.continuation if continuation is None else continuation
        return chain_clips(fn, req.num_clips, seeds, first_image=image, drift_correction=req.drift_correction,
                           reference=reference, continuation=continuation, on_clip_done=on_clip_done,
                           total_frames=req.target_frames, latent=self.cfg.chaining == "latent")
