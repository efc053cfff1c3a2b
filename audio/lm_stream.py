"""The speech LM as a source of audio tokens, through the LLM client protocol (either backend alike).

:class:`SpeechLM` is what :func:`audio.generate.generate_frames` reads: each attempt at a sentence is one
:class:`~core.llm_client.CompletionRequest` (:func:`frame_request`) whose prompt is the token ids of
:meth:`audio.engine.TTSEngine.prompt` (plus the frames a retry keeps), with end_of_speech as its stop id,
``max_tokens`` = the sentence's remaining frames x 7, the attempt's seed, and the frame-position constraint
asked for by ``extra_args`` (``audio/vllm_ext/chimera_frame_constraint.py``: vLLM runs it as a logits processor;
the in-process :class:`audio.local_client.TransformersSpeechClient` reads the same arguments and samples the same
allowed ids). Concurrent syntheses are separate requests (vLLM batches them). Closing the token iterator (the
loop guard fired, the sentence ended, the caller is gone) or setting the cancel event closes the stream, which
aborts the request. The client is injected (the serving layer owns a vLLM server; model code never starts
processes).

Every attempt's stream runs on the one event loop of the :class:`SpeechLM` (:class:`core.loop_thread.LoopThread`,
a daemon thread started at the first attempt, ended by :meth:`SpeechLM.close`), pulled one chunk at a time from
the synthesis' worker thread: a loop per attempt cost its creation and teardown on every sentence and retry
(``bench/tts_stream_loop.py``), a client that pools its connections needs them to live on one loop, and an
in-process model decodes a token only when it is read.
"""

from __future__ import annotations

from collections.abc import Iterator

from core.llm_client import CompletionRequest, EngineUnavailableError, LLMClient
from core.loop_thread import LoopClosed, LoopThread

from .config import SamplingConfig
from .layout import TokenLayout
from .vllm_ext.chimera_frame_constraint import ARG

POLL_S = 0.05  # seconds between checks of the cancel event while waiting for the next chunk
LOOP_THREAD_NAME = "tts-lm-loop"


def frame_request(input_ids: list[int], prompt_len: int, sampling: SamplingConfig, layout: TokenLayout,
                  seed: int | None, max_tokens: int, allow_end: bool = True) -> CompletionRequest:
    """The request of one attempt: ``input_ids`` (prompt + kept audio tokens, the audio a multiple of 7 long,
    ``prompt_len`` the prompt's part) and at most ``max_tokens`` new audio tokens, sampled with ``sampling`` and
    ``seed`` (None: unseeded; the clients take it modulo 2**63) under the frame constraint (``extra_args``
    :data:`~audio.vllm_ext.chimera_frame_constraint.ARG`: ``[audio_start, codebook_size, positions,
    end_of_speech, offset, allow_end]``, offset = audio tokens already in the prompt). Special tokens are kept
    (the ids are what matters)."""
    c = layout.cfg
    offset = len(input_ids) - prompt_len
    return CompletionRequest(
        prompt=list(input_ids), max_tokens=max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.temperature > 0 else 1.0, repetition_penalty=sampling.repetition_penalty,
        seed=seed, stop_token_ids=[c.end_of_speech], skip_special_tokens=False,
        extra_args={ARG: [c.audio_start, c.codebook_size, c.positions, c.end_of_speech, offset, int(allow_end)]})


class SpeechLM:
    """Audio-token source over ``client`` (an :class:`~core.llm_client.LLMClient` of the speech LM; see the
    module docstring). ``state`` and ``wait_ready`` are the client's. :meth:`close` ends the event-loop thread the
    streams run on (the client stays: whoever made it closes it)."""

    def __init__(self, client: LLMClient):
        self.client = client
        self._loop = LoopThread(LOOP_THREAD_NAME)

    @property
    def state(self) -> str:
        """The client's state (``ready`` when it can serve)."""
        return self.client.state

    def wait_ready(self, timeout: float | None = None) -> bool:
        """The client's :meth:`~core.llm_client.LLMClient.wait_ready`."""
        return self.client.wait_ready(timeout)

    def close(self) -> None:
        """End the event-loop thread, once no attempt runs: a stream still on the loop is cancelled and closed,
        and its reader gets EngineUnavailableError. Idempotent; a later attempt starts a new loop."""
        self._loop.close()

    def request(self, input_ids: list[int], prompt_len: int, sampling: SamplingConfig, layout: TokenLayout,
                seed: int | None, max_tokens: int, allow_end: bool = True) -> CompletionRequest:
        """The request of one attempt (:func:`frame_request`)."""
        return frame_request(input_ids, prompt_len, sampling, layout, seed, max_tokens, allow_end)

    def stream_tokens(self, input_ids: list[int], prompt_len: int, sampling: SamplingConfig, layout: TokenLayout,
                      seed: int | None, max_tokens: int, cancel=None, allow_end: bool = True) -> Iterator[int]:
        """Yield the sampled audio token ids of one attempt (:meth:`request`) as the client streams them,
        end_of_speech last when the sentence ended. Closing the iterator, or ``cancel`` (a ``threading.Event``)
        being set (checked every :data:`POLL_S` s even while the engine holds the request in its queue), closes
        the stream, which aborts the request; on ``cancel`` it raises :class:`audio.generate.Cancelled`. Raises
        EngineUnavailableError / EngineRequestError (``core.llm_client``). Call it from a worker thread, not from
        the instance's loop."""
        from .generate import Cancelled

        req = self.request(input_ids, prompt_len, sampling, layout, seed, max_tokens, allow_end)
        eos = layout.cfg.end_of_speech
        chunks = self._loop.iterate(lambda: self.client.stream(req), cancel, POLL_S, Cancelled)
        try:
            for chunk in chunks:
                yield from chunk.token_ids
                if chunk.finish_reason == "stop" and (not chunk.token_ids or chunk.token_ids[-1] != eos):
                    yield eos
        except LoopClosed:
            raise EngineUnavailableError("the speech LM's stream was closed with its engine") from None
        finally:
            chunks.close()
