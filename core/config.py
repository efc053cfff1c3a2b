"""Config building blocks every family shares: the strict pydantic base, :class:`ConfigFieldError`, the vLLM
server options (:class:`VLLMOptions`, with its speculative-decoding blocks) and the one path resolver.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .constants import DTYPE_PATTERN


class Strict(BaseModel):
    """The base of every config model: unknown keys are refused (``extra="forbid"``), so a misspelt key in a
    profile is an error instead of a silent default; field names may start with ``model_``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ConfigFieldError(ValueError):
    """A config value that every request would then be refused over (a default outside its own limit), raised by
    a family config's cross-field validator. ``field``: the key's dotted path inside that config
    (``default_max_new_tokens``, ``defaults.frames_per_clip``); ``services.config.profiles`` prefixes the section's path
    (``vlm.engine.``) when it reports it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.reason = field, message


PROJECT_DIR_ENV = "CHIMERA_HOME"  # where a profile's relative paths point (exported to every Ray worker)


def project_dir() -> Path:
    """The directory a profile's relative paths (``model_dir``, ``vllm.python``) are resolved against:
    ``$CHIMERA_HOME`` when set (``services.serve_app.init_ray`` exports the directory ``chimera serve`` started in to
    every Ray worker), else the current directory. Never the installed package's location, so a ``pip install .``
    (not editable) finds the ``.chimera/`` and ``.venv-vllm`` of the project it runs in (docs/operations/install.md).
    """
    return Path(os.environ.get(PROJECT_DIR_ENV) or os.getcwd())


def in_project(p: str | Path) -> Path:
    """``p`` (``~`` expanded) when absolute, else ``p`` under :func:`project_dir`; not resolved (no symlinks read)."""
    return project_dir() / Path(p).expanduser()


def resolve_path(model_dir: str | Path | None, p: str, local: bool = False) -> str:
    """Where a config's checkpoint path ``p`` points: ``p`` unchanged when it is absolute, a URL (``://``) or
    ``model_dir`` is None; else ``<model_dir>/<p>`` when that exists, or when ``local`` (a folder to be written
    there, e.g. by a cpu profile's build); else ``p`` as given (a hub id)."""
    if model_dir is None or Path(p).is_absolute() or "://" in p:
        return p
    here = Path(model_dir) / p
    return str(here) if local or here.exists() else p


class NgramSpeculation(Strict):
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


class DraftSpeculation(Strict):
    """Speculative decoding with a draft checkpoint in vLLM: ``draft_model`` (a small LLM with the target's
    vocabulary), ``eagle`` or ``eagle3`` (a draft head trained on the target's hidden states, Li et al. 2024/2025).
    ``model``: the draft's hub id or directory, made for this exact target LLM. ``num_speculative_tokens``: tokens
    proposed per step. Keys as vLLM 0.32's ``--speculative-config``."""

    method: Literal["draft_model", "eagle", "eagle3"]
    model: str = Field(min_length=1)
    num_speculative_tokens: int = Field(ge=1)


Speculation = Annotated[NgramSpeculation | DraftSpeculation, Field(discriminator="method")]


class VLLMOptions(Strict):
    """How the ``vllm`` backend runs vLLM's OpenAI server (its own venv and process, see ``services/engines/vllm_server.py``).

    ``python``: the vLLM venv's interpreter (a relative path is resolved against the project directory,
    ``$CHIMERA_HOME`` or the directory ``chimera serve`` started in; ``$CHIMERA_VLLM_PYTHON`` overrides it;
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
    ``quantized``: serve this quantized checkpoint (a folder written by ``chimera quantize``, relative to the model
    directory like the engine's checkpoints) instead of the full-precision LM; refused at start unless its
    ``fidelity.json`` names the LM's own weights (:func:`core.quant.fidelity.verify_checkpoint`). None: full
    precision.
    """

    python: str = ".venv-vllm/bin/python"
    dtype: str | None = Field(None, pattern=DTYPE_PATTERN)
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
    quantized: str | None = None


def check_quantized_backend(backend: str, vllm: VLLMOptions) -> None:
    """A family config's ``vllm.quantized`` is served only by the ``vllm`` backend: with another backend it would be
    ignored, so it is refused. Raises ConfigFieldError (``vllm.quantized``)."""
    if vllm.quantized is not None and backend != "vllm":
        raise ConfigFieldError("vllm.quantized", f"{vllm.quantized!r} is served only with backend: vllm (this "
                               f"section's backend is {backend}, which would ignore it)")
