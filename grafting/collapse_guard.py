"""Text collapse guard for chat: one token repeated ``min_run`` (default 4) or more times in a row.

Small LLMs (and big ones at low temperature) sometimes fall into emitting one token over and over
("the the the the ..."). The guard watches the token stream of either backend (the :class:`~grafting.generate.Delta`
events of ``generate_stream`` / the batcher / the vLLM backend) and, when a non-exempt token is about to make a
run of ``min_run``:

1. the answer is rolled back to the run's first token (a word said once is fine; its repeats are dropped),
2. generation resumes from there - the prompt plus the kept answer tokens as the new prompt - with another seed
   (``seed + 1``; a request without a seed stays unseeded) and ``repetition_penalty`` raised by
   ``penalty_step`` (CTRL's penalty, :func:`grafting.generate.apply_repetition_penalty`; vLLM applies the same),
3. at most ``max_retries`` times (default once); collapsing again ends the answer there (``finish_reason``
   ``stop``, ``report.cut_short``).

This mirrors the speech family's loop guard (``audio/generate.py``: hold back what a retry may discard, roll back,
resume with a higher penalty). The client never sees retracted text: the repeats of a token (run positions 2
and later) are held back until the run breaks, so the stream is delayed by at most ``min_run - 2`` tokens and
only inside a run. Runs of exempt tokens - those whose text, stripped of spaces, fully matches ``exempt_regex``
(default: whitespace, punctuation, digits) - are never held and never fire: markdown table rules (``|---|``),
indentation, ``....`` and numbers like ``10000`` (SmolLM2 writes digits one token each) are legitimate.

The guard detokenises the answer itself (:class:`~grafting.generate.TextStreamer` over all kept ids, stop strings
included - the ``transformers`` backend's own detokeniser), so text and stop strings are exact across a resume
point, and a chunk of several tokens (vLLM with speculative decoding) never smuggles a repeat's text out with the
token before it. Without a collapse the events are the backend's, with the text each token brings by that
detokeniser: for the ``transformers`` backend exactly its own events.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from core.validate import SEED_LIMIT

from .config import CollapseGuardConfig
from .generate import Delta, SamplingParams, TextStreamer
from .processor import Prompt

Attempt = Callable[[Prompt, SamplingParams], AsyncIterator[Delta]]


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

    def rewind_to_first(self) -> None:
        """After a rollback to the run's first token: the run is that one token again."""
        self.length = 1 if self.token is not None else 0


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


async def guarded_stream(attempt: Attempt, prompt: Prompt, params: SamplingParams, config: CollapseGuardConfig,
                         tokenizer, report: GuardReport | None = None) -> AsyncIterator[Delta]:
    """Stream an answer through the collapse guard (see the module docstring).

    Args:
        attempt: starts one generation: ``attempt(prompt, params)`` -> async iterator of Delta events ending with
            one whose ``finish_reason`` is set (each generated token carries its ``token_id``); closing it must
            stop the generation (both backends do).
        prompt, params: the request's; config: ``vlm.engine.collapse_guard``; tokenizer: the LLM's (token texts
            for the exemption, the answer's detokenisation); report: filled in as it goes.
    Yields: Delta events like ``attempt``'s; ``completion_tokens`` counts the kept answer tokens (and the EOS
    token when the answer ends with one, as the backends do). Errors of ``attempt`` propagate unchanged.
    """
    report = report if report is not None else GuardReport()
    if not config.enabled:
        stream = attempt(prompt, params)
        try:
            async for d in stream:
                yield d
        finally:
            await stream.aclose()
        return
    runs = RunDetector(config, lambda i: tokenizer.decode([i]))
    kept: list[int] = []  # answer token ids released to the client
    own = TextStreamer(tokenizer, params.stop)  # the answer's text, from all kept ids

    def release(d: Delta, base: int) -> Delta:
        text = ""
        if d.token_id is not None:
            kept.append(d.token_id)
            text = own.push(d.token_id)
        if d.finish_reason is not None:
            text += own.flush()
        return dataclasses.replace(d, text=text, completion_tokens=base + d.completion_tokens)

    retry = 0
    while True:
        p = prompt if retry == 0 else continuation(prompt, kept)
        sp = params if retry == 0 else retry_params(params, len(kept), config, retry)
        base = len(kept)
        held: list[Delta] = []
        stream = attempt(p, sp)
        try:
            async for d in stream:
                if d.finish_reason is None:
                    run = runs.push(d.token_id) if d.token_id is not None else 0
                    if run >= 2 or (held and d.token_id is None):  # a repeat: hold it until the run breaks
                        held.append(d)
                        if run >= config.min_run:
                            break
                        continue
                for h in held + [d]:
                    out = release(h, base)
                    if own.stopped and out.finish_reason is None:  # a stop string completed across a resume
                        out = dataclasses.replace(out, finish_reason="stop")
                    yield out
                    if out.finish_reason is not None:
                        return
                held = []
            else:
                return  # the attempt ended without a final event (the backends always send one)
        finally:
            await stream.aclose()
        # collapsed: drop the held repeats, keep the run's first token
        report.collapses += 1
        report.dropped_tokens += sum(1 for h in held if h.token_id is not None)
        runs.rewind_to_first()
        if retry >= config.max_retries or params.max_new_tokens - len(kept) < 1:
            report.cut_short = True
            yield Delta(own.flush(), None, "stop", len(kept), time.perf_counter())
            return
        retry += 1
        report.retries = retry
