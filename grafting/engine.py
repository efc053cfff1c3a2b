"""``VLMEngine``: the one entry point to the grafted vision-LLM (service, tests, notebooks, benchmarks).

Loads tower, projector and LLM with ``from_pretrained`` (hub ids or directories), builds the processor, and
answers OpenAI-style conversations, streamed token by token or whole. Two LLM backends (``from_config(backend=)``):
``transformers`` decodes in this process (:mod:`grafting.generate`, :mod:`grafting.batching`: the exact
reference) and ``vllm`` in a vLLM server that the caller owns and hands in as a client (:mod:`grafting.vllm_backend`,
:mod:`core.llm_client`); both stream the same :class:`~grafting.generate.Delta` events.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import resolve_path
from core.llm_client import LLMClient
from core.memory import DTYPES
from core.validate import check_seed

from .config import VLMConfig
from .generate import Delta, SamplingParams, generate_stream
from .model import GraftedVLM
from .processor import GraftProcessor, ImageLimitsView, Prompt, PromptError
from .projector import GraftProjector
from .tower import load_tower

@dataclass
class Completion:
    """A finished answer: ``text``, ``finish_reason`` (stop | length | cancelled), token counts (prompt tokens
    include image tokens), and timings in seconds (``ttft_s`` to the first token, ``total_s``)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float


