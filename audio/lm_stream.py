"""The speech LM's ``vllm`` backend: audio tokens streamed from vLLM's OpenAI server, frame-constrained there.

:class:`VLLMSpeechLM` stands in for the in-process LM in :func:`audio.generate.generate_frames`: each attempt at
a sentence is one streaming ``/v1/completions`` request whose prompt is the token ids of
:meth:`audio.engine.TTSEngine.prompt` (plus the frames a retry keeps), asking for token ids back
(``return_token_ids``), with the frame-position constraint enabled for it by ``vllm_xargs``
(``audio/vllm_ext/chimera_frame_constraint.py``, loaded by the server), end_of_speech as its stop id and
``max_tokens`` = the sentence's remaining frames x 7. Concurrent syntheses are separate requests that vLLM batches.
Closing the token iterator (the loop guard fired, the sentence ended, the caller is gone) or setting the cancel
event closes the HTTP stream, and vLLM aborts the request at once. The server and its client are owned by the
serving layer and injected (a :class:`core.llm_client.LLMClient`); model code never starts processes.
Every attempt's stream runs on the one event loop of the instance (a daemon thread started at the first
attempt, ended by :meth:`VLLMSpeechLM.close`), not on a loop of its own: an event loop per attempt cost its
creation and teardown on every sentence and retry (``bench/tts_stream_loop.py``), and a client that pools its
connections needs them to live on one loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator

from core.constants import SERVED_NAME
from core.llm_client import EngineUnavailableError, LLMClient
from core.validate import SEED_LIMIT

from .config import SamplingConfig
from .layout import TokenLayout
from .vllm_ext.chimera_frame_constraint import ARG

POLL_S = 0.05  # seconds between checks of the cancel event while waiting for vLLM's next chunk


class VLLMSpeechLM:
    """Audio-token source over a vLLM server (see the module docstring). ``client``: an LLMClient of the speech
    LM's server. ``state`` and ``wait_ready`` are the client's. :meth:`close` ends the event-loop thread that
    the streams run on (the client and its server stay: the serving layer owns them)."""

    def __init__(self, client: LLMClient):
        self.client = client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._lock = threading.Lock()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The instance's event loop, its thread started on first use (``tts-vllm-loop``, a daemon)."""
        with self._lock:
            if self._loop is None:
                started = threading.Event()

                async def serve():
                    self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                    started.set()
                    await self._stop.wait()

                # asyncio.run's teardown cancels what is left and runs the async generators' finalizers
                self._thread = threading.Thread(target=asyncio.run, args=(serve(),), name="tts-vllm-loop",
                                                daemon=True)
                self._thread.start()
                started.wait()
            return self._loop

    def close(self) -> None:
        """End the event-loop thread, once no attempt runs (the engine stops): a stream still on the loop is
        cancelled and closed, and its reader gets EngineUnavailableError. Idempotent; a later attempt starts a
        new loop."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
            if loop is not None:
                loop.call_soon_threadsafe(self._stop.set)
                thread.join()

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
                "seed": None if seed is None else seed % SEED_LIMIT, "stop_token_ids": [c.end_of_speech],
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
        EngineUnavailableError / EngineRequestError (``core.llm_client``). The stream runs on the instance's
        event loop (see the module docstring): call it from a worker thread, not from that loop."""
        from .generate import Cancelled

        pump = _Pump(self.client.stream(self.body(input_ids, prompt_len, sampling, layout, seed, max_tokens,
                                                  allow_end)))
        loop = self._running_loop()
        asyncio.run_coroutine_threadsafe(pump.run(), loop)
        eos = layout.cfg.end_of_speech
        try:
            while True:
                try:
                    chunk = pump.out.get(timeout=POLL_S)
                except queue.Empty:
                    chunk = None
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                if chunk is None:
                    continue
                if chunk is _END:
                    return
                if isinstance(chunk, BaseException):
                    raise chunk
                yield from chunk.token_ids
                if chunk.finish_reason == "stop" and (not chunk.token_ids or chunk.token_ids[-1] != eos):
                    yield eos
        finally:
            try:
                asyncio.run_coroutine_threadsafe(pump.stop(), loop).result()
            except RuntimeError:  # close() ended the loop under this attempt: its teardown closed the stream
                pass


_END = object()


class _Pump:
    """One attempt's stream ``chunks`` read on the event loop: :meth:`run` puts each chunk in ``out`` (a
    thread-safe queue), then ``_END`` or the exception the stream raised; :meth:`stop` ends it."""

    def __init__(self, chunks: AsyncIterator):
        self.chunks, self.out, self.task = chunks, queue.SimpleQueue(), None

    async def run(self) -> None:
        """Read ``chunks`` into ``out`` (see the class docstring)."""
        self.task = asyncio.current_task()
        try:
            async for chunk in self.chunks:
                self.out.put(chunk)
            self.out.put(_END)
        except asyncio.CancelledError:  # by stop(), or by close() under a reader that is still waiting
            self.out.put(EngineUnavailableError("the speech LM's stream was closed with its engine"))
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reading thread
            self.out.put(exc)

    async def stop(self) -> None:
        """Cancel the read if it still runs (which closes the HTTP stream), close ``chunks``, then let the
        ``aclose()`` tasks that async-generator finalizers scheduled meanwhile run (a stream that returns from
        inside ``async for`` leaves its inner iterator to the finalizer, which schedules a callback that creates
        the task: two turns of the loop). Submitted after :meth:`run`, so it starts after it (FIFO)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.chunks.aclose()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
