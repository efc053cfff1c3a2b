"""The video engine: diffusers' Wan pipelines for text- and image-to-video, chained into long videos.

- ``WanPipeline`` (text-to-video) and ``WanImageToVideoPipeline`` (image-to-video) from diffusers >= 0.35
  (Wan-AI/Wan2.1, Wan-AI/Wan2.2 models). A Wan2.2-TI2V-style checkpoint (``expand_timesteps``) does both with
  one transformer: the I2V pipeline is built from the T2V one with ``from_pipe`` (shared weights).
- The prompt is encoded once per job (UMT5) and passed to every clip as ``prompt_embeds``.
- The VAE is loaded and run in ``vae_dtype`` (fp32 by default) whatever the transformer's dtype.
- Progress comes from ``callback_on_step_end``, which also stops a job early on NaN/Inf latents.
One instance is used by the service's job workers, tests, notebooks and benchmarks alike.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .chaining import ChainResult, ClipFn, NonFiniteOutputError, chain_clips, clip_seeds
from .config import VideoConfig
from .drift import ColorStats
from .request import VideoRequest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class VideoEngine:
    """Wan text/image-to-video with clip chaining and drift correction.

    ``cfg``: the profile's video engine config; ``model_dir``: where relative model paths live.
    ``device``: overrides ``cfg.device`` (job workers pass ``cuda`` when Ray gave them a GPU).
    Raises OSError/ValueError from ``from_pretrained`` when the checkpoint is missing or malformed.
    """

    def __init__(self, cfg: VideoConfig, model_dir: str | Path, device: str | None = None):
        from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline,
                               WanPipeline)

        self.cfg = cfg
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = torch.device(device or cfg.device)
        dtype, vae_dtype = _DTYPES[cfg.dtype], _DTYPES[cfg.vae_dtype]
        path = cfg.resolve(model_dir, cfg.model)
        vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", dtype=vae_dtype)
        self.t2v = WanPipeline.from_pretrained(path, vae=vae, dtype=dtype)
        self.t2v.scheduler = UniPCMultistepScheduler.from_config(self.t2v.scheduler.config, flow_shift=cfg.flow_shift)
        if self.device.type != "cpu":
            self.t2v.to(self.device)
        self.t2v.set_progress_bar_config(disable=True)
        self.i2v = None
        if cfg.variant == "ti2v":
            self.i2v = WanImageToVideoPipeline.from_pipe(self.t2v)
        elif cfg.i2v_model:
            self.i2v = WanImageToVideoPipeline.from_pretrained(
                cfg.resolve(model_dir, cfg.i2v_model), vae=self.t2v.vae, text_encoder=self.t2v.text_encoder,
                tokenizer=self.t2v.tokenizer, dtype=dtype).to(self.device)
            self.i2v.scheduler = UniPCMultistepScheduler.from_config(self.i2v.scheduler.config,
                                                                     flow_shift=cfg.flow_shift)
        if self.i2v is not None:
            self.i2v.set_progress_bar_config(disable=True)
        self.size_multiple = self.t2v.vae_scale_factor_spatial * self.t2v.transformer.config.patch_size[1]

    @torch.no_grad()
    def encode_prompt(self, prompt: str, negative_prompt: str, guidance_scale: float):
        """UMT5 embeddings ``(1, max_sequence_length, text_dim)`` of the prompt and negative prompt
        (the latter None when ``guidance_scale <= 1``: classifier-free guidance off)."""
        pe, ne = self.t2v.encode_prompt(prompt, negative_prompt=negative_prompt,
                                        do_classifier_free_guidance=guidance_scale > 1.0,
                                        max_sequence_length=self.cfg.max_sequence_length, device=self.device)
        return pe, ne

    @contextlib.contextmanager
    def attention(self, sparsity: float, num_inference_steps: int):
        """Block-sparse self-attention (:mod:`video.sparse_attention`) keeping ``sparsity`` of the key blocks
        for one clip (its dense warm-up counts that clip's steps); 1.0: dense, nothing installed.
        Raises ValueError on an out-of-range option."""
        if sparsity >= 1.0:
            yield
            return
        from .sparse_attention import sparse_attention

        transformers = [self.t2v.transformer]
        if self.i2v is not None and self.i2v.transformer is not self.t2v.transformer:
            transformers.append(self.i2v.transformer)
        with sparse_attention(transformers, sparsity=sparsity, num_inference_steps=num_inference_steps,
                              config=self.cfg.sparse_attention):
            yield

    @torch.no_grad()
    def generate_clip(self, req: VideoRequest, image: torch.Tensor | None, seed: int, embeds,
                      on_step: Callable[[int], None] | None = None, num_frames: int | None = None) -> torch.Tensor:
        """One clip of ``num_frames`` (default ``req.frames_per_clip``; 4k+1) frames: float32 ``(F, 3, H, W)``
        in [0, 1].

        ``image``: conditioning frame float ``(3, H, W)`` in [0, 1] (image-to-video) or None (text-to-video).
        ``embeds``: from :meth:`encode_prompt`. ``on_step(i)`` runs after denoising step ``i`` (0-based).
        Raises NonFiniteOutputError on NaN/Inf latents, ValueError when image input is not supported."""
        pe, ne = embeds

        def callback(pipe, i, t, kw):
            if not torch.isfinite(kw["latents"]).all():
                raise NonFiniteOutputError(f"non-finite latents (NaN/Inf) at denoising step {i + 1}")
            if on_step is not None:
                on_step(i)
            return {}

        common = dict(prompt_embeds=pe, negative_prompt_embeds=ne, height=req.height, width=req.width,
                      num_frames=num_frames or req.frames_per_clip, num_inference_steps=req.num_inference_steps,
                      guidance_scale=req.guidance_scale, output_type="pt",
                      generator=torch.Generator(device="cpu").manual_seed(seed),
                      callback_on_step_end=callback)
        if image is not None and self.i2v is None:
            raise ValueError("this model has no image-to-video pipeline")
        with self.attention(req.sparsity, req.num_inference_steps):
            if image is None:
                out = self.t2v(**common)
            else:
                out = self.i2v(image=image.to(torch.float32).clamp(0, 1), **common)
        return out.frames[0].to(torch.float32).cpu()

    def generate(self, req: VideoRequest, image: torch.Tensor | None = None, reference: ColorStats | None = None,
                 continuation: bool | None = None, on_progress: Callable[[Progress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 wrap: Callable[[ClipFn], ClipFn] | None = None) -> ChainResult:
        """The whole video: ``req.num_clips`` chained clips (clip ``k`` of ``req.clip_frames(k)`` frames), joined,
        drift-corrected and cut to ``req.total_frames`` frames (the duration rule of :mod:`video.request`).

        ``image``: float ``(3, H, W)`` in [0, 1] for image-to-video or continuing a video (``continuation``,
        default ``req.continuation``: its frame is not repeated). ``reference``: drift reference of a video
        being extended.
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

        def clip_fn(k: int, cond: torch.Tensor | None, s: int) -> torch.Tensor:
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
                           total_frames=req.target_frames)
