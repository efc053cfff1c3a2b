"""Audio-token generation for an Orpheus-layout LM: constrained sampling, KV-cache decode, loop guard.

- :class:`AudioPositionLogitsProcessor` allows only the audio ids of the current frame position (and
  end_of_speech only at a frame boundary after the first frame), so the token stream can never fall out of
  frame alignment and a sentence can never end before any audio, whatever the model does. It is combined
  with transformers' repetition penalty, temperature and top-p processors.
- :func:`stream_tokens` prefills once and decodes token by token with the KV cache (HF ``DynamicCache``),
  sampling over just the allowed ids (:func:`candidate_probs`, equal to the full-vocabulary processors).
- :func:`find_loop` is the loop guard: "same token 4+ times in a row" (the reference check) can never fire on
  audio, since each frame position has its own id range, so it looks for repeated frames and short periodic
  frame patterns instead.
- :func:`generate_frames` runs one sentence, its tokens read from :class:`audio.lm_stream.SpeechLM` whichever
  backend serves it (the in-process client decodes with :func:`stream_tokens`; vLLM runs the constraint as a
  logits processor): frames are held back ``window_frames`` frames (what a retry may discard); when the guard
  fires the sentence is rolled back to where the loop began and resumed with a higher repetition penalty and the
  next seed, at most ``max_retries`` times, then cut short there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from core.validate import SEED_LIMIT

from .config import LoopGuardConfig, SamplingConfig
from .layout import FrameParser, TokenLayout


class Cancelled(Exception):
    """Generation was cancelled (client went away or asked to stop)."""


class AudioPositionLogitsProcessor(LogitsProcessor):
    """Mask every id except the audio ids of frame position ``n_generated % 7`` (``n_generated`` = tokens after
    the prompt) and, at a frame boundary after at least one frame, end_of_speech (unless ``allow_end`` is
    False). end_of_speech straight after the prompt would be a sentence with no audio at all (a 44-byte WAV):
    it is never a candidate, so the first frame is sampled from the audio ids alone (the model's distribution
    conditioned on not ending at once).

    ``scores``: float ``(batch, vocab)``; returns the masked scores (same shape, -inf elsewhere). A drop-in for
    ``model.generate(logits_processor=...)``; :func:`stream_tokens` samples the same distribution faster
    through :func:`candidate_probs`."""

    def __init__(self, layout: TokenLayout, prompt_len: int, allow_end: bool = True):
        self.layout, self.prompt_len, self.allow_end = layout, prompt_len, allow_end

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        pos = (input_ids.shape[1] - self.prompt_len) % self.layout.positions
        lo, hi = self.layout.position_range(pos)
        masked = torch.full_like(scores, float("-inf"))
        masked[:, lo:hi] = scores[:, lo:hi]
        if ends_allowed(input_ids.shape[1] - self.prompt_len, self.layout, self.allow_end):
            e = self.layout.end_of_speech
            masked[:, e] = scores[:, e]
        return masked


def ends_allowed(n_generated: int, layout: TokenLayout, allow_end: bool = True) -> bool:
    """Whether end_of_speech may follow ``n_generated`` audio tokens: at a frame boundary, after at least one
    complete frame (``n_generated`` a positive multiple of ``layout.positions``), and only if ``allow_end``."""
    return allow_end and n_generated > 0 and n_generated % layout.positions == 0


def make_processors(layout: TokenLayout, prompt_len: int, sampling: SamplingConfig,
                    allow_end: bool = True) -> LogitsProcessorList:
    """Position mask, then repetition penalty (Keskar et al. 2019, CTRL), temperature, top-p (Holtzman et al.)."""
    procs = LogitsProcessorList([AudioPositionLogitsProcessor(layout, prompt_len, allow_end)])
    if sampling.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.temperature > 0:
        procs.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_p < 1.0:
            procs.append(TopPLogitsWarper(sampling.top_p))
    return procs


def candidate_probs(logits: torch.Tensor, ids: torch.Tensor, prompt_len: int, sampling: SamplingConfig,
                    layout: TokenLayout, allow_end: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token distribution restricted to the ids :class:`AudioPositionLogitsProcessor` allows.

    ``logits``: float ``(vocab,)`` of the last position; ``ids``: long ``(1, seq)`` prompt + generated ids.
    Returns ``(candidate_ids (k,), probs (k,) float32)``, k = 4096 (+1 for end_of_speech where
    :func:`ends_allowed`).
    Identical to running :func:`make_processors` over the whole vocabulary and softmaxing (masked ids have
    probability 0), but sorts and samples 4k entries instead of the vocabulary (Llama-3: 157k): about 2x
    faster decoding on the cpu profile. Temperature 0: all mass on the argmax."""
    pos = (ids.shape[1] - prompt_len) % layout.positions
    lo, hi = layout.position_range(pos)
    cand = torch.arange(lo, hi, device=logits.device)
    if ends_allowed(ids.shape[1] - prompt_len, layout, allow_end):
        cand = torch.cat([cand, torch.tensor([layout.end_of_speech], device=logits.device)])
    scores = logits[cand].float()[None]
    gen = ids[0, prompt_len:]
    if sampling.repetition_penalty != 1.0 and len(gen):
        in_range = gen[(gen >= lo) & (gen < hi)] - lo  # earlier tokens, as candidate indices
        if len(in_range):
            scores = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(in_range[None], scores)
    if sampling.temperature <= 0:
        probs = torch.zeros_like(scores[0])
        probs[scores[0].argmax()] = 1.0
        return cand, probs
    scores = TemperatureLogitsWarper(sampling.temperature)(ids, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(ids, scores)
    return cand, torch.softmax(scores[0], dim=-1)


@torch.inference_mode()
def stream_tokens(model, input_ids: list[int], prompt_len: int, sampling: SamplingConfig, layout: TokenLayout,
                  generator: torch.Generator | None = None, allow_end: bool = True) -> Iterator[int]:
    """Prefill ``input_ids`` (prompt + any audio tokens kept from an earlier attempt), then sample audio token
    ids one by one with the KV cache (HF ``DynamicCache``), forever: the caller stops by closing the iterator.
    ``prompt_len`` marks where audio starts (frame alignment). See :func:`candidate_probs`."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = torch.tensor([input_ids], dtype=torch.long, device=dev)
    cache = DynamicCache()
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    while True:
        cand, probs = candidate_probs(out.logits[0, -1], ids, prompt_len, sampling, layout, allow_end)
        k = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        nxt = cand[k : k + 1][None]
        ids = torch.cat([ids, nxt], dim=1)
        yield int(nxt)
        out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)


def find_loop(frames: list[tuple[int, ...]], window: int, max_period: int) -> int | None:
    """Loop guard check on the newest frame. If the last ``window`` frames repeat with a period of at most
    ``max_period`` frames, return the index of the first frame of the periodic run (where the loop began,
    the first occurrence of the pattern included); else None."""
    n = len(frames)
    if n < window:
        return None
    for p in range(1, max_period + 1):
        if all(frames[i] == frames[i - p] for i in range(n - window + p, n)):
            s = n - window
            while s > 0 and frames[s - 1] == frames[s - 1 + p]:
                s -= 1
            return s
    return None


@dataclass
class SentenceReport:
    """What happened to one sentence: ``frames`` generated and kept, ``retries`` after a loop, ``cut_short``
    when the loop persisted, ``finish`` = ``stop`` (end_of_speech) | ``length`` (max frames) | ``loop``."""

    frames: int = 0
    retries: int = 0
    cut_short: bool = False
    finish: str = "length"
    loops: list[int] = field(default_factory=list)  # frame index where each detected loop began


def generate_frames(lm, layout: TokenLayout, prompt: list[int], sampling: SamplingConfig,
                    guard: LoopGuardConfig, max_frames: int, seed: int | None = None,
                    cancel: threading.Event | None = None,
                    report: SentenceReport | None = None) -> Iterator[list[int]]:
    """Yield the frames (lists of 7 SNAC codes) of one sentence, each at most once and never retracted.

    ``lm``: an :class:`audio.lm_stream.SpeechLM` (or anything with its ``stream_tokens(ids, prompt_len,
    sampling, layout, seed, max_tokens, cancel)``). Each attempt is one request, seeded ``(seed + retries) %
    2**63`` (None: unseeded), closed when the attempt ends, so a retry aborts and resubmits it: the same on both
    backends.

    Frames are held back while they are among the newest ``guard.window_frames`` (a loop detected later may
    start there); all are released at the end. Raises :class:`Cancelled` when ``cancel`` is set (checked
    every token). ``report`` (a :class:`SentenceReport`) is filled in as it goes."""
    report = report if report is not None else SentenceReport()
    hold = guard.window_frames if guard.enabled else 0
    frames: list[tuple[int, ...]] = []
    released = 0
    penalty = sampling.repetition_penalty
    while True:  # one attempt per iteration (retries resume from the loop start)
        s = sampling.model_copy(update={"repetition_penalty": penalty})
        ids = list(prompt) + [t for f in frames for t in layout.frame_ids(list(f))]
        parser = FrameParser(layout)
        attempt_seed = None if seed is None else (seed + report.retries) % SEED_LIMIT
        tokens = lm.stream_tokens(ids, len(prompt), s, layout, attempt_seed,
                                  (max_frames - len(frames)) * layout.positions, cancel)
        loop_at = None
        try:
            for tok in tokens:
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                frame = parser.push(tok)
                if parser.done:
                    report.finish = "stop"
                    break
                if frame is None:
                    continue
                frames.append(tuple(frame))
                if guard.enabled:
                    loop_at = find_loop(frames, guard.window_frames, guard.max_period_frames)
                    if loop_at is not None:
                        break
                while released < len(frames) - hold:
                    yield list(frames[released])
                    released += 1
                if len(frames) >= max_frames:
                    report.finish = "length"
                    break
        finally:
            tokens.close()
        if loop_at is None:
            break
        cut = max(loop_at, released)
        report.loops.append(cut)
        del frames[cut:]
        if report.retries >= guard.max_retries:
            report.cut_short, report.finish = True, "loop"
            break
        report.retries += 1
        penalty += guard.penalty_step
    while released < len(frames):
        yield list(frames[released])
        released += 1
    report.frames = len(frames)
