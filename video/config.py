"""Configuration of the video family (the ``video.engine`` block of a profile).

``model`` is a diffusers-format Wan pipeline directory (``model_index.json`` + ``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/``) or a hub id, e.g. ``Wan-AI/Wan2.2-TI2V-5B-Diffusers``
(variant ``ti2v``: one transformer does text- and image-to-video) or ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``
(variant ``t2v``; image-to-video then needs ``i2v_model``, e.g. ``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``).
Relative directories are resolved against the profile's model directory. ``build`` describes the small
random-weight cpu models that ``chimera prepare`` writes; GPU profiles leave it out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from core.config import ConfigFieldError, Strict, resolve_path
from core.constants import DTYPE_PATTERN

MAX_GUIDANCE_SCALE = 50.0  # a request's guidance_scale must be in [0, this] (video/request.py)


class VideoLimits(Strict):
    """Request limits checked before a job is queued (violations are 400s, or 413 for large uploads).

    Sizes in pixels, durations in seconds, frames per clip, prompt length in characters, upload sizes in bytes.
    """

    max_width: int = Field(1280, ge=16)
    max_height: int = Field(1280, ge=16)
    max_pixels: int = Field(1280 * 720, ge=256)
    max_seconds: float = Field(20.0, gt=0)
    max_clips: int = Field(8, ge=1)
    max_frames_per_clip: int = Field(121, ge=1)
    max_steps: int = Field(100, ge=1)
    max_prompt_chars: int = Field(2000, ge=1)
    max_image_bytes: int = Field(16 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(4096 * 4096, gt=0)
    max_video_bytes: int = Field(256 * 1024 * 1024, gt=0)


class VideoDefaults(Strict):
    """Values used when a request leaves them out. ``frames_per_clip`` must be 4k+1 (Wan's VAE compresses
    time by 4); a lone clip lasts ``frames_per_clip / fps`` seconds and each chained clip adds
    ``frames_per_clip - 1`` frames (the duration rule: :mod:`video.request`)."""

    width: int = 832
    height: int = 480
    fps: int = Field(16, ge=1, le=60)
    frames_per_clip: int = 81
    num_inference_steps: int = Field(40, ge=1)
    guidance_scale: float = Field(5.0, ge=0)
    negative_prompt: str = ""



class JobOptions(Strict):
    """The job manager: durable store (any SQLAlchemy URL; relative SQLite paths and ``results_dir`` are
    resolved against the model dir), ``workers`` long-lived job workers each holding an engine and
    ``gpus_per_job`` GPUs (0 on the cpu profile; so a GPU profile gives video jobs ``workers`` GPUs and runs that
    many jobs at once), at most ``max_queued`` unfinished jobs (beyond it: 429), results kept ``ttl_s`` seconds."""

    store_url: str = "sqlite:///video_jobs.sqlite"
    results_dir: str = "video_results"
    workers: int = Field(1, ge=1)
    gpus_per_job: float = Field(0.0, ge=0, le=1)
    cpus_per_job: float = Field(1.0, ge=0)
    max_queued: int = Field(64, ge=1)
    ttl_s: int = Field(7 * 24 * 3600, ge=60)
    actor_name: str = "chimera-video-jobs"
    namespace: str = "chimera"


class TransformerBuild(Strict):
    """Sizes of the small random ``WanTransformer3DModel`` (hidden = heads * head_dim)."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    ffn_dim: int = 64
    freq_dim: int = 32


class VAEBuild(Strict):
    """Sizes of the small random ``AutoencoderKLWan``. ``z_dim=48, patch_size=2, scale_factor_spatial=16``
    with ``is_residual`` is the Wan2.2 (TI2V) VAE layout; ``z_dim=16, patch_size=None, 8`` is Wan2.1's."""

    base_dim: int = 8
    z_dim: int = 48
    dim_mult: list[int] = [1, 2, 2, 2]
    num_res_blocks: int = 1
    is_residual: bool = True
    patch_size: int | None = 2
    scale_factor_spatial: int = 16


class TextEncoderBuild(Strict):
    """Sizes of the small random ``UMT5EncoderModel`` (SmolLM2's tokenizer, 49,152 ids, feeds it)."""

    d_model: int = 32
    d_kv: int = 16
    d_ff: int = 64
    num_layers: int = 2
    num_heads: int = 2


class VideoBuild(Strict):
    """What ``chimera prepare`` writes for a cpu profile (all seeded)."""

    transformer: TransformerBuild = TransformerBuild()
    vae: VAEBuild = VAEBuild()
    text_encoder: TextEncoderBuild = TextEncoderBuild()
    seed: int = 0


