"""Shaping a speech replica's pcm16 events into HTTP bodies: chunked audio (a streamed WAV header carries
0xFFFFFFFF sizes) or SSE ``speech.audio.delta`` / ``speech.audio.done`` events, with time to first audio and
real-time factor recorded in the ingress metrics."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

from audio.formats import STREAMABLE, encode, wav_header
from core.constants import SAMPLE_RATE

from . import metrics
from .errors import error_body, raise_if_error_event, to_api_error

log = logging.getLogger("chimera.speech")


class SpeechTiming:
    """Time to first audio and real-time factor of one synthesis, recorded in the ingress metrics."""

    def __init__(self, model_id: str, endpoint: str):
        self.model_id, self.endpoint = model_id, endpoint
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.samples = 0

    def audio(self, n_bytes: int) -> None:
        if self.first is None and n_bytes:
            self.first = time.perf_counter() - self.t0
            metrics.TTS_TIME_TO_FIRST_AUDIO.labels(self.model_id, self.endpoint).observe(self.first)
        self.samples += n_bytes // 2

    def done(self, usage: dict | None = None) -> None:
        """End of the synthesis: record the real-time factor; log stripped tags and loop-guard cuts (plain audio
        responses have no usage field to report them in)."""
        if usage and (usage.get("stripped_tags") or usage.get("loops")):
            log.info("speech %s: stripped tags %s, loop guard %s", self.endpoint, usage.get("stripped_tags"),
                     usage.get("loops"))
        if self.samples:
            rtf = (time.perf_counter() - self.t0) / (self.samples / SAMPLE_RATE)
            metrics.TTS_REAL_TIME_FACTOR.labels(self.model_id, self.endpoint).observe(rtf)
        metrics.TTS_AUDIO_SECONDS.labels(self.model_id).inc(self.samples / SAMPLE_RATE)


async def audio_chunks(events, fmt: str, timing: SpeechTiming):
    """Chunked audio body: pcm16 as made, after a streamed WAV header for ``wav``. An error mid-stream ends
    the body early (the status line is already sent) and is logged."""
    if fmt == "wav":
        yield wav_header(SAMPLE_RATE, streamed=True)
    try:
        async for ev in events:
            raise_if_error_event(ev)
            if ev["type"] == "audio" and ev["pcm"]:
                timing.audio(len(ev["pcm"]))
                yield ev["pcm"]
            elif ev["type"] == "done":
                timing.done(ev["usage"])
    except Exception as exc:  # noqa: BLE001
        log.error("speech stream failed: %s", to_api_error(exc).message)


async def audio_sse(events, fmt: str, timing: SpeechTiming):
    """SSE: ``speech.audio.delta`` events (base64; their concatenation is the file of ``fmt``: a streamed WAV
    header first for wav, one delta with the whole file for flac/mp3/opus), then ``speech.audio.done``."""
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    try:
        if fmt == "wav":
            yield json.dumps({"type": "speech.audio.delta", "audio": b64(wav_header(SAMPLE_RATE, streamed=True))})
        pcm = bytearray()
        async for ev in events:
            raise_if_error_event(ev)
            if ev["type"] == "audio" and ev["pcm"]:
                timing.audio(len(ev["pcm"]))
                if fmt in STREAMABLE:
                    yield json.dumps({"type": "speech.audio.delta", "audio": b64(ev["pcm"])})
                else:
                    pcm += ev["pcm"]
            elif ev["type"] == "done":
                if fmt not in STREAMABLE:
                    data = await asyncio.to_thread(encode, bytes(pcm), fmt, SAMPLE_RATE)
                    yield json.dumps({"type": "speech.audio.delta", "audio": b64(data)})
                timing.done(ev["usage"])
                yield json.dumps({"type": "speech.audio.done", "usage": ev["usage"]})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - an error mid-stream is sent as an SSE error event
        err = to_api_error(exc)
        yield json.dumps(error_body(err.message, err.type, err.param, err.code))
