"""Speech: ``POST /v1/audio/speech`` and ``WS /v1/audio/speech/stream`` (Orpheus-style streaming TTS).

The ``Deployment`` wraps :class:`audio.engine.TTSEngine` in a Ray Serve replica and streams pcm16 pieces from a
worker thread; closing its stream (client gone, ``response.cancel``) sets the engine's cancel event, which stops
generation within one token. The router validates requests (``audio.validate``), splits text into sentences
(``audio.text``) and shapes the responses: chunked audio (a streamed WAV header carries 0xFFFFFFFF
sizes; ``"stream": false`` sends the whole file at the end, with exact sizes), SSE
``speech.audio.delta``/``speech.audio.done`` events, or websocket events. The websocket is read concurrently with
synthesis, so a disconnect is seen at once (Ray Serve alone notices it only at the next receive).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from sse_starlette.sse import EventSourceResponse

from audio.config import TTSConfig
from audio.formats import MEDIA_TYPES, STREAMABLE, encode, to_pcm16, wav_header
from audio.text import SentenceBuffer, split_sentences
from audio.validate import (SESSION_FIELDS, SPEECH_FIELDS, SpeechInputError, check_fields, check_format,
                            check_speakable, check_speed, check_text, check_unicode, check_voice, speakable)
from core.constants import SAMPLE_RATE
from core.validate import check_seed

from . import metrics
from .app import check_model, json_object
from .backends import Backend
from .chat import input_error_event, raise_if_error_event
from .errors import APIError, error_body, to_api_error
from .profiles import FamilySection, Profile

log = logging.getLogger("chimera.speech")


class Deployment:
    """Ray Serve deployment of the speech engine (one engine per replica; requests run in worker threads).

    ``speak(...)`` is an async generator of ``{"type": "audio", "pcm": bytes, "sentence": int}`` (pcm16 24 kHz
    mono) and a final ``{"type": "done", "usage": {...}}``. An input error (SpeechInputError) is the only event,
    ``{"type": "error", ...}`` (:func:`services.chat.input_error_event`): it is an answer, not a replica failure,
    so Ray does not log it as one; so is :class:`audio.engine.NoAudioError` (500 ``no_audio``), which ends the
    stream in place of ``done``. Closing the generator stops generation before the next token.
    """

    def __init__(self, section: dict, model_dir: str):
        import torch

        from audio.engine import TTSEngine

        cfg = FamilySection[TTSConfig].model_validate(section)
        if cfg.deployment.torch_threads:
            torch.set_num_threads(cfg.deployment.torch_threads)
        self.server = self.lm_client = None  # the vLLM server process this replica owns (backend vllm)
        if cfg.engine.backend == "vllm":
            from .vllm_server import start_vllm_for

            self.lm_client = start_vllm_for(cfg.engine, model_dir)
            self.server = self.lm_client.server
        try:
            self.engine = TTSEngine.from_config(cfg.engine, model_dir, lm_client=self.lm_client)
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise
        self.running = 0  # syntheses whose worker thread is alive
        self._count_lock = threading.Lock()

    async def ready(self) -> bool:
        """True once the engine is loaded (the constructor has returned) and, with the ``vllm`` backend, while
        its server process is up and healthy."""
        return self.engine.ready()

    def check_health(self) -> None:
        """Ray Serve's periodic replica health check: RuntimeError when the vllm backend's server has given up
        (state ``failed``), so that Ray replaces the replica."""
        if self.server is not None and self.server.state == "failed":
            raise RuntimeError(f"the vLLM server failed: {self.server.last_error}")

    async def stats(self) -> dict:
        """``backend``, ``active`` syntheses (worker threads alive), ``frames``: audio frames generated so far
        (:attr:`audio.engine.TTSEngine.frames_generated`, a measure of work done) and, with vllm,
        ``engine_requests``: the requests vLLM holds (running + waiting, from its ``/metrics``; None while it is
        down)."""
        out = {"backend": self.engine.cfg.backend, "active": self.running, "frames": self.engine.frames_generated}
        if self.lm_client is not None:
            from core.llm_client import EngineUnavailableError

            try:
                out["engine_requests"] = await self.lm_client.requests_in_engine()
            except EngineUnavailableError:
                out["engine_requests"] = None
        return out

    def __del__(self):
        """Replica shutdown: close the engine (the vllm backend's stream loop), then stop the vLLM server process
        this replica owns."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()

    async def active(self) -> int:
        """Number of syntheses running now (their worker threads alive): 0 once every client is gone."""
        return self.running

    async def speak(self, sentences: list[str], voice: str | None = None, speed: float = 1.0,
                    seed: int | None = None, first_index: int = 0):
        """Synthesize raw ``sentences`` (see :meth:`audio.engine.TTSEngine.speak`), streaming pcm16 events."""
        from audio.engine import NoAudioError, SpeechDone

        cancel = threading.Event()
        try:
            events = self.engine.speak(sentences, voice, speed, seed, first_index, cancel)  # validates now
        except ValueError as exc:  # bad input: answered as a 4xx event, not logged as a replica failure
            yield input_error_event(exc)
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def worker():
            try:
                for ev in events:
                    loop.call_soon_threadsafe(queue.put_nowait, ev)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                with self._count_lock:
                    self.running -= 1

        thread = threading.Thread(target=worker, name="tts-generate", daemon=True)
        with self._count_lock:
            self.running += 1
        thread.start()
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, NoAudioError):  # answered (500 no_audio), not a replica failure
                    yield input_error_event(ev)
                    return
                if isinstance(ev, BaseException):
                    raise ev
                if isinstance(ev, SpeechDone):
                    yield {"type": "done", "usage": ev.usage}
                    return
                yield {"type": "audio", "pcm": to_pcm16(ev.audio), "sentence": ev.sentence}
        finally:
            cancel.set()
            await asyncio.to_thread(thread.join, 30)


