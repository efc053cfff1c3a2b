"""``audio.lm_stream.SpeechLM.stream_tokens`` without vLLM: its event loop (``core.loop_thread.LoopThread``) finishes
what the client's stream leaves behind. The engine client (``core.vllm_client.VLLMClient.stream``) returns from inside
``async for line in response.aiter_lines()``, leaving httpx's line iterator to Python's async-generator finalizer,
which schedules its ``aclose()`` on the loop; closing the loop without running it destroyed that task ("Task was
destroyed but it is pending!": 54 times in one ``bench/tts_concurrency.py`` run, where a sentence's stream was
closed before its end). A scripted client of the same shape
(an inner async generator whose ``finally`` records that it ran) stands in for vLLM's server: no model involved.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from audio.config import SamplingConfig, TokenLayoutConfig
from audio.layout import TokenLayout
from audio.generate import Cancelled
from audio.lm_stream import LOOP_THREAD_NAME, SpeechLM

LAYOUT = TokenLayout(TokenLayoutConfig())


class ScriptedClient:
    """``stream(request)`` yields 3 chunks of one audio frame's ids each, read from an inner line iterator that it
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

    async def stream(self, request):
        async for line in self._lines():
            if line == "[DONE]":
                return
            yield SimpleNamespace(token_ids=line, finish_reason=None)


def test_stream_tokens_runs_the_streams_finalizers():
    client = ScriptedClient()
    lm = SpeechLM(client)
    s = SamplingConfig()
    prompt = [1, 2, 3]
    got = list(lm.stream_tokens(prompt, len(prompt), s, LAYOUT, 0, 21))
    assert len(got) == 21 and client.closed == 1  # read to the end: the inner iterator was closed
    tokens = lm.stream_tokens(prompt, len(prompt), s, LAYOUT, 0, 21)
    assert [next(tokens) for _ in range(3)] == [LAYOUT.audio_id(p, 0) for p in range(3)]
    tokens.close()  # the loop guard fired or the sentence ended: closed mid-stream
    assert client.closed == 2
    lm.close()


class LoopRecordingClient(ScriptedClient):
    """ScriptedClient that also records the event loop each stream runs on (kept alive, so ids stay unique)."""

    def __init__(self):
        super().__init__()
        self.loops = []

    async def stream(self, request):
        self.loops.append(asyncio.get_running_loop())
        async for chunk in super().stream(request):
            yield chunk


def _loop_threads() -> set[threading.Thread]:
    """The SpeechLM loop threads alive now."""
    return {t for t in threading.enumerate() if t.name == LOOP_THREAD_NAME}


def test_attempts_share_one_loop_that_close_ends():
    """Issue 24 (7): every attempt (read to the end, closed mid-stream, cancelled) streams on the one event loop of
    the SpeechLM, not on a new loop each; ``close()`` ends its thread and closes the loop; a later attempt
    starts a new one. (Each attempt once made, ran and closed an event loop of its own.)"""
    client = LoopRecordingClient()
    lm = SpeechLM(client)
    s = SamplingConfig()
    others = _loop_threads()
    assert len(list(lm.stream_tokens([1], 1, s, LAYOUT, 0, 21))) == 21
    tokens = lm.stream_tokens([1], 1, s, LAYOUT, 0, 21)
    next(tokens)
    tokens.close()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        list(lm.stream_tokens([1], 1, s, LAYOUT, 0, 21, cancel))
    assert len(client.loops) == 3 and len(set(map(id, client.loops))) == 1, client.loops
    assert client.closed == 3 and len(_loop_threads() - others) == 1
    lm.close()
    assert _loop_threads() - others == set() and client.loops[0].is_closed()
    lm.close()  # idempotent
    assert len(list(lm.stream_tokens([1], 1, s, LAYOUT, 0, 21))) == 21  # a new loop after close
    assert len(set(map(id, client.loops))) == 2
    lm.close()
    assert _loop_threads() - others == set()


def test_close_leaves_no_socket_to_the_engine():
    """Issue 24 (7): syntheses' streams over the real engine client (``core.vllm_client.VLLMClient``)
    against the scripted stand-in server of ``bench/tts_stream_loop.py``: after ``close()`` no connection to the
    server is left open and no loop thread runs."""
    from bench.tts_stream_loop import StandInServer, sockets_to
    from core.vllm_client import VLLMClient

    others = _loop_threads()
    with StandInServer() as server:
        port = int(server.base_url.rsplit(":", 1)[1])
        lm = SpeechLM(VLLMClient(SimpleNamespace(base_url=server.base_url, state="ready")))
        s = SamplingConfig()
        for n in (7, 21):
            assert len(list(lm.stream_tokens([1], 1, s, LAYOUT, 0, n))) == n
        tokens = lm.stream_tokens([1], 1, s, LAYOUT, 0, 70)
        next(tokens)
        tokens.close()  # closed mid-stream
        lm.close()
        assert sockets_to(port) == 0 and _loop_threads() - others == set()
