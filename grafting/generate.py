"""Token-by-token generation for the grafted VLM: prefill once, decode with the KV cache, stream text.

Prefill runs the LLM over the prompt's input embeddings (image features spliced in); each decode step feeds one
token id with the KV cache. Text is streamed incrementally: a delta is held back while it ends inside a UTF-8
sequence or could still be the start of a stop string (the OpenAI ``stop`` semantics: the stop string itself is
not returned).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .model import GraftedVLM
from .processor import Prompt


@dataclass
class SamplingParams:
    """Sampling settings (OpenAI semantics). ``temperature`` 0 means greedy; ``top_p`` in (0, 1];
    ``seed`` makes sampling reproducible; ``stop``: up to 4 strings that end the answer (not included);
    ``logprobs``/``top_logprobs`` (0-20): report each sampled token's log-probability under the model (the raw
    logits' log-softmax, before temperature and top-p, as OpenAI does) and the most likely alternatives;
    ``repetition_penalty`` (>= 1; 1 = off) as in :func:`apply_repetition_penalty` (what the collapse guard
    raises on its retry)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float = 1.0


@dataclass
class Delta:
    """One step of a generation stream: ``text`` is new visible text (may be empty), ``token_id`` the sampled
    token (None on the final event), ``finish_reason`` set on the last event (``stop`` | ``length`` |
    ``cancelled``), ``completion_tokens`` so far, ``t`` a ``time.perf_counter()`` stamp in seconds; with
    ``SamplingParams.logprobs``: ``logprob`` of ``token_id`` and ``top_logprobs`` ``[(token_id, logprob)]``."""

    text: str
    token_id: int | None
    finish_reason: str | None = None
    completion_tokens: int = 0
    t: float = 0.0
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class NonFiniteOutputError(RuntimeError):
    """The model produced NaN/Inf logits (fp16 overflow, a broken kernel or checkpoint). HTTP 500, code
    ``non_finite_output``: a model failure, never silently sampled from."""

    status_code = 500
    code = "non_finite_output"
    param = None


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019), as transformers' ``RepetitionPenaltyLogitsProcessor`` and
    vLLM apply it: the logit of every id in ``seen_ids`` (prompt and answer so far, long, any order, repeats
    allowed) is divided by ``penalty`` when positive and multiplied by it when negative. ``logits`` ``(V,)`` is
    not modified; returns a new fp32 tensor (the input itself when ``penalty == 1``)."""
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    out = logits.float().clone()
    ids = torch.unique(seen_ids)
    vals = out[ids]
    out[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                suppress_ids: tuple[int, ...] = ()) -> int:
    """Pick the next token from ``logits`` ``(V,)`` (any float dtype): greedy at temperature 0, else
    temperature + nucleus (top-p, Holtzman et al. 2019) sampling. ``suppress_ids`` are never picked."""
    logits = logits.float().clone()
    if suppress_ids:
        logits[list(suppress_ids)] = float("-inf")
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_id: int, top_k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token_id`` under ``logits`` ``(V,)`` and the ``top_k`` most likely ``(id, logprob)``,
    computed in fp32 from the raw logits."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if top_k > 0:
        vals, ids = torch.topk(lp, top_k)
        top = list(zip(ids.tolist(), vals.tolist()))
    return float(lp[token_id]), top


class TextStreamer:
    """Incremental detokenizer with stop strings: feed token ids, get safe-to-send text deltas."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent
        self.stopped = False

    def text(self) -> str:
        """The whole decoded answer so far (special tokens skipped)."""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add a token; return the text that can be sent now (sets ``stopped`` when a stop string appears)."""
        self.ids.append(token_id)
        text = self.text()
        for s in self.stop:
            pos = text.find(s, max(0, self.sent - len(s)))
            if pos != -1:
                self.stopped = True
                delta, self.sent = text[self.sent:pos], pos
                return delta
        end = len(text)
        if text.endswith("\ufffd"):
            end -= 1
        for s in self.stop:  # hold back a tail that could be the beginning of a stop string
            for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                if text[end - k:end] == s[:k]:
                    end -= k
                    break
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta

    def flush(self) -> str:
        """Text held back at the end of the stream (when no stop string completed)."""
        if self.stopped:
            return ""
        text = self.text()
        delta, self.sent = text[self.sent:], len(text)
        return delta


class SequenceState:
    """Decoding state of one request, shared by single-sequence and batched decode.

    ``step(logits)`` takes the next-token logits ``(V,)`` of this sequence and returns the :class:`Delta` for it
    (sampled token and new text, or the final event); ``finished`` tells whether the sequence is over and
    ``last_token`` is the id to feed to the next decode step.
    Raises NonFiniteOutputError when ``logits`` are not all finite.
    """

    def __init__(self, model: GraftedVLM, tokenizer, prompt: Prompt, params: SamplingParams,
                 eos_token_ids: set[int], cancel: threading.Event | None = None):
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.cancel = cancel
        self.generator = torch.Generator(device="cpu").manual_seed(int(params.seed)) if params.seed is not None \
            else None
        # With images, the placeholder ids are never sampled (they would be refused in the next turn).
        self.suppress = model.image_token_ids.all() if prompt.pixel_values is not None else ()
        self.streamer = TextStreamer(tokenizer, params.stop)
        self.n = 0
        self.finished = False
        self.last_token: int | None = None
        # Ids the repetition penalty sees (prompt + answer), kept only when it is on.
        self.seen: list[int] = prompt.input_ids[0].tolist() if params.repetition_penalty != 1.0 else []

    def _final(self, reason: str) -> Delta:
        self.finished = True
        return Delta(self.streamer.flush(), None, reason, self.n, time.perf_counter())

    def step(self, logits: torch.Tensor) -> Delta:
        """Consume one step's logits; see the class docstring."""
        if self.cancel is not None and self.cancel.is_set():
            return self._final("cancelled")
        if self.n >= self.params.max_new_tokens:
            return self._final("length")
        if not torch.isfinite(logits).all():
            raise NonFiniteOutputError(f"the model produced non-finite logits at completion token {self.n + 1}")
        scores = logits
        if self.params.repetition_penalty != 1.0:
            scores = apply_repetition_penalty(logits, torch.tensor(self.seen, dtype=torch.long),
                                              self.params.repetition_penalty)
        tok = sample_next(scores, self.params, self.generator, self.suppress)
        if self.params.repetition_penalty != 1.0:
            self.seen.append(tok)
        self.n += 1
        if tok in self.eos_token_ids:
            return self._final("stop")
        lp, top = token_logprobs(logits, tok, self.params.top_logprobs) if self.params.logprobs else (None, None)
        delta = self.streamer.push(tok)
        self.last_token = tok
        if self.streamer.stopped:
            self.finished = True
            return Delta(delta, tok, "stop", self.n, time.perf_counter(), lp, top)
        return Delta(delta, tok, None, self.n, time.perf_counter(), lp, top)