class VLMEngine:
    """Grafted VLM engine.

    Args: model (:class:`GraftedVLM`), processor (:class:`GraftProcessor`), config (:class:`VLMConfig`),
    vllm (:class:`~grafting.vllm_backend.VLLMBackend` for ``backend="vllm"``, over an injected
    :class:`~core.llm_client.LLMClient`; then ``model.llm`` is only the LLM's embedding table).
    Errors: :meth:`prepare` raises PromptError / ImageInputError (ValueError subclasses with ``status_code``);
    :meth:`generate` raises PromptError when ``max_tokens`` is out of range; the ``vllm`` backend raises
    EngineUnavailableError (503) while its server is down.
    """

    def __init__(self, model: GraftedVLM, processor: GraftProcessor, config: VLMConfig, vllm=None):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.config = config
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(model.llm.generation_config, "eos_token_id", None)
        ids = set([eos] if isinstance(eos, int) else (eos or []))
        ids |= set([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.eos_token_ids = ids
        self._batcher = None
        self.vllm = vllm

    @property
    def backend(self) -> str:
        """``transformers`` or ``vllm``."""
        return "vllm" if self.vllm is not None else "transformers"

    @classmethod
    def from_config(cls, config: VLMConfig, model_dir: str | Path | None = None,
                    backend: str = "transformers", llm_client: LLMClient | None = None) -> "VLMEngine":
        """Load everything named by ``config`` (paths relative to ``model_dir``). Raises OSError when a
        checkpoint is missing (run ``chimera prepare``).

        ``backend``: ``transformers`` (the default: the in-process reference that training, evaluation, notebooks
        and tests use) or ``vllm`` (what the service runs when the profile's ``vlm.engine.backend`` says so: only
        the LLM's embedding table is loaded here; ``llm_client`` is the client of the vLLM server that the caller
        started and owns, e.g. ``services.engines.vllm_server.start_vllm_for(config, model_dir)``; it need not be ready
        yet - see :meth:`ready`). ValueError for another backend name, for ``vllm`` without ``llm_client`` or for
        ``transformers`` with one."""
        if backend not in ("transformers", "vllm"):
            raise ValueError(f"unknown backend {backend!r} (transformers | vllm)")
        if (backend == "vllm") != (llm_client is not None):
            raise ValueError("the vllm backend takes an llm_client (and only it does)")
        from transformers import AutoModelForCausalLM, AutoTokenizer, Kimi_K25ImageProcessor

        dtype = DTYPES[config.dtype]
        tower_path = resolve_path(model_dir, config.tower)
        llm_path = resolve_path(model_dir, config.llm)
        device_map = "auto" if config.device == "auto" else None
        tower_device = "cuda:0" if config.device == "auto" else config.device
        if backend == "vllm":
            from transformers import GenerationConfig

            from .vllm_backend import EmbeddingTable, load_input_embeddings

            try:
                gen = GenerationConfig.from_pretrained(llm_path)
            except OSError:
                gen = None
            llm = EmbeddingTable(load_input_embeddings(llm_path, dtype), gen).to(tower_device)
        else:
            llm = AutoModelForCausalLM.from_pretrained(llm_path, dtype=dtype, device_map=device_map)
            if device_map is None:
                llm = llm.to(config.device)
        tower = load_tower(tower_path, dtype=dtype, device=tower_device, key_prefix=config.tower_key_prefix)
        projector = GraftProjector.from_pretrained(resolve_path(model_dir, config.projector),
                                                   dtype=DTYPES[config.projector_dtype]).to(tower_device).eval()
        tokenizer = AutoTokenizer.from_pretrained(llm_path)
        image_processor = Kimi_K25ImageProcessor.from_pretrained(
            tower_path, size={"max_height": config.max_image_side // 14, "max_width": config.max_image_side // 14})
        lim = config.limits
        processor = GraftProcessor(
            tokenizer, image_processor,
            (config.image_tokens.start, config.image_tokens.image, config.image_tokens.end),
            ImageLimitsView(lim.max_image_bytes, lim.max_image_pixels, lim.max_images,
                            tuple(lim.allowed_image_hosts)),
            max_prompt_tokens=config.max_prompt_tokens)
        model = GraftedVLM(tower, projector, llm, processor.image_token_ids)
        model.freeze_backbones()
        model.projector.requires_grad_(False)
        # issue 11 hook: the image-embedding cache (both backends embed through model.image_features)
        if config.image_cache.enabled:
            from .image_cache import ImageFeatureCache

            model.image_cache = ImageFeatureCache(config.image_cache.max_bytes)
        engine = cls(model, processor, config)
        if backend == "vllm":
            from .vllm_backend import VLLMBackend

            engine.vllm = VLLMBackend(config, model, engine.eos_token_ids, llm_client)
        return engine

    def ready(self) -> bool:
        """True when the engine can answer now (the ``vllm`` backend: its server is healthy)."""
        return self.vllm is None or self.vllm.ready()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until :meth:`ready` (the ``vllm`` server up) or ``timeout`` seconds; returns :meth:`ready`."""
        return self.vllm is None or self.vllm.wait_ready(timeout)

    # ------------------------------------------------------------------------------------------
    def prepare(self, messages: list[dict[str, Any]]) -> Prompt:
        """Validate and tokenize a conversation (images decoded, placeholders expanded)."""
        return self.processor(messages)

    def sampling_params(self, max_tokens: int | None = None, temperature: float | None = None,
                        top_p: float | None = None, seed: int | None = None,
                        stop: str | list[str] | None = None, logprobs: bool | None = None,
                        top_logprobs: int | None = None) -> SamplingParams:
        """OpenAI request fields -> :class:`SamplingParams`, with range checks (PromptError, 400)."""
        check_seed(seed, PromptError)
        if max_tokens is None:
            max_tokens = self.config.default_max_new_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1 or max_tokens > self.config.max_new_tokens:
            raise PromptError(f"max_tokens must be an integer from 1 to {self.config.max_new_tokens}",
                              "max_tokens", "invalid_value")
        temperature = 1.0 if temperature is None else float(temperature)
        if not 0.0 <= temperature <= 2.0:
            raise PromptError("temperature must be between 0 and 2", "temperature", "invalid_value")
        top_p = 1.0 if top_p is None else float(top_p)
        if not 0.0 < top_p <= 1.0:
            raise PromptError("top_p must be in (0, 1]", "top_p", "invalid_value")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or not all(isinstance(s, str) for s in stops):
            raise PromptError("stop must be a string or a list of at most 4 strings", "stop", "invalid_value")
        if top_logprobs is not None and (not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20):
            raise PromptError("top_logprobs must be an integer from 0 to 20", "top_logprobs", "invalid_value")
        if top_logprobs and not logprobs:
            raise PromptError("top_logprobs requires logprobs: true", "top_logprobs", "invalid_value")
        return SamplingParams(max_tokens, temperature, top_p, seed, stops, bool(logprobs), top_logprobs or 0)

    def response_format(self, response_format: Any) -> dict | None:
        """Validate an OpenAI ``response_format`` and return what the ``vllm`` backend sends (None for plain
        text): ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
        "strict"}}``; the answer is always constrained to the schema (``strict`` true or not). PromptError 400:
        ``invalid_value`` for a malformed one, ``unsupported_parameter`` for JSON modes on the ``transformers``
        backend."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict) or response_format.get("type") not in \
                ("text", "json_object", "json_schema"):
            raise PromptError("response_format must be an object with type text, json_object or json_schema",
                              "response_format", "invalid_value")
        kind = response_format["type"]
        allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
        if set(response_format) - allowed:
            raise PromptError(f"response_format of type {kind} takes only {sorted(allowed)}", "response_format",
                              "invalid_value")
        if kind == "text":
            return None
        if self.vllm is None:
            raise PromptError(f"response_format {kind} needs the vllm backend (vlm.engine.backend)",
                              "response_format", "unsupported_parameter")
        if kind == "json_object":
            return {"type": "json_object"}
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not isinstance(js.get("schema"), dict) \
                or not isinstance(js.get("strict", False), (bool, type(None))) \
                or set(js) - {"name", "description", "schema", "strict"}:
            raise PromptError("response_format.json_schema needs name (string), schema (object) and optionally "
                              "description and strict (boolean)", "response_format", "invalid_value")
        return {"type": "json_schema", "json_schema": {"name": js["name"], "schema": js["schema"],
                                                       "strict": bool(js.get("strict"))}}

    def _check_context(self, prompt: Prompt, params: SamplingParams) -> None:
        if prompt.num_tokens + params.max_new_tokens > self.config.max_prompt_tokens + self.config.max_new_tokens:
            raise PromptError("prompt plus max_tokens exceeds the context limit", "max_tokens",
                              "context_length_exceeded")

    def generate(self, prompt: Prompt, params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[Delta]:
        """Stream the answer to a prepared prompt as :class:`~grafting.generate.Delta` events (``transformers``
        backend; the ``vllm`` backend streams with :meth:`agenerate`)."""
        self._check_context(prompt, params)
        if self.vllm is not None:
            raise RuntimeError("the vllm backend streams with agenerate()")
        return generate_stream(self.model, self.tokenizer, prompt, params, self.eos_token_ids, cancel)

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        response_format: dict | None = None) -> AsyncIterator[Delta]:
        """Stream the answer through the ``vllm`` backend (``response_format`` as returned by
        :meth:`response_format`); closing the iterator aborts the request in vLLM."""
        self._check_context(prompt, params)
        async for d in self.vllm.generate(prompt, params, response_format):
            yield d

    def batcher(self):
        """The engine's :class:`~grafting.batching.ContinuousBatcher` (started on first use, ``max_batch_size``
        from the config): what a server uses so that concurrent requests share decode steps."""
        from .batching import ContinuousBatcher

        if self._batcher is None:
            self._batcher = ContinuousBatcher(self.model, self.tokenizer, self.eos_token_ids,
                                              self.config.max_batch_size)
        return self._batcher

    def close(self) -> None:
        """Stop the continuous batcher if one was started (joins its thread; unfinished requests get
        :class:`~grafting.batching.BatcherClosed`; a later :meth:`batcher` starts a new one) and release the
        ``vllm`` backend's client, which stops its server. Idempotent."""
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close()
        if self.vllm is not None:
            self.vllm.close()

    def complete(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        """Answer a conversation in one call (``sampling``: max_tokens, temperature, top_p, seed, stop)."""
        t0 = time.perf_counter()
        prompt = self.prepare(messages)
        params = self.sampling_params(**sampling)
        parts, ttft, last = [], None, None

        async def collect() -> list[Delta]:
            return [d async for d in self.agenerate(prompt, params)]

        for d in (asyncio.run(collect()) if self.vllm is not None else self.generate(prompt, params)):
            if ttft is None:
                ttft = d.t - t0
            parts.append(d.text)
            last = d
        return Completion("".join(parts), last.finish_reason, prompt.num_tokens, last.completion_tokens,
                          ttft or 0.0, time.perf_counter() - t0)

    @torch.inference_mode()
    def logits(self, messages: list[dict[str, Any]]) -> torch.Tensor:
        """Next-token logits at every prompt position: ``(T, V)`` float (the generation prompt included;
        ``transformers`` backend only)."""
        if self.vllm is not None:
            raise RuntimeError("logits() needs the transformers backend (the vllm backend holds no LLM layers)")
        p = self.prepare(messages)
        out = self.model(p.input_ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        return out.logits[0]
