"""``VLMEngine``: the one entry point to the grafted vision-LLM (service, tests, notebooks, benchmarks).

Loads tower, projector and LLM with ``from_pretrained`` (hub ids or directories), builds the processor, and
answers OpenAI-style conversations, streamed token by token (:meth:`VLMEngine.stream`) or whole. The LLM is
reached only through an :class:`~core.llm_client.LLMClient` (``grafting/backend.py`` picks it: in-process
``transformers`` or a ``vllm`` server the caller owns); :mod:`grafting.llm_stream` turns its chunks into
:class:`~grafting.generate.Delta` events, with the collapse guard in between.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import resolve_path
from core.llm_client import EngineUnavailableError, LLMClient
from core.loop_thread import LoopThread
from core.memory import DTYPES
from core.validate import check_max_tokens, check_seed

from .backend import check_backend, load_llm
from .collapse_guard import GuardReport
from .config import VLMConfig
from .generate import Delta, SamplingParams
from .llm_stream import answer
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

    Args: model (:class:`GraftedVLM`; with the ``vllm`` backend ``model.llm`` is only the LLM's embedding table),
    processor (:class:`GraftProcessor`), config (:class:`VLMConfig`), client (the
    :class:`~core.llm_client.LLMClient` the LLM decodes through).
    Errors: :meth:`prepare` raises PromptError / ImageInputError (ValueError subclasses with ``status_code``);
    :meth:`sampling_params` raises PromptError for out-of-range fields; :meth:`stream` raises PromptError when the
    prompt plus ``max_tokens`` exceeds the context, EngineUnavailableError (503) while the client's engine is down.
    """

    def __init__(self, model: GraftedVLM, processor: GraftProcessor, config: VLMConfig, client: LLMClient):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.config = config
        self.client = client
        self._complete_loop = LoopThread("vlm-complete")  # complete()'s event loop, started on first use
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(model.llm.generation_config, "eos_token_id", None)
        ids = set([eos] if isinstance(eos, int) else (eos or []))
        ids |= set([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.eos_token_ids = ids

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
        ``transformers`` with one (:func:`grafting.backend.check_backend`)."""
        from transformers import AutoTokenizer, Kimi_K25ImageProcessor

        check_backend(backend, llm_client)  # before anything loads
        dtype = DTYPES[config.dtype]
        tower_path = resolve_path(model_dir, config.tower)
        llm_path = resolve_path(model_dir, config.llm)
        tower_device = "cuda:0" if config.device == "auto" else config.device
        tokenizer = AutoTokenizer.from_pretrained(llm_path)
        llm, client = load_llm(backend, llm_path, dtype, config.device, tokenizer, config.max_batch_size, llm_client)
        tower = load_tower(tower_path, dtype=dtype, device=tower_device, key_prefix=config.tower_key_prefix)
        projector = GraftProjector.from_pretrained(resolve_path(model_dir, config.projector),
                                                   dtype=DTYPES[config.projector_dtype]).to(tower_device).eval()
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
        return cls(model, processor, config, client)

    def ready(self) -> bool:
        """True when the engine can answer now (the client's engine is up and healthy)."""
        return self.client.state == "ready"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until :meth:`ready` or ``timeout`` seconds; returns :meth:`ready`."""
        return self.client.wait_ready(timeout)

    async def stats(self) -> dict:
        """The client's counters (:meth:`core.llm_client.LLMClient.stats`): ``backend``, ``active`` requests held
        now and ``generated_tokens`` since start (None while the engine is down), plus what the client adds
        (in-process: ``max_batch_seen``; vLLM: ``engine_state``, ``engine_pid``, ``engine_restarts``)."""
        return await self.client.stats()

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
        check_max_tokens(max_tokens, self.config.max_new_tokens, PromptError)
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
        """Validate an OpenAI ``response_format`` and return what :meth:`stream` takes (None for plain text):
        ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
        the answer is always constrained to the schema (``strict`` true or not). PromptError 400:
        ``invalid_value`` for a malformed one, ``unsupported_parameter`` for JSON modes when the client has no
        structured outputs (the ``transformers`` backend)."""
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
        if not self.client.supports_structured_outputs:
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

    async def stream(self, prompt: Prompt, params: SamplingParams, response_format: dict | None = None,
                     report: GuardReport | None = None, guard: bool = True) -> AsyncIterator[Delta]:
        """Stream the answer to a prepared prompt as :class:`~grafting.generate.Delta` events (one per token, then
        a final one with ``finish_reason`` ``stop`` | ``length`` and ``completion_tokens``), whichever backend:
        :func:`grafting.llm_stream.answer`. ``response_format``: as returned by :meth:`response_format`;
        ``guard``: run the collapse guard (``config.collapse_guard``; always off with a ``response_format``),
        filling ``report`` in. Raises (at the first event) PromptError ``context_length_exceeded`` when the
        prompt plus ``max_tokens`` exceeds the context, EngineUnavailableError while the engine is down; later
        the client's errors. Closing the iterator aborts the request (the batcher drops the row; vLLM aborts)."""
        self._check_context(prompt, params)
        if self.client.state != "ready":
            raise EngineUnavailableError(f"the language-model engine is {self.client.state}; retry shortly")
        cfg = self.config.collapse_guard
        if not guard:
            cfg = cfg.model_copy(update={"enabled": False})
        stream = answer(self.model, self.client, self.tokenizer, prompt, params, self.eos_token_ids, cfg,
                        response_format, report)
        try:
            async for d in stream:
                yield d
        finally:
            await stream.aclose()

    def close(self) -> None:
        """Release the client: the in-process batcher's thread joins (a later request starts a new one), a vLLM
        server stops; :meth:`complete`'s loop thread ends. Idempotent."""
        self.client.close()
        self._complete_loop.close()

    def complete(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        """Answer a conversation in one call (``sampling``: max_tokens, temperature, top_p, seed, stop), from
        blocking code, a running event loop's thread included (a notebook): the stream runs on the engine's own loop
        thread (:class:`core.loop_thread.LoopThread`)."""
        t0 = time.perf_counter()
        prompt = self.prepare(messages)
        params = self.sampling_params(**sampling)

        parts, ttft, last = [], None, None
        for d in self._complete_loop.iterate(lambda: self.stream(prompt, params)):
            if ttft is None:
                ttft = d.t - t0
            parts.append(d.text)
            last = d
        return Completion("".join(parts), last.finish_reason, prompt.num_tokens, last.completion_tokens,
                          ttft or 0.0, time.perf_counter() - t0)

    @torch.inference_mode()
    def logits(self, messages: list[dict[str, Any]]) -> torch.Tensor:
        """Next-token logits at every prompt position: ``(T, V)`` float (the generation prompt included). Needs the
        LLM's layers in this process (the ``transformers`` backend); RuntimeError when ``model.llm`` holds only
        the embedding table."""
        p = self.prepare(messages)
        try:
            out = self.model(p.input_ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        except NotImplementedError:  # nn.Module without forward: the embedding table alone
            raise RuntimeError("logits() needs the LLM's layers in this process (the transformers backend)") \
                from None
        return out.logits[0]
