"""Speech: ``POST /v1/audio/speech`` and ``WS /v1/audio/speech/stream`` (Orpheus-style streaming TTS).

The router validates requests with the engine's own checks (``audio.validate``: one home for each), splits text into sentences (``audio.text``), streams pcm16
events from the speech replica (:mod:`services.deployments.speech`) and shapes the responses
(:mod:`services.api.speech_stream`): chunked audio (``"stream": false`` sends the whole file at the end, with exact
sizes), SSE, or websocket events (:mod:`services.api.speech_session`; the socket is read concurrently with
synthesis, so a disconnect is seen at once).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from sse_starlette.sse import EventSourceResponse

from audio.config import TTSConfig
from audio.formats import MEDIA_TYPES, STREAMABLE, encode
from audio.text import split_sentences
from audio.validate import (SPEECH_FIELDS, SpeechInputError, check_fields, check_format, check_speakable,
                            check_speech, check_text)
from core.constants import SAMPLE_RATE

from ..config.profiles import FamilySection, Profile
from ..deployments.backends import Backend
from . import metrics
from .body import json_object
from .errors import APIError, raise_if_error_event, to_api_error
from .models import check_model
from .speech_session import SpeechSession
from .speech_stream import SpeechTiming, audio_chunks, audio_sse


def make_router(section: FamilySection, backend: Backend, profile: Profile) -> APIRouter:
    """Routes of the speech family: ``POST /v1/audio/speech`` and ``WS /v1/audio/speech/stream``."""
    router = APIRouter(tags=["speech"])
    cfg: TTSConfig = section.engine

    @router.post("/v1/audio/speech")
    async def create_speech(request: Request):
        """OpenAI speech: ``input``, ``voice``, ``response_format``, ``speed``, ``stream_format``, plus our
        ``seed`` and ``stream`` (``false``: the whole file at the end, a WAV header with exact sizes). Any
        other field (OpenAI's ``instructions`` included) is 400 ``unsupported_parameter``."""
        body = await json_object(request)
        try:
            check_fields(body, SPEECH_FIELDS)
            model_id = check_model(profile, "tts", body.get("model"))
            text = check_text(cfg, body.get("input"))
            voice, speed, seed = check_speech(cfg, body.get("voice"), body.get("speed"), body.get("seed"))
            fmt, stream_format = check_format(body.get("response_format"), body.get("stream_format"))
            streamed = body.get("stream", True)
            if not isinstance(streamed, bool):
                raise SpeechInputError("'stream' must be a boolean", "stream", "invalid_type")
            if not streamed and stream_format == "sse":
                raise SpeechInputError("'stream': false cannot be combined with stream_format 'sse'", "stream",
                                       "invalid_value")
            sentences = check_speakable(cfg, split_sentences(text, cfg.max_sentence_chars))
        except SpeechInputError as err:
            raise APIError(400, str(err), param=err.param, code=err.code) from None
        timing = SpeechTiming(model_id, "speech")
        stream = backend.stream("speak", sentences, voice, speed, seed, 0)
        try:
            first = await stream.__anext__()
            raise_if_error_event(first)  # input errors come as the first event, before any byte is sent
        except asyncio.CancelledError:  # the client went away
            await stream.aclose()
            raise
        except Exception as exc:  # noqa: BLE001
            await stream.aclose()
            raise to_api_error(exc) from None

        async def events():  # first event, then the rest
            try:
                yield first
                async for ev in stream:
                    yield ev
            finally:
                await stream.aclose()

        if stream_format == "sse":
            return EventSourceResponse(audio_sse(events(), fmt, timing), ping=15, sep="\n")
        if fmt in STREAMABLE and streamed:
            return StreamingResponse(audio_chunks(events(), fmt, timing), media_type=MEDIA_TYPES[fmt])
        pcm = bytearray()
        try:
            async for ev in events():
                raise_if_error_event(ev)
                if ev["type"] == "audio":
                    timing.audio(len(ev["pcm"]))
                    pcm += ev["pcm"]
                elif ev["type"] == "done":
                    timing.done(ev["usage"])
        except Exception as exc:  # noqa: BLE001
            raise to_api_error(exc) from None
        data = await asyncio.to_thread(encode, bytes(pcm), fmt, SAMPLE_RATE)
        return Response(data, media_type=MEDIA_TYPES[fmt])

    @router.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket):
        """Incremental text in, pcm16 24 kHz audio deltas out (events: see :class:`services.api.speech_session.SpeechSession`)."""
        await websocket.accept()
        metrics.TTS_WS_SESSIONS.labels(section.model_id).inc()
        try:
            await SpeechSession(websocket, section, backend, profile).run()
        finally:
            metrics.TTS_WS_SESSIONS.labels(section.model_id).dec()

    @router.api_route("/v1/audio/speech/stream", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                      include_in_schema=False)
    async def speech_stream_over_http(request: Request):
        """The websocket's path asked over plain HTTP: 426 ``websocket_required`` (with ``Upgrade: websocket``),
        not a 404 that would say the route does not exist."""
        raise APIError(426, f"{request.url.path} is a websocket endpoint: connect with ws:// (or wss://)",
                       code="websocket_required", headers={"Upgrade": "websocket", "Connection": "Upgrade"})

    return router
