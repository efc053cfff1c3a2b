"""The in-process ``transformers`` implementation of :class:`core.llm_client.LLMClient` for the speech LM.

:class:`TransformersSpeechClient` serves the requests of :func:`audio.lm_stream.frame_request` with the KV-cache
decode of :func:`audio.generate.stream_tokens`: the frame-position constraint comes from the request's
``extra_args`` (the same arguments vLLM's logits processor reads, ``audio/vllm_ext/chimera_frame_constraint.py``),
the seed from the request (modulo 2**63), so both backends get the same request and sample the same allowed ids.
It serves the cpu profile's speech and is the exact reference in tests. Each decode step runs in a worker thread
(``asyncio.to_thread``), one step per token read: concurrent syntheses decode side by side and nothing is computed
ahead of what is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import torch

from core.llm_client import CompletionChunk, CompletionRequest, EngineRequestError
from core.validate import SEED_LIMIT

from .config import SamplingConfig
from .generate import stream_tokens
from .layout import TokenLayout
from .vllm_ext.chimera_frame_constraint import ARG, parse_arg


class TransformersSpeechClient:
    """An :class:`~core.llm_client.LLMClient` over the speech LM ``model`` (a causal LM with transformers'
    forward/KV-cache signature) in this process, for the token ``layout``. ``state`` is always ``ready``; no
    structured outputs; :meth:`close` has nothing to release. ``generated_tokens``: tokens sampled since start."""

    supports_structured_outputs = False

    def __init__(self, model, layout: TokenLayout):
        self.model = model
        self.layout = layout
        self.active = 0
        self.generated_tokens = 0

    @property
    def state(self) -> str:
        """``ready``: the model is in this process."""
        return "ready"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True at once."""
        return True

    async def stats(self) -> dict[str, Any]:
        """``backend`` ``transformers``, ``active`` requests streaming now, ``generated_tokens`` since start."""
        return {"backend": "transformers", "active": self.active, "generated_tokens": self.generated_tokens}

    async def spec_decode(self) -> None:
        """None: the in-process model does not speculate."""
        return None

    def close(self) -> None:
        """Nothing to release (the weights go with the object)."""

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """One chunk per sampled token (no text), ``finish_reason`` ``stop`` on a stop id, ``length`` at
        ``max_tokens``, then the usage chunk. Raises EngineRequestError for a request without the frame constraint
        (:data:`~audio.vllm_ext.chimera_frame_constraint.ARG` in ``extra_args``) or with an embedding prompt."""
        arg = (request.extra_args or {}).get(ARG)
        if arg is None or not request.prompt_is_ids:
            raise EngineRequestError(f"the in-process speech LM takes token ids with the frame constraint ({ARG})")
        try:
            *_, offset, allow_end = parse_arg(arg)
        except ValueError as exc:
            raise EngineRequestError(str(exc)) from None
        ids = [int(i) for i in request.prompt]
        sampling = SamplingConfig.model_construct(temperature=request.temperature, top_p=request.top_p,
                                                  repetition_penalty=request.repetition_penalty)
        gen = torch.Generator().manual_seed(request.seed % SEED_LIMIT) if request.seed is not None else None
        tokens = stream_tokens(self.model, ids, len(ids) - offset, sampling, self.layout, gen, bool(allow_end))
        stop = set(request.stop_token_ids)
        n = 0
        self.active += 1
        try:
            while n < request.max_tokens:
                tok = await asyncio.to_thread(next, tokens)
                n += 1
                self.generated_tokens += 1
                if tok in stop:
                    yield CompletionChunk("", [tok], None, "stop")
                    break
                yield CompletionChunk("", [tok], None, "length" if n == request.max_tokens else None)
            yield CompletionChunk("", [], None, None, n)
        finally:
            self.active -= 1
            try:
                tokens.close()
            except ValueError:  # a step still runs in its worker thread (the reader left mid-step): let it end
                pass
