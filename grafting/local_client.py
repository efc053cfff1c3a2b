"""The in-process ``transformers`` implementation of :class:`core.llm_client.LLMClient` for the VLM's LLM.

:class:`TransformersClient` serves :class:`~core.llm_client.CompletionRequest` s (token ids or ``(T, H)``
prompt embeddings) with the engine's :class:`~grafting.batching.ContinuousBatcher` (concurrent requests share
each decode step), streaming the same :class:`~core.llm_client.CompletionChunk` s as vLLM's completions stream
(:mod:`grafting.generate`). It is the exact reference the ``vllm`` backend is checked against
(``tests/test_vlm_vllm.py``), and what the training, evaluation and notebooks decode with.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from core.llm_client import CompletionChunk, CompletionRequest, EngineRequestError

from .batching import ContinuousBatcher


class TransformersClient:
    """An :class:`~core.llm_client.LLMClient` over the causal LM ``llm`` in this process.

    Args: llm (a transformers ``*ForCausalLM``), tokenizer (its tokenizer: the chunks' text), max_batch_size (rows
    decoded together). ``state`` is always ``ready``; structured outputs are not supported (EngineRequestError,
    ``response_format``). The batcher thread starts on the first request; :meth:`close` joins it (unfinished
    requests get :class:`~grafting.batching.BatcherClosed`) and a later request starts a new one.
    Closing a stream early drops its row from the batch before the next decode step.
    """

    supports_structured_outputs = False

    def __init__(self, llm, tokenizer, max_batch_size: int = 8):
        self.llm = llm
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._batcher: ContinuousBatcher | None = None
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        """``ready``: the model is in this process."""
        return "ready"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True at once (nothing to wait for)."""
        return True

    def batcher(self) -> ContinuousBatcher:
        """The running batcher (started now if none runs)."""
        with self._lock:
            if self._batcher is None:
                self._batcher = ContinuousBatcher(self.llm, self.tokenizer, self.max_batch_size)
            return self._batcher

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """The chunks of ``request`` as the batcher decodes them (see the class docstring). Raises what the decode
        raises (e.g. :class:`~grafting.generate.NonFiniteOutputError`), EngineRequestError for structured
        outputs."""
        if request.structured_outputs is not None:
            raise EngineRequestError("structured outputs need the vllm backend", "response_format")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        self.batcher().submit(request, cancel, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.completion_tokens is not None:
                    return
        finally:
            cancel.set()

    async def stats(self) -> dict[str, Any]:
        """``backend`` ``transformers``, ``active`` rows being decoded now, ``max_batch_seen`` and
        ``generated_tokens`` since the batcher started (0 before it has)."""
        b = self._batcher
        return {"backend": "transformers", "active": b.active if b else 0,
                "max_batch_seen": b.max_batch_seen if b else 0, "generated_tokens": b.generated_tokens if b else 0}

    async def spec_decode(self) -> None:
        """None: the in-process model does not speculate."""
        return None

    def close(self) -> None:
        """Stop the batcher if one runs (joins its thread). Idempotent."""
        with self._lock:
            batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher.close()
