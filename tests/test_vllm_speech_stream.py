"""``audio.vllm_backend.VLLMSpeechLM.stream_tokens`` without vLLM: its private event loop finishes what the client's
stream leaves behind. The engine client (``services.engine_client.VLLMClient.stream``) returns from inside
``async for line in response.aiter_lines()``, leaving httpx's line iterator to Python's async-generator finalizer,
which schedules its ``aclose()`` on the loop; closing the loop without running it destroyed that task ("Task was
destroyed but it is pending!": 54 times in one ``bench/tts_concurrency.py`` run, where a sentence's stream was
closed before its end). A scripted client of the same shape
(an inner async generator whose ``finally`` records that it ran) stands in for vLLM's server: no model involved.
"""

from __future__ import annotations

from types import SimpleNamespace

from audio.config import SamplingConfig, TokenLayoutConfig
from audio.layout import TokenLayout
from audio.vllm_backend import VLLMSpeechLM

LAYOUT = TokenLayout(TokenLayoutConfig())


class ScriptedClient:
    """``stream(body)`` yields 3 chunks of one audio frame's ids each, read from an inner line iterator that it
    leaves suspended when it returns (as ``VLLMClient.stream`` does at ``[DONE]``). ``closed``: inner iterators whose
    ``finally`` ran."""

    state = "ready"

    def __init__(self):
        self.closed = 0

    async def _lines(self):
        try:
            for i in range(3):
                yield [LAYOUT.audio_id(p, i) for p in range(LAYOUT.positions)]
            yield "[DONE]"
            yield "never read"
        finally:
            self.closed += 1

    async def stream(self, body):
        async for line in self._lines():
            if line == "[DONE]":
                return
            yield SimpleNamespace(token_ids=line, finish_reason=None)


def test_stream_tokens_runs_the_streams_finalizers():
    client = ScriptedClient()
    lm = VLLMSpeechLM(client)
    s = SamplingConfig()
    prompt = [1, 2, 3]
    got = list(lm.stream_tokens(prompt, len(prompt), s, LAYOUT, 0, 21))
    assert len(got) == 21 and client.closed == 1  # read to the end: the inner iterator was closed
    tokens = lm.stream_tokens(prompt, len(prompt), s, LAYOUT, 0, 21)
    assert [next(tokens) for _ in range(3)] == [LAYOUT.audio_id(p, 0) for p in range(3)]
    tokens.close()  # the loop guard fired or the sentence ended: closed mid-stream
    assert client.closed == 2
