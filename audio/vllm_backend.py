"""The speech LM's ``vllm`` backend: audio tokens streamed from vLLM's OpenAI server, frame-constrained there.

:class:`VLLMSpeechLM` stands in for the in-process LM in :func:`audio.generate.generate_frames`: each attempt at
a sentence is one streaming ``/v1/completions`` request whose prompt is the token ids of
:meth:`audio.engine.TTSEngine.prompt` (plus the frames a retry keeps), asking for token ids back
(``return_token_ids``), with the frame-position constraint enabled for it by ``vllm_xargs``
(``audio/vllm_ext/chimera_frame_constraint.py``, loaded by the server), end_of_speech as its stop id and
``max_tokens`` = the sentence's remaining frames x 7. Concurrent syntheses are separate requests that vLLM batches.
Closing the token iterator (the loop guard fired, the sentence ended, the caller is gone) or setting the cancel
event closes the HTTP stream, and vLLM aborts the request at once. The server and its client are owned by the
serving layer and injected (an :class:`grafting.llm_client.LLMClient`); model code never starts processes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from grafting.llm_client import LLMClient

from .config import SamplingConfig
from .layout import TokenLayout
from .vllm_ext.chimera_frame_constraint import ARG

SERVED_NAME = "chimera-llm"  # the name services/vllm_server.py serves every LM under
POLL_S = 0.05  # seconds between checks of the cancel event while waiting for vLLM's next chunk
SEED_MOD = 2**63  # vLLM seeds are int64


class VLLMSpeechLM:
    """Audio-token source over a vLLM server (see the module docstring). ``client``: an LLMClient of the speech
    LM's server. ``state`` and ``wait_ready`` are the client's."""

    def __init__(self, client: LLMClient):
        self.client = client

    @property
    def state(self) -> str:
        """The engine server's state (``ready`` when it can serve)."""
        return self.client.state

    def body(self, input_ids: list[int], prompt_len: int, sampling: SamplingConfig, layout: TokenLayout,
             seed: int | None, max_tokens: int, allow_end: bool = True) -> dict:
        """The streaming completions request of one attempt: ``input_ids`` (prompt + kept audio tokens, the
        audio a multiple of 7 long) and at most ``max_tokens`` new audio tokens, sampled with ``sampling`` and
        ``seed`` (taken modulo 2**63) under the frame constraint."""
        c = layout.cfg
        offset = len(input_ids) - prompt_len
        return {"model": SERVED_NAME, "prompt": list(input_ids), "max_tokens": max_tokens, "stream": True,
                "temperature": sampling.temperature, "top_p": sampling.top_p if sampling.temperature > 0 else 1.0,
                "repetition_penalty": sampling.repetition_penalty,
                "seed": None if seed is None else seed % SEED_MOD, "stop_token_ids": [c.end_of_speech],
                "return_token_ids": True, "skip_special_tokens": False,
                "vllm_xargs": {ARG: [c.audio_start, c.codebook_size, c.positions, c.end_of_speech, offset,
                                     int(allow_end)]}}

    def stream_tokens(self, input_ids: list[int], prompt_len: int, sampling: SamplingConfig, layout: TokenLayout,
                      seed: int | None, max_tokens: int, cancel: threading.Event | None = None,
                      allow_end: bool = True) -> Iterator[int]:
        """Yield the sampled audio token ids of one attempt (:meth:`body`) as vLLM streams them, end_of_speech
        last when the sentence ended. Closing the iterator, or ``cancel`` being set (checked every
        :data:`POLL_S` s even while vLLM holds the request in its queue), closes the HTTP stream, which aborts
        the request in vLLM; on ``cancel`` it raises :class:`audio.generate.Cancelled`. Raises
        EngineUnavailableError / EngineRequestError (``grafting.llm_client``). Runs its own event loop: call it
        from a worker thread, not from a running loop."""
        from .generate import Cancelled

        loop = asyncio.new_event_loop()
        chunks = self.client.stream(self.body(input_ids, prompt_len, sampling, layout, seed, max_tokens,
                                              allow_end))
        eos = layout.cfg.end_of_speech
        try:
            while True:
                task = loop.create_task(chunks.__anext__())
                while not task.done():
                    loop.run_until_complete(asyncio.wait({task}, timeout=POLL_S))
                    if cancel is not None and cancel.is_set() and not task.done():
                        task.cancel()
                        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
                        raise Cancelled()
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    return
                yield from chunk.token_ids
                if chunk.finish_reason == "stop" and (not chunk.token_ids or chunk.token_ids[-1] != eos):
                    yield eos
        finally:
            loop.run_until_complete(chunks.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())  # iterators the stream left to their finalizers
            loop.close()
