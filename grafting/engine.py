"""``VLMEngine``: the one entry point to the grafted vision-LLM (service, tests, notebooks, benchmarks).

Loads tower, projector and LLM with ``from_pretrained`` (hub ids or directories), builds the processor, and
answers OpenAI-style conversations, streamed token by token or whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import VLMConfig
from .generate import Delta, SamplingParams, generate_stream
from .model import GraftedVLM
from .processor import GraftProcessor, ImageLimitsView, Prompt, PromptError
from .projector import GraftProjector
from .tower import load_tower

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _resolve(model_dir: Path | None, p: str) -> str:
    if model_dir is not None and not Path(p).is_absolute() and (Path(model_dir) / p).exists():
        return str(Path(model_dir) / p)
    return p


class VLMEngine:
    """Grafted VLM engine.

    Args: model (:class:`GraftedVLM`), processor (:class:`GraftProcessor`), config (:class:`VLMConfig`).
    Errors: :meth:`prepare` raises PromptError / ImageInputError (ValueError subclasses with ``status_code``);
    :meth:`generate` raises PromptError when ``max_tokens`` is out of range.
    """

    def __init__(self, model: GraftedVLM, processor: GraftProcessor, config: VLMConfig):
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

    @classmethod
    def from_config(cls, config: VLMConfig, model_dir: str | Path | None = None) -> "VLMEngine":
        """Load everything named by ``config`` (paths relative to ``model_dir``). Raises OSError when a
        checkpoint is missing (run ``chimera prepare``)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer, Kimi_K25ImageProcessor

        dtype = DTYPES[config.dtype]
        tower_path = _resolve(model_dir, config.tower)
        llm_path = _resolve(model_dir, config.llm)
        device_map = "auto" if config.device == "auto" else None
        llm = AutoModelForCausalLM.from_pretrained(llm_path, dtype=dtype, device_map=device_map)
        if device_map is None:
            llm = llm.to(config.device)
        tower_device = "cuda:0" if config.device == "auto" else config.device
        tower = load_tower(tower_path, dtype=dtype, device=tower_device, key_prefix=config.tower_key_prefix)
        projector = GraftProjector.from_pretrained(_resolve(model_dir, config.projector),
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
        return cls(model, processor, config)

    # ------------------------------------------------------------------------------------------
    def prepare(self, messages: list[dict[str, Any]]) -> Prompt:
        """Validate and tokenize a conversation (images decoded, placeholders expanded)."""
        return self.processor(messages)

    def sampling_params(self, max_tokens: int | None = None, temperature: float | None = None,
                        top_p: float | None = None, seed: int | None = None,
                        stop: str | list[str] | None = None, logprobs: bool | None = None,
                        top_logprobs: int | None = None) -> SamplingParams:
        """OpenAI request fields -> :class:`SamplingParams`, with range checks (PromptError, 400)."""
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or abs(seed) >= 2**63):
            raise PromptError("seed must be an integer with |seed| < 2**63", "seed", "invalid_value")
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

    def generate(self, prompt: Prompt, params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[Delta]:
        """Stream the answer to a prepared prompt as :class:`~grafting.generate.Delta` events."""
        if prompt.num_tokens + params.max_new_tokens > self.config.max_prompt_tokens + self.config.max_new_tokens:
            raise PromptError("prompt plus max_tokens exceeds the context limit", "max_tokens",
                              "context_length_exceeded")
        return generate_stream(self.model, self.tokenizer, prompt, params, self.eos_token_ids, cancel)

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
        :class:`~grafting.batching.BatcherClosed`). A later :meth:`batcher` starts a new one. Idempotent."""
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close()

    def complete(self, messages: list[dict[str, Any]], **sampling: Any) -> Completion:
        """Answer a conversation in one call (``sampling``: max_tokens, temperature, top_p, seed, stop)."""
        t0 = time.perf_counter()
        prompt = self.prepare(messages)
        params = self.sampling_params(**sampling)
        parts, ttft, last = [], None, None
        for d in self.generate(prompt, params):
            if ttft is None:
                ttft = d.t - t0
            parts.append(d.text)
            last = d
        return Completion("".join(parts), last.finish_reason, prompt.num_tokens, last.completion_tokens,
                          ttft or 0.0, time.perf_counter() - t0)

    @torch.inference_mode()
    def logits(self, messages: list[dict[str, Any]]) -> torch.Tensor:
        """Next-token logits at every prompt position: ``(T, V)`` float (the generation prompt included)."""
        p = self.prepare(messages)
        out = self.model(p.input_ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw)
        return out.logits[0]
