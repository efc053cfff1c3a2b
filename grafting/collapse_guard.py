"""Text collapse guard for chat: one token repeated ``min_run`` (default 4) or more times in a row.

Small LLMs (and big ones at low temperature) sometimes fall into emitting one token over and over
("the the the the ..."). The guard watches the LLM client's chunk stream (:class:`~core.llm_client.CompletionChunk`,
the same from either backend: :mod:`core.llm_client`) and, when a non-exempt token is about to make a run of
``min_run``:

1. the answer is rolled back to before the chunks holding the run's repeats (a word said once is fine; its
   repeats are dropped; a chunk of several tokens, as vLLM's speculative decoding sends, is dropped whole),
2. generation resumes from there - the prompt plus the kept answer tokens as the new prompt - with another seed
   (``seed + 1``; a request without a seed stays unseeded) and ``repetition_penalty`` raised by
   ``penalty_step`` (CTRL's penalty, :func:`grafting.generate.apply_repetition_penalty`; vLLM applies the same),
3. at most ``max_retries`` times (default once); collapsing again ends the answer there (``finish_reason``
   ``stop``, ``report.cut_short``).

This mirrors the speech family's loop guard (``audio/generate.py``: hold back what a retry may discard, roll back,
resume with a higher penalty). The client never sees retracted text: a chunk that leaves a run of two or more
open is held back until the run breaks, so the stream is delayed by at most ``min_run - 2`` tokens and only
inside a run. Runs of exempt tokens - those whose text, stripped of spaces, fully matches ``exempt_regex``
(default: whitespace, punctuation, digits) - are never held and never fire: markdown table rules (``|---|``),
indentation, ``....`` and numbers like ``10000`` (SmolLM2 writes digits one token each) are legitimate.

Text is detokenised once: until the first rollback the chunks keep the client's own text; a resumed attempt's
text is the guard's (:class:`~grafting.generate.TextStreamer` over all kept ids, stop strings included), so text
and stop strings are exact across the resume point. Without a collapse the chunks pass through unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from core.llm_client import CompletionChunk
from core.validate import SEED_LIMIT

from .config import CollapseGuardConfig
from .generate import SamplingParams, TextStreamer
from .processor import Prompt

#: ``start(kept_ids, retry)``: the chunks of one attempt; retry 0 is the request as asked, retry ``r > 0`` resumes
#: after ``kept_ids`` (the answer's ids released so far) with :func:`retry_params` ``(..., r)``.
Start = Callable[[list[int], int], AsyncIterator[CompletionChunk]]


@dataclass
class GuardReport:
    """What the guard did for one answer: ``collapses`` detected, ``retries`` started, ``cut_short`` (the last
    collapse ended the answer), ``dropped_tokens`` (repeats rolled back)."""

    collapses: int = 0
    retries: int = 0
    cut_short: bool = False
    dropped_tokens: int = 0


class RunDetector:
    """Tracks the current run of one token id. ``push(token_id)`` returns the run length including this token
    (0 when the token is exempt: exempt tokens reset the run and never count).

    Args: config: the guard's settings; token_text: id -> its text alone (e.g. ``tokenizer.decode([id])``),
        called once per distinct id (memoised).
    """

    def __init__(self, config: CollapseGuardConfig, token_text: Callable[[int], str]):
        self.exempt_re = re.compile(config.exempt_regex)
        self.token_text = token_text
        self._exempt: dict[int, bool] = {}
        self.token: int | None = None
        self.length = 0

    def exempt(self, token_id: int) -> bool:
        """True when ``token_id``'s text (stripped) fully matches ``exempt_regex``."""
        if token_id not in self._exempt:
            self._exempt[token_id] = self.exempt_re.fullmatch(self.token_text(token_id).strip()) is not None
        return self._exempt[token_id]

    def push(self, token_id: int) -> int:
        """Add the next token; the length of the run it extends or starts (0 for an exempt token)."""
        if self.exempt(token_id):
            self.token, self.length = None, 0
            return 0
        if token_id == self.token:
            self.length += 1
        else:
            self.token, self.length = token_id, 1
        return self.length

    def reset(self, ids: list[int]) -> None:
        """After a rollback: the run is the one ``ids`` (the kept answer) ends with."""
        self.token, self.length = None, 0
        if ids and not self.exempt(ids[-1]):
            self.token = ids[-1]
            for t in reversed(ids):
                if t != self.token:
                    break
                self.length += 1