class SparseAttentionConfig(Strict):
    """Defaults of the sparse self-attention; every field can be overridden per request in `begin()`.

    - `sparsity`: fraction of key blocks kept per query block, in (0, 1]; 1.0 means dense.
    - `tile`: (t, h, w) tile shape in latent tokens (after Wan's 1x2x2 patching); its volume is the block size.
    - `dense_fraction`: fraction of the denoising steps, from the first, that run dense (Sparse VideoGen: ~25%).
    - `dense_layers`: indices of transformer blocks whose self-attention always runs dense.
    - `backend`: "flex" (`flex_attention` with a `BlockMask`), "gather" (kept key/value blocks gathered, batched
      BLAS GEMMs; faster on CPU) or "auto" (flex on CUDA, gather elsewhere).
    - `compile`: for the flex backend, use `torch.compile(flex_attention)` (skips masked blocks); False runs eager
      flex (dense compute, a reference only).
    """

    sparsity: float = Field(0.125, gt=0.0, le=1.0)
    tile: tuple[PositiveInt, PositiveInt, PositiveInt] = (2, 8, 8)
    dense_fraction: float = Field(0.25, ge=0.0, le=1.0)
    dense_layers: list[int] = Field(default_factory=list)
    backend: Literal["auto", "flex", "gather"] = "auto"
    compile: bool = True

    @property
    def block_size(self) -> int:
        """Tokens per block: the tile volume."""
        return math.prod(self.tile)


class MagCacheOptions(Strict):
    """MagCache (Ma et al. 2025, arXiv:2506.09045; diffusers ``MagCacheConfig``): skip the transformer blocks of a
    step (reuse the last residual) while the accumulated magnitude-ratio error stays under ``threshold``.
    ``mag_ratios``: per-step ratios ``mean_tokens |r_t| / |r_t-1|`` of the residual (last block out - first block
    in) of the conditional pass, calibrated per checkpoint (:func:`video.cache.calibrate_mag_ratios`); diffusers
    interpolates them to the request's step count. None: not calibrated, requests for ``mag`` are refused."""

    threshold: float = Field(0.06, gt=0)
    max_skip_steps: int = Field(3, ge=1)
    retention_ratio: float = Field(0.2, ge=0, le=1)
    mag_ratios: list[float] | None = None


class FirstBlockCacheOptions(Strict):
    """First Block Cache (ParaAttention; diffusers ``FirstBlockCacheConfig``): run block 0, skip the others and
    reuse their residual when block 0's residual changed by less than ``threshold`` (relative mean abs)."""

    threshold: float = Field(0.05, gt=0)


class TaylorSeerOptions(Strict):
    """TaylorSeer (Liu et al. 2025, arXiv:2503.06923; diffusers ``TaylorSeerCacheConfig``): full compute for the
    first ``disable_cache_before_step`` steps and every ``cache_interval``-th step after; the steps between
    predict each block's output by a Taylor expansion of order ``max_order`` (factors kept in float32)."""

    cache_interval: int = Field(2, ge=1)
    disable_cache_before_step: int = Field(2, ge=0)
    max_order: int = Field(1, ge=1, le=4)


class StepCacheConfig(Strict):
    """Options of the step caches a request selects with ``cache`` (:mod:`video.cache`)."""

    mag: MagCacheOptions = MagCacheOptions()
    first_block: FirstBlockCacheOptions = FirstBlockCacheOptions()
    taylorseer: TaylorSeerOptions = TaylorSeerOptions()


class FastProfile(Strict):
    """The ``quality: "fast"`` profile: a step-distillation LoRA fused once at engine load into a second copy of
    the transformer (the full-quality copy stays unchanged, so nothing is ever unfused), with its own scheduler,
    step count and guidance. ``lora``: a directory/file (relative to the model dir) or a hub repo id;
    ``weight_name``: the file inside a repo/directory; ``lora_scale``: multiplies the LoRA delta when fusing.
    ``scheduler``: ``euler`` (``FlowMatchEulerDiscreteScheduler``) or ``unipc`` (as the full path), both with
    ``flow_shift``. A request may still set ``num_inference_steps`` / ``guidance_scale``; these are its defaults."""

    lora: str
    weight_name: str | None = None
    lora_scale: float = 1.0
    scheduler: Literal["euler", "unipc"] = "euler"
    flow_shift: float = Field(5.0, gt=0)
    num_inference_steps: int = Field(4, ge=1)
    guidance_scale: float = Field(1.0, ge=0)


