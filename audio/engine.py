"""The speech engine: text -> sentences -> Orpheus audio tokens -> SNAC frames -> streamed 24 kHz audio.

One :class:`TTSEngine` serves the service, tests, notebooks and benchmarks. The speech LM is reached only through
an :class:`~core.llm_client.LLMClient` (``audio/backend.py`` picks it: in-process ``transformers`` or a ``vllm``
server the caller owns), read as audio tokens by :class:`audio.lm_stream.SpeechLM`. Each sentence is generated
with the constrained sampler and loop guard (:mod:`audio.generate`) and decoded while generating with a
2-left/2-right SNAC window (:mod:`audio.snac_stream`); every frame of every sentence is emitted, so nothing is lost
at joins.
Method: Orpheus TTS (canopyai/Orpheus-TTS), SNAC (hubertsiuzdak/snac).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.config import resolve_path
from core.constants import SAMPLE_RATE
from core.llm_client import LLMClient
from core.memory import DTYPES

from .backend import load_speech_lm
from .config import TTSConfig
from .formats import SpeedResampler
from .generate import Cancelled, SentenceReport, generate_frames
from .layout import TokenLayout
from .lm_stream import SpeechLM
from .snac_stream import BatchedSnacDecoder, StreamingDecoder, load_snac
from .text import clean_sentence, has_speech, split_sentences
from .validate import SpeechInputError, check_speakable, check_speech, check_text

__all__ = ["TTSEngine", "SpeechAudio", "SpeechDone", "Cancelled", "NoAudioError"]


class NoAudioError(RuntimeError):
    """A synthesis that had something to say produced no audio at all (every spoken sentence was a loop cut
    back to nothing by the loop guard; a sentence can never end before its first frame). Answered as HTTP 500
    ``no_audio``, never as an empty file: ``status_code``, ``code`` and ``param`` are read by the service."""

    status_code = 500
    code = "no_audio"
    param = None


@dataclass
class SpeechAudio:
    """A piece of audio: float32 ``(n,)`` samples in [-1, 1] at 24 kHz mono; ``sentence`` its index."""

    audio: np.ndarray
    sentence: int


@dataclass
class SpeechDone:
    """End of a synthesis; ``usage`` (JSON-able): ``input_characters``, ``sentences``, ``frames``,
    ``audio_seconds``, ``stripped_tags`` (tags not read aloud), ``loops`` (per looping sentence:
    ``sentence``, ``retries``, ``cut_short``), ``generation_seconds``."""

    usage: dict = field(default_factory=dict)


class TTSEngine:
    """Orpheus-layout LM + SNAC 24 kHz decoder.

    ``client``: the speech LM's :class:`~core.llm_client.LLMClient` (in-process:
    :class:`audio.local_client.TransformersSpeechClient`; or a vLLM server's), read through ``lm``, an
    :class:`audio.lm_stream.SpeechLM` of it; ``tokenizer``: the LM's text tokenizer; ``snac``: a ``snac.SNAC``
    model. Use :meth:`from_config` to load.
    ``snac_decoder``: the one :class:`audio.snac_stream.BatchedSnacDecoder` of this engine's concurrent
    syntheses (their windows ready together are decoded in one batched call; ``cfg.snac_batch_frames`` frames at
    most), or None when ``cfg.snac_batch_frames`` is 0 (each synthesis decodes in its own thread).
    ``frames_generated``: audio frames that reached the decoder since the engine was built, all syntheses
    together (a measure of work done: a cancelled synthesis stops adding to it).
    """

    def __init__(self, cfg: TTSConfig, client: LLMClient, tokenizer, snac):
        self.cfg, self.client, self.tokenizer, self.snac = cfg, client, tokenizer, snac
        self.lm = SpeechLM(client)
        self.layout = TokenLayout(cfg.layout)
        self.snac_decoder = BatchedSnacDecoder(snac, cfg.snac_batch_frames) if cfg.snac_batch_frames else None
        c = cfg.layout  # ids no client text may produce (see check_plain_text)
        self.control_ids = {c.start_of_speech, c.end_of_speech, c.start_of_human, c.end_of_human, c.start_of_ai,
                            c.end_of_ai, c.pad, c.end_of_text, *tokenizer.all_special_ids,
                            *(i for i, t in tokenizer.added_tokens_decoder.items() if t.content.strip())}
        self.frames_generated = 0
        self._frames_lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: TTSConfig, model_dir: str | Path, lm_client: LLMClient | None = None) -> "TTSEngine":
        """Load the LM's client (:func:`audio.backend.load_speech_lm`: the LM itself with ``cfg.backend ==
        "transformers"``; with ``vllm`` the client of the server that the serving layer started, ``lm_client``),
        the tokenizer with ``from_pretrained`` and SNAC with ``SNAC.from_pretrained``; relative paths resolve
        against ``model_dir``. Raises OSError when a checkpoint is missing (run ``chimera prepare``), ValueError
        when the vocabulary does not hold the layout or the vllm backend has no client."""
        from transformers import AutoTokenizer

        lm_path = resolve_path(model_dir, cfg.lm)
        layout = TokenLayout(cfg.layout)
        client, vocab = load_speech_lm(cfg.backend, lm_path, DTYPES[cfg.dtype], cfg.device, layout, lm_client)
        tok = AutoTokenizer.from_pretrained(resolve_path(model_dir, cfg.tokenizer) if cfg.tokenizer else lm_path)
        if vocab < layout.vocab_size_needed:
            raise ValueError(f"LM vocabulary ({vocab}) does not hold the token layout")
        snac = load_snac(resolve_path(model_dir, cfg.snac), device=cfg.device, noise=cfg.snac_noise)
        return cls(cfg, client, tok, snac)

    def close(self) -> None:
        """End the token streams' event-loop thread (:meth:`audio.lm_stream.SpeechLM.close`) and close the
        client (a vLLM server stops; nothing for the in-process LM). Idempotent."""
        self.lm.close()
        self.client.close()

    def ready(self) -> bool:
        """True when the LM can serve now (always for the in-process LM; the vLLM server's state otherwise)."""
        return self.client.state == "ready"

    async def stats(self) -> dict:
        """``backend``, ``frames`` (:attr:`frames_generated`), ``engine_requests`` (LM requests held now: the
        client's ``active``; None while unknown), ``generated_tokens`` and whatever else the client's
        :meth:`~core.llm_client.LLMClient.stats` tells (vLLM: ``engine_state``, ``engine_pid``,
        ``engine_restarts``)."""
        c = dict(await self.client.stats())
        return {"backend": c.pop("backend"), "frames": self.frames_generated, "engine_requests": c.pop("active"),
                **c}

    # --- request pieces -------------------------------------------------------------------------------------
    def prompt(self, voice: str, text: str) -> list[int]:
        """Prompt ids for ``text`` in ``voice`` (text tokenized alone; special ids added as ids).

        The client's text is always plain text: ``split_special_tokens=True`` makes the tokenizer read
        ``<|eot_id|>``, ``<|endoftext|>`` or any other special token's spelling as ordinary characters, so no
        text can forge a control id. The tokenizer's own template (Llama-3's ``<|begin_of_text|>``) is kept."""
        return self.layout.speech_prompt(self.tokenizer, voice, text)

    def check_plain_text(self, voice: str, text: str) -> None:
        """Raise SpeechInputError (``input``, ``reserved_token_text``) when ``"{voice}: {text}"`` would still
        tokenize to a control id (:attr:`control_ids`: the layout's special ids, the tokenizer's special and
        added tokens, or an audio id). ``split_special_tokens`` only splits *special* tokens, so this is the one
        case left: a tokenizer with a non-special added token, whose text cannot be sent as plain text."""
        ids = self.tokenizer(f"{voice}: {text}", add_special_tokens=False, split_special_tokens=True).input_ids
        bad = [i for i in ids if i in self.control_ids or self.layout.audio_start <= i < self.layout.audio_end]
        if bad:
            raise SpeechInputError(f"'input' holds {self.tokenizer.decode(bad[:1])!r}, which the speech model's "
                                   "tokenizer reads as a control token, not as text", "input", "reserved_token_text")

    def max_frames_for(self, text: str) -> int:
        """Maximum frames of a sentence: ``frames_per_char * len(text)`` within ``[min_frames, max_frames]``."""
        c = self.cfg
        return max(c.min_frames, min(c.max_frames, math.ceil(c.frames_per_char * len(text))))

    def split(self, text: str) -> list[str]:
        """Raw sentences of ``text`` (see :func:`audio.text.split_sentences`)."""
        return split_sentences(text, self.cfg.max_sentence_chars)

    # --- synthesis ------------------------------------------------------------------------------------------
    def synthesize(self, text: str, voice: str | None = None, speed: float = 1.0, seed: int | None = None,
                   cancel: threading.Event | None = None) -> Iterator[SpeechAudio | SpeechDone]:
        """Validate, split ``text`` into sentences and :meth:`speak` them. Raises SpeechInputError (ValueError),
        also when nothing is left to speak once unsupported tags are stripped (``empty_input``)."""
        check_text(self.cfg, text)
        return self.speak(check_speakable(self.cfg, self.split(text)), voice, speed, seed, cancel=cancel)

    def speak(self, sentences: list[str], voice: str | None = None, speed: float = 1.0, seed: int | None = None,
              first_index: int = 0, cancel: threading.Event | None = None) -> Iterator[SpeechAudio | SpeechDone]:
        """Synthesize raw ``sentences`` in order, yielding :class:`SpeechAudio` as it is decoded and a final
        :class:`SpeechDone`. Sentence ``first_index + i`` samples with seed ``seed + first_index + i`` (its
        retries ``+ 1`` each, all modulo 2**63: :func:`audio.generate.generate_frames`), so the same text split
        into any calls gives the same audio, on either backend. ``cancel`` stops within one token: raises
        :class:`Cancelled`. Raises SpeechInputError for a bad voice, speed or seed (:func:`audio.validate.check_speech`,
        ``|seed| < 2**63``) or text
        that cannot be sent as plain text (:meth:`check_plain_text`), and
        :class:`NoAudioError` (while iterating, before :class:`SpeechDone`) when sentences with something to say
        gave no sample at all."""
        voice, speed, seed = check_speech(self.cfg, voice, speed, seed)
        seed = self.cfg.seed if seed is None else seed
        if seed is None:
            seed = random.randrange(2**31)
        for raw in sentences:  # before any audio: an answer (400), not a broken stream
            self.check_plain_text(voice, clean_sentence(raw, self.cfg.tags)[0])
        return self._speak(sentences, voice, speed, seed, first_index, cancel)

    def _speak(self, sentences, voice, speed, seed, first_index, cancel):
        t0 = time.perf_counter()
        usage = {"input_characters": sum(len(s) for s in sentences), "sentences": 0, "frames": 0,
                 "audio_seconds": 0.0, "stripped_tags": [], "loops": []}
        resampler = SpeedResampler(speed)
        n_samples = 0
        for k, raw in enumerate(sentences):
            index = first_index + k
            text, stripped = clean_sentence(raw, self.cfg.tags)
            usage["stripped_tags"] += stripped
            if not has_speech(text):  # nothing left to say (only unsupported tags / punctuation)
                continue
            usage["sentences"] += 1
            report = SentenceReport()
            decoder = StreamingDecoder(self.snac_decoder or self.snac, chunk_frames=self.cfg.chunk_frames)
            frames = generate_frames(self.lm, self.layout, self.prompt(voice, text), self.cfg.sampling,
                                     self.cfg.loop_guard, self.max_frames_for(text), seed + index, cancel, report)
            for frame in frames:
                with self._frames_lock:
                    self.frames_generated += 1
                out = resampler.push(decoder.push(frame).numpy())
                if len(out):
                    n_samples += len(out)
                    yield SpeechAudio(out, index)
            out = resampler.push(decoder.flush().numpy())
            if len(out):
                n_samples += len(out)
                yield SpeechAudio(out, index)
            usage["frames"] += report.frames
            if report.loops:
                usage["loops"].append({"sentence": index, "retries": report.retries, "cut_short": report.cut_short})
        out = resampler.flush()
        if len(out):
            n_samples += len(out)
            yield SpeechAudio(out, first_index + max(0, len(sentences) - 1))
        usage["audio_seconds"] = round(n_samples / SAMPLE_RATE, 4)
        usage["generation_seconds"] = round(time.perf_counter() - t0, 4)
        if usage["sentences"] and not n_samples:
            raise NoAudioError("the speech model produced no audio for this input (the loop guard cut every "
                               "sentence back to nothing); try another seed")
        yield SpeechDone(usage)

