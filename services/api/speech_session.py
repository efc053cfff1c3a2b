"""The speech websocket (``WS /v1/audio/speech/stream``): one session per socket, text in incrementally, pcm16
audio deltas out while the text is still arriving (event protocol: ``docs/api/speech.md``)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from typing import Any

from fastapi import WebSocket

from audio.config import TTSConfig
from audio.text import SentenceBuffer
from audio.validate import SESSION_FIELDS, SpeechInputError, check_fields, check_speech, check_unicode, speakable
from core.constants import SAMPLE_RATE

from ..config.profiles import FamilySection, Profile
from ..deployments.backends import Backend
from .body import JSONDuplicateKey, duplicate_error, parse_json
from .errors import APIError, raise_if_error_event, to_api_error
from .models import check_model
from .speech_stream import SpeechTiming

log = logging.getLogger("chimera.speech")


# Fields of each client event (any other is an ``unsupported_parameter`` error; ``session`` is checked too).
_EVENT_FIELDS = {"session.update": ("type", "session"), "input_text.append": ("type", "text"),
                 "input_text.commit": ("type",), "input_text.clear": ("type",), "response.cancel": ("type",)}


class SpeechSession:
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

    Limits (profile ``server.limits``, :class:`services.config.profiles.EdgeLimits`): a client frame over
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
            event = parse_json(text)
        except JSONDuplicateKey as err:
            dup = duplicate_error(err.key, "in the event")
            return await self.error(dup.message, dup.code, dup.param)
        except ValueError as err:
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
        new["voice"], new["speed"], new["seed"] = check_speech(  # the engine's own checks
            self.cfg, s.get("voice", new["voice"]), s.get("speed", new["speed"]), s.get("seed", new["seed"]))
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
        """``response.cancel``: stop the utterance in progress (see the class docstring); later ones still play.
        With no utterance in progress (nothing committed and playing, no complete sentence appended) it is an
        ``error`` event ``response_cancel_not_active`` (OpenAI Realtime's code), after clearing any partial
        sentence in the buffer; no ``response.audio.done`` is sent for a response that never existed."""
        rid = next(iter(self.open), None)
        if rid is None:
            cleared = self.chars
            self.buffer.clear()
            self.response_id, self.chars, self.speakable = None, 0, False
            return await self.error("there is no response in progress to cancel" + (
                f" (the {cleared} uncommitted characters in the buffer were cleared)" if cleared else ""),
                "response_cancel_not_active")
        if rid == self.response_id:  # the uncommitted utterance
            self.buffer.clear()
            self.response_id, self.chars, self.speakable = None, 0, False
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
        timing = SpeechTiming(self.section.model_id, "speech_ws")
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
