"""The speech replica: one :class:`audio.engine.TTSEngine` per replica, synthesizing in worker threads and
streaming pcm16 events (:mod:`services.api.speech` shapes them into audio bodies, SSE or websocket events)."""

from __future__ import annotations

import threading
from contextlib import aclosing

from audio.config import TTSConfig
from audio.formats import to_pcm16

from ..config.profiles import FamilySection
from .base import EngineDeployment, iterate_in_thread
from .events import input_error_event


class Deployment(EngineDeployment):
    """Ray Serve deployment of the speech engine (one engine per replica; requests run in worker threads).

    ``speak(...)`` is an async generator of ``{"type": "audio", "pcm": bytes, "sentence": int}`` (pcm16 24 kHz
    mono) and a final ``{"type": "done", "usage": {...}}``. An input error (SpeechInputError) is the only event,
    ``{"type": "error", ...}`` (:func:`services.deployments.events.input_error_event`): it is an answer, not a replica failure,
    so Ray does not log it as one; so is :class:`audio.engine.NoAudioError` (500 ``no_audio``), which ends the
    stream in place of ``done``. Closing the generator stops generation before the next token.
    """

    def __init__(self, section: dict, model_dir: str, hold_until_ready: bool = False):
        from audio.backend import needs_engine_process
        from audio.engine import TTSEngine

        cfg = FamilySection[TTSConfig].model_validate(section)
        self._start_engine(cfg.engine, model_dir, needs_engine_process(cfg.engine.backend),
                           lambda client: TTSEngine.from_config(cfg.engine, model_dir, lm_client=client),
                           cfg.deployment.torch_threads, hold_until_ready)
        self.running = 0  # syntheses whose worker thread is alive
        self._count_lock = threading.Lock()

    async def stats(self) -> dict:
        """``active`` syntheses (worker threads alive), then the engine's counters
        (:meth:`audio.engine.TTSEngine.stats`): ``backend``, ``frames`` generated so far (a measure of work done),
        ``engine_requests`` (LM requests held now), ``generated_tokens``, and with vllm the server's state."""
        return {"active": self.running, **await self.engine.stats()}

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

        def started():
            with self._count_lock:
                self.running += 1

        def ended():
            with self._count_lock:
                self.running -= 1

        try:
            async with aclosing(iterate_in_thread(events, "tts-generate", cancel, started, ended)) as stream:
                async for ev in stream:
                    if isinstance(ev, SpeechDone):
                        yield {"type": "done", "usage": ev.usage}
                        return
                    yield {"type": "audio", "pcm": to_pcm16(ev.audio), "sentence": ev.sentence}
        except NoAudioError as exc:  # answered (500 no_audio), not a replica failure
            yield input_error_event(exc)