class _Timing:
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
            voice = check_voice(cfg, body.get("voice"))
            speed = check_speed(cfg, body.get("speed"))
            fmt, stream_format = check_format(body.get("response_format"), body.get("stream_format"))
            seed = check_seed(body.get("seed"), SpeechInputError)
            streamed = body.get("stream", True)
            if not isinstance(streamed, bool):
                raise SpeechInputError("'stream' must be a boolean", "stream", "invalid_type")
            if not streamed and stream_format == "sse":
                raise SpeechInputError("'stream': false cannot be combined with stream_format 'sse'", "stream",
                                       "invalid_value")
            sentences = check_speakable(cfg, split_sentences(text, cfg.max_sentence_chars))
        except SpeechInputError as err:
            raise APIError(400, str(err), param=err.param, code=err.code) from None
        timing = _Timing(model_id, "speech")
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
            return EventSourceResponse(_sse(events(), fmt, timing), ping=15, sep="\n")
        if fmt in STREAMABLE and streamed:
            return StreamingResponse(_chunks(events(), fmt, timing), media_type=MEDIA_TYPES[fmt])
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
        """Incremental text in, pcm16 24 kHz audio deltas out (events: see ``_Session`` and the README)."""
        await websocket.accept()
        metrics.TTS_WS_SESSIONS.labels(section.model_id).inc()
        try:
            await _Session(websocket, section, backend, profile).run()
        finally:
            metrics.TTS_WS_SESSIONS.labels(section.model_id).dec()

    return router


async def _chunks(events, fmt: str, timing: _Timing):
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


async def _sse(events, fmt: str, timing: _Timing):
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


# Fields of each client event (any other is an ``unsupported_parameter`` error; ``session`` is checked too).
_EVENT_FIELDS = {"session.update": ("type", "session"), "input_text.append": ("type", "text"),
                 "input_text.commit": ("type",), "input_text.clear": ("type",), "response.cancel": ("type",)}