def prefill(model: GraftedVLM, prompt: Prompt):
    """Run the LLM over the whole prompt (image features spliced in); returns its output (``logits``
    ``(1, T, V)`` and the KV ``cache``). Without images the LLM gets ``input_ids`` themselves."""
    if prompt.pixel_values is None:
        return model.llm(input_ids=prompt.input_ids.to(model.device), use_cache=True)
    embeds = model.embed(prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw)
    return model.llm(inputs_embeds=embeds, use_cache=True)


@torch.inference_mode()
def generate_stream(model: GraftedVLM, tokenizer, prompt: Prompt, params: SamplingParams,
                    eos_token_ids: set[int], cancel: threading.Event | None = None) -> Iterator[Delta]:
    """Prefill the prompt, then decode token by token with the KV cache, yielding :class:`Delta` events.

    With images in the prompt the image placeholder ids are suppressed so the model cannot emit them. The
    stream ends with a Delta whose ``finish_reason`` is ``stop`` (EOS or stop string), ``length``
    (``max_new_tokens``) or ``cancelled`` (``cancel`` set; checked before every decode step).
    Raises NonFiniteOutputError when the logits of a step are not all finite.
    """
    state = SequenceState(model, tokenizer, prompt, params, eos_token_ids, cancel)
    out = prefill(model, prompt)
    cache, logits = out.cache, out.logits[0, -1]
    while True:
        d = state.step(logits)
        yield d
        if state.finished:
            return
        out = model.llm(input_ids=torch.tensor([[state.last_token]], device=model.device), cache=cache,
                        use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]