class VideoConfig(Strict):
    """Engine config of the Wan-style video family.

    ``variant``: ``ti2v`` (Wan2.2-TI2V: ``expand_timesteps``, one model for text and image input, sizes
    multiples of 32) or ``t2v`` (Wan2.1: sizes multiples of 16; image input needs ``i2v_model``).
    ``flow_shift``: the flow-matching schedule shift of the UniPC scheduler (Wan: 3.0 at 480p, 5.0 at 720p).
    ``dtype``: transformer/text-encoder dtype; the VAE always runs in ``vae_dtype`` (fp32: encodes of chained
    frames in bf16 amplify drift). ``max_sequence_length``: text tokens (Wan: 512).
    ``cache``: step-cache options (a request picks one with ``cache``); ``fast``: the step-distilled profile
    (``quality: "fast"``; None: not offered). ``chaining``: ``latent`` conditions clip k+1 on clip k's last latent
    frame (no VAE decode/encode round trip; ``ti2v`` only), ``pixel`` on its last decoded frame (re-encoded).
    """

    model: str = "video/wan"
    i2v_model: str | None = None
    variant: str = Field("ti2v", pattern="^(ti2v|t2v)$")
    dtype: str = Field("float32", pattern=DTYPE_PATTERN)
    vae_dtype: str = Field("float32", pattern=DTYPE_PATTERN)
    device: str = "cpu"
    flow_shift: float = Field(5.0, gt=0)
    max_sequence_length: int = Field(512, ge=1)
    torch_threads: int | None = Field(None, ge=1)
    sparse_attention: SparseAttentionConfig = SparseAttentionConfig()
    cache: StepCacheConfig = StepCacheConfig()
    fast: FastProfile | None = None
    chaining: Literal["latent", "pixel"] = "pixel"
    defaults: VideoDefaults = VideoDefaults()
    limits: VideoLimits = VideoLimits()
    jobs: JobOptions = JobOptions()
    build: VideoBuild | None = None

    @model_validator(mode="after")
    def _defaults_within_limits(self):
        """Every default a request falls back on must pass that request's own check (``video/request.py``), else
        every request leaving it out is a 400 about a field it never sent: ``defaults`` width/height positive
        multiples of :attr:`size_multiple` within ``limits`` (``max_width``, ``max_height``, ``max_pixels``),
        ``frames_per_clip`` 4k+1 (k >= 1) and at most ``limits.max_frames_per_clip``, ``num_inference_steps`` (also ``fast``'s) at most
        ``limits.max_steps``, ``guidance_scale`` (also ``fast``'s) at most :data:`MAX_GUIDANCE_SCALE`,
        ``negative_prompt`` at most ``limits.max_prompt_chars``. Raises ConfigFieldError naming the key."""
        d, lim, mult = self.defaults, self.limits, self.size_multiple
        for name, v, cap in (("width", d.width, lim.max_width), ("height", d.height, lim.max_height)):
            if v <= 0 or v % mult:
                raise ConfigFieldError(f"defaults.{name}", f"{v} is not a positive multiple of {mult} pixels (variant "
                                       f"{self.variant})")
            if v > cap:
                raise ConfigFieldError(f"defaults.{name}", f"{v} is over limits.max_{name} ({cap})")
        if d.width * d.height > lim.max_pixels:
            raise ConfigFieldError("defaults.width", f"{d.width}x{d.height} is over limits.max_pixels "
                                   f"({lim.max_pixels})")
        f = d.frames_per_clip
        if f < 5 or (f - 1) % 4:
            raise ConfigFieldError("defaults.frames_per_clip", f"{f} is not 4k+1 with k >= 1 (Wan's VAE compresses "
                                   "time by 4)")
        if f > lim.max_frames_per_clip:
            raise ConfigFieldError("defaults.frames_per_clip", f"{f} is over limits.max_frames_per_clip "
                                   f"({lim.max_frames_per_clip})")
        steps = [("defaults", d.num_inference_steps, d.guidance_scale)]
        if self.fast is not None:
            steps.append(("fast", self.fast.num_inference_steps, self.fast.guidance_scale))
        for where, n, g in steps:
            if n > lim.max_steps:
                raise ConfigFieldError(f"{where}.num_inference_steps", f"{n} is over limits.max_steps ({lim.max_steps})")
            if g > MAX_GUIDANCE_SCALE:
                raise ConfigFieldError(f"{where}.guidance_scale", f"{g} is over {MAX_GUIDANCE_SCALE:g}")
        if len(d.negative_prompt) > lim.max_prompt_chars:
            raise ConfigFieldError("defaults.negative_prompt", f"{len(d.negative_prompt)} characters, over "
                                   f"limits.max_prompt_chars ({lim.max_prompt_chars})")
        return self

    @model_validator(mode="after")
    def _latent_needs_ti2v(self):
        if self.chaining == "latent" and self.variant != "ti2v":
            raise ValueError("chaining 'latent' needs variant 'ti2v' (Wan2.1's image-to-video conditions on an "
                             "encoded pixel clip and a CLIP image embedding); use chaining 'pixel'")
        if self.fast is not None and self.i2v_model:
            raise ValueError("a fast profile's LoRA fits the text-to-video transformer only: leave out i2v_model")
        return self

    def resolve(self, model_dir: str | Path, p: str) -> str:
        """Where checkpoint path ``p`` points (:func:`core.config.resolve_path`): a relative directory under
        ``model_dir`` when it exists there or this profile builds it (``build``); absolute paths, URLs and hub ids
        unchanged."""
        return resolve_path(model_dir, p, local=self.build is not None)

    @property
    def size_multiple(self) -> int:
        """Width/height must be multiples of this many pixels (VAE stride x transformer patch)."""
        return 32 if self.variant == "ti2v" else 16