class _Session:
    """One websocket session: a reader (client events) and a speaker (synthesis) run concurrently.

    Complete sentences start synthesizing as soon as they are in the buffer; ``input_text.commit`` sends the
    rest and ends the utterance (one ``response.audio.done`` per commit). ``response.cancel`` stops the
    utterance in progress, the oldest one without its ``response.audio.done`` (its synthesis running, its queued
    sentences and, when it is the uncommitted one, the buffer): it gets a ``cancelled`` done at once, and the
    utterances after it still play. Nothing in progress: the buffer is cleared and a ``cancelled`` done with
    ``response_id`` null is sent. A synthesis error (e.g.
    ``no_audio``) is an ``error`` event and that utterance's ``response.audio.done`` has ``status: "failed"``.
    Every client event and ``session`` field is checked: another field is ``unsupported_parameter``, text that is
    not valid Unicode ``invalid_unicode`` (nothing of the event is applied). Recoverable errors are
    sent as ``error`` events and the socket stays open. A disconnect cancels everything at once.

    Limits (profile ``server.limits``, :class:`services.profiles.EdgeLimits`): a client frame over
    ``ws_max_message_bytes`` closes the socket with code 1009; a commit while ``ws_max_pending_commits``
    committed utterances still wait for their ``response.audio.done`` is an error ``too_many_commits`` (that
    commit is not applied: the text stays in the buffer); no client frame for ``ws_idle_timeout_s`` while no
    audio is queued or being made closes it with code 1001.
    """

    def __init__(self, ws: WebSocket, section: FamilySection, backend: Backend, profile: Profile):
        self.ws, self.section, self.backend, self.profile = ws, section, backend, profile
        self.cfg: TTSConfig = section.engine
        self.session = {"id": f"sess_{uuid.uuid4().hex[:24]}", "model": section.model_id,
                        "voice": self.cfg.default_voice, "speed": 1.0, "seed": self.cfg.seed,
                        "sample_rate": SAMPLE_RATE, "format": "pcm16"}
        self.buffer = SentenceBuffer(self.cfg.max_sentence_chars)
        self.chars = 0  # characters appended to the current utterance
        self.speakable = False  # some dispatched sentence of the current utterance has text left after tag stripping
        self.queue: asyncio.Queue = asyncio.Queue()
        self.send_lock = asyncio.Lock()
        self.response_id: str | None = None
        self.next_index = 0  # sentence index within the current utterance (seeds)
        self.open: dict[str, bool] = {}  # utterances without their done yet, oldest first -> committed
        self.cancelled: set[str] = set()  # cancelled utterances whose queued items the speaker still skips
        self.current: asyncio.Task | None = None
        self.speaking: str | None = None  # response id being synthesized
        self.limits = profile.server.limits
        self.pending_commits = 0  # commits whose response.audio.done is not sent yet

    async def send(self, obj: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps(obj))

    async def error(self, message: str, code: str, param: str | None = None,
                    type: str = "invalid_request_error") -> None:
        await self.send({"type": "error", "error": {"message": message, "type": type, "code": code, "param": param}})

    async def run(self) -> None:
        await self.send({"type": "session.created", "session": dict(self.session)})
        speaker = asyncio.create_task(self.speaker())
        try:
            while True:
                try:
                    async with asyncio.timeout(self.limits.ws_idle_timeout_s):  # no extra task, unlike wait_for
                        msg = await self.ws.receive()
                except TimeoutError:
                    if self.speaking is not None or not self.queue.empty():
                        continue  # audio is still being made: not idle
                    return await self.ws.close(1001, "idle timeout")
                if msg["type"] == "websocket.disconnect":
                    return
                size = len(msg.get("bytes") or b"") + len((msg.get("text") or "").encode("utf-8", "surrogatepass"))
                if size > self.limits.ws_max_message_bytes:
                    return await self.ws.close(1009, f"message over {self.limits.ws_max_message_bytes} bytes")
                if msg.get("bytes") is not None:
                    await self.error("binary frames are not supported; send JSON text frames", "binary_not_supported")
                    continue
                await self.handle(msg.get("text") or "")
        except Exception as exc:  # noqa: BLE001 - e.g. the socket broke while sending
            log.info("speech websocket closed: %s", type(exc).__name__)
        finally:
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)

    async def handle(self, text: str) -> None:
        try:
            event = json.loads(text)
        except json.JSONDecodeError as err:
            return await self.error(f"malformed JSON: {err}", "invalid_json")
        if not isinstance(event, dict):
            return await self.error("each message must be a JSON object with a string 'type'", "invalid_event")
        try:
            check_unicode(event, "")
            if not isinstance(event.get("type"), str):
                return await self.error("each message must be a JSON object with a string 'type'", "invalid_event")
            kind = event["type"]
            if kind in _EVENT_FIELDS:
                check_fields(event, _EVENT_FIELDS[kind])
            if kind == "session.update":
                await self.update(event.get("session"))
            elif kind == "input_text.append":
                await self.append(event.get("text"))
            elif kind == "input_text.commit":
                await self.commit()
            elif kind == "input_text.clear":
                self.buffer.clear()
            elif kind == "response.cancel":
                await self.cancel()
            else:
                await self.error(f"unknown event type {kind!r}", "unknown_event", "type")
        except SpeechInputError as err:
            await self.error(str(err), err.code or "invalid_value", err.param)
        except APIError as err:
            await self.error(err.message, err.code or "invalid_value", err.param, err.type)

    async def update(self, s: Any) -> None:
        if not isinstance(s, dict):
            raise SpeechInputError("'session' must be an object", "session", "invalid_value")
        check_fields(s, SESSION_FIELDS, "session")
        new = dict(self.session)
        if "model" in s:
            new["model"] = check_model(self.profile, "tts", s["model"])
        if "voice" in s:
            new["voice"] = check_voice(self.cfg, s["voice"])
        if "speed" in s:
            new["speed"] = check_speed(self.cfg, s["speed"])
        if "seed" in s:
            new["seed"] = check_seed(s["seed"], SpeechInputError)
        self.session = new
        await self.send({"type": "session.updated", "session": dict(new)})

    def _response(self) -> str:
        if self.response_id is None:
            self.response_id = f"resp_{uuid.uuid4().hex[:24]}"
            self.next_index = 0
            self.open[self.response_id] = False
        return self.response_id

    def _dispatch(self, sentences: list[str]) -> None:
        if sentences:
            self.speakable = self.speakable or any(speakable(self.cfg, x) for x in sentences)
            rid = self._response()
            self.queue.put_nowait(("speak", rid, sentences, self.next_index, dict(self.session)))
            self.next_index += len(sentences)

    async def append(self, text: Any) -> None:
        if not isinstance(text, str):
            raise SpeechInputError("'text' must be a string", "text", "invalid_type")
        if self.chars + len(text) > self.cfg.max_input_chars:
            raise SpeechInputError(f"the utterance would exceed {self.cfg.max_input_chars} characters; commit first",
                                   "text", "input_too_long")
        self.chars += len(text)
        self._dispatch(self.buffer.append(text))

    async def commit(self) -> None:
        """End the utterance: one ``response.audio.done``; an ``empty_input`` error instead (and no done) when
        nothing in it is left to speak once unsupported tags are stripped; ``too_many_commits`` (buffer kept)
        when ``ws_max_pending_commits`` utterances still wait for audio."""
        if self.pending_commits >= self.limits.ws_max_pending_commits:
            raise SpeechInputError(f"{self.pending_commits} committed utterances are still waiting for audio (the "
                                   f"limit is {self.limits.ws_max_pending_commits}); commit again after a "
                                   "response.audio.done", None, "too_many_commits")
        rest = self.buffer.finish()
        if not (self.speakable or any(speakable(self.cfg, x) for x in rest)):
            if self.response_id is not None:  # tag-only sentences already queued: drop their response
                self.open.pop(self.response_id, None)
                self.queue.put_nowait(("drop", self.response_id))
            self.response_id, self.chars, self.speakable = None, 0, False
            raise SpeechInputError("nothing to speak: append text first (unsupported tags are not read aloud)",
                                   "text", "empty_input")
        self._dispatch(rest)
        self.pending_commits += 1
        rid = self._response()
        self.open[rid] = True
        self.queue.put_nowait(("done", rid))
        self.response_id, self.chars, self.speakable = None, 0, False

    async def cancel(self) -> None:
        """``response.cancel``: stop the utterance in progress (see the class docstring); later ones still play."""
        rid = next(iter(self.open), None)
        if rid is None or rid == self.response_id:  # the uncommitted utterance (or only buffered text)
            self.buffer.clear()
            self.response_id, self.chars, self.speakable = None, 0, False
        if rid is not None:
            if self.open.pop(rid):
                self.pending_commits -= 1
            else:  # uncommitted: no "done" item will come to end its skipping
                self.queue.put_nowait(("drop", rid))
            self.cancelled.add(rid)
            if self.speaking == rid and self.current is not None:
                self.current.cancel()
        await self.send({"type": "response.audio.done", "response_id": rid, "status": "cancelled", "usage": None})

    async def speaker(self) -> None:
        usage: dict[str, dict] = {}
        failed: set[str] = set()  # responses that had an error event: their done says "failed"
        while True:
            item = await self.queue.get()
            kind, rid = item[0], item[1]
            if kind == "drop" or (kind == "done" and rid in self.cancelled):  # its last item; no done to send
                usage.pop(rid, None)
                failed.discard(rid)
                self.cancelled.discard(rid)
                continue
            if rid in self.cancelled:  # a sentence of a cancelled utterance
                continue
            u = usage.setdefault(rid, {"audio_seconds": 0.0, "sentences": 0, "stripped_tags": [], "loops": []})
            if kind == "done":
                usage.pop(rid, None)
                self.open.pop(rid, None)
                self.pending_commits -= 1
                u["audio_seconds"] = round(u["audio_seconds"], 4)
                status = "failed" if rid in failed else "completed"
                failed.discard(rid)
                await self.send({"type": "response.audio.done", "response_id": rid, "status": status, "usage": u})
                continue
            _, rid, sentences, first_index, sess = item
            self.speaking = rid
            self.current = asyncio.create_task(self.speak(rid, sentences, first_index, sess, u))
            try:
                await self.current
            except asyncio.CancelledError:
                if rid not in self.cancelled or asyncio.current_task().cancelling():
                    raise  # the session itself is closing (not a response.cancel)
            except Exception as exc:  # noqa: BLE001 - report and keep the socket
                if rid not in self.cancelled:  # after its cancelled done, nothing more of it is sent
                    err = to_api_error(exc)
                    failed.add(rid)
                    await self.error(err.message, err.code or "synthesis_failed", err.param, err.type)
            finally:
                self.current, self.speaking = None, None

    async def speak(self, rid: str, sentences: list[str], first_index: int, sess: dict, u: dict) -> None:
        timing = _Timing(self.section.model_id, "speech_ws")
        stream = self.backend.stream("speak", sentences, sess["voice"], sess["speed"], sess["seed"], first_index)
        try:
            async for ev in stream:
                raise_if_error_event(ev)
                if ev["type"] == "audio" and ev["pcm"]:
                    timing.audio(len(ev["pcm"]))
                    await self.send({"type": "response.audio.delta", "response_id": rid,
                                     "delta": base64.b64encode(ev["pcm"]).decode()})
                elif ev["type"] == "done":
                    timing.done(ev["usage"])
                    uu = ev["usage"]
                    u["audio_seconds"] += uu.get("audio_seconds", 0.0)
                    u["sentences"] += uu.get("sentences", 0)
                    u["stripped_tags"] += uu.get("stripped_tags", [])
                    u["loops"] += uu.get("loops", [])
        finally:
            await stream.aclose()