def continuation(prompt: Prompt, kept_ids: list[int]) -> Prompt:
    """``prompt`` with the kept answer tokens appended to its ids (images, if any, unchanged: the appended ids
    hold no placeholder, since generated placeholder ids are suppressed)."""
    if not kept_ids:
        return prompt
    ids = torch.cat([prompt.input_ids, torch.tensor([kept_ids], dtype=prompt.input_ids.dtype)], dim=1)
    return dataclasses.replace(prompt, input_ids=ids)


def retry_params(params: SamplingParams, kept: int, config: CollapseGuardConfig, retry: int) -> SamplingParams:
    """Sampling settings of retry number ``retry`` (1-based): the token budget left after ``kept`` tokens, seed
    ``+ retry`` (mod 2**63; None stays None), repetition penalty raised by ``retry * penalty_step``."""
    seed = None if params.seed is None else (params.seed + retry) % SEED_LIMIT
    return dataclasses.replace(params, max_new_tokens=params.max_new_tokens - kept, seed=seed,
                               repetition_penalty=params.repetition_penalty + retry * config.penalty_step)


async def guard_chunks(start: Start, config: CollapseGuardConfig, tokenizer, stop: list[str], max_tokens: int,
                       report: GuardReport | None = None) -> AsyncIterator[CompletionChunk]:
    """Stream an answer's chunks through the collapse guard (see the module docstring).

    Args:
        start: opens one attempt (:data:`Start`); closing the iterator it returns must stop that generation (both
            clients do).
        config: ``vlm.engine.collapse_guard`` (``enabled`` false: the first attempt's chunks as they come);
        tokenizer: the LLM's (token texts for the exemption, a resumed answer's detokenisation); stop: the
        request's stop strings; max_tokens: its token budget; report: filled in as it goes.
    Yields: the chunks of :class:`~core.llm_client.CompletionChunk` (the last one the usage chunk, whose
    ``completion_tokens`` counts the kept answer tokens, the stop token included when the answer ends with one).
    Errors of ``start``'s iterators propagate unchanged.
    """
    report = report if report is not None else GuardReport()
    if not config.enabled:
        stream = start([], 0)
        try:
            async for c in stream:
                yield c
        finally:
            await stream.aclose()
        return
    runs = RunDetector(config, lambda i: tokenizer.decode([i]))
    kept: list[int] = []  # answer token ids released to the reader
    sent = 0  # characters of text released
    own: TextStreamer | None = None  # the answer's text from all kept ids, once an attempt resumed

    def release(c: CompletionChunk) -> CompletionChunk:
        nonlocal sent
        kept.extend(c.token_ids)
        if own is None:
            text, finish = c.text, c.finish_reason
        else:
            text, finish = "", c.finish_reason
            for t in c.token_ids:
                text += own.push(t)
                if own.stopped:
                    finish = "stop"  # a stop string completed across the resume point
                    break
            if finish is not None and not own.stopped:
                text += own.flush()
        sent += len(text)
        return dataclasses.replace(c, text=text, finish_reason=finish)

    retry = 0
    while True:
        base = len(kept)
        held: list[CompletionChunk] = []
        collapsed = False
        stream = start(list(kept), retry)
        try:
            async for c in stream:
                if c.completion_tokens is not None and not c.token_ids:  # the usage chunk
                    for h in held:
                        yield release(h)
                    yield dataclasses.replace(c, completion_tokens=base + c.completion_tokens)
                    return
                top = max((runs.push(t) for t in c.token_ids), default=runs.length)
                if top >= config.min_run:
                    held.append(c)
                    collapsed = True
                    break
                if runs.length >= 2 and c.finish_reason is None:  # a run is open: hold until it breaks
                    held.append(c)
                    continue
                for h in held + [c]:
                    yield release(h)
                    if own is not None and own.stopped:  # a stop string completed across the resume point
                        yield CompletionChunk("", [], None, None, len(kept))
                        return
                held = []
            else:  # the attempt ended without a usage chunk (the clients always send one)
                for h in held:
                    yield release(h)
                return
        finally:
            await stream.aclose()
        assert collapsed
        report.collapses += 1
        report.dropped_tokens += sum(len(h.token_ids) for h in held)
        runs.reset(kept)
        if own is None:
            own = TextStreamer(tokenizer, stop, ids=kept, sent=sent)
        if retry >= config.max_retries or max_tokens - len(kept) < 1:
            report.cut_short = True
            yield CompletionChunk(own.flush(), [], None, "stop")
            yield CompletionChunk("", [], None, None, len(kept))
            return
        retry += 1
        report.retries = retry
