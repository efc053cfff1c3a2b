"""Token-by-token generation in this process (the ``transformers`` reference of the LLM client protocol):
prefill once, decode with the KV cache, stream :class:`~core.llm_client.CompletionChunk` s.

Prefill runs the LLM over the request's prompt, token ids or ``(T, H)`` embeddings (image features spliced in);
each decode step feeds one token id with the KV cache. Text is streamed incrementally: a delta is held back while
it ends inside a UTF-8 sequence or could still be the start of a stop string (the OpenAI ``stop`` semantics: the
stop string itself is not returned). The chunks follow vLLM's completions stream (see
:class:`core.llm_client.CompletionChunk`), so that the layers above read both backends alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from core.llm_client import CompletionChunk, CompletionRequest, TokenLogprob
from core.validate import SEED_LIMIT


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
    """One event of the VLM's output stream (:meth:`grafting.engine.VLMEngine.stream`, made by
    :func:`grafting.llm_stream.to_deltas`): ``text`` is new visible text (may be empty), ``token_id`` the sampled
    token (None on the final event), ``finish_reason`` set on the last event (``stop`` | ``length``),
    ``completion_tokens`` so far, ``t`` a ``time.perf_counter()`` stamp in seconds; with
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
    """Incremental detokenizer with stop strings: feed token ids, get safe-to-send text deltas. ``ids`` and
    ``sent`` (characters of the decoded text already handed out) may be preset to resume an answer."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True, ids: list[int] | None = None,
                 sent: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(ids or [])
        self.sent = sent  # characters of the decoded text already sent
        self.stopped = False

    def text(self) -> str:
        """The whole decoded answer so far (special tokens skipped unless told otherwise)."""
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

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
    """Decoding state of one :class:`~core.llm_client.CompletionRequest`, shared by single-sequence and batched
    decode.

    ``step(logits)`` takes the next-token logits ``(V,)`` of this sequence, samples one token and returns its
    chunks: one :class:`~core.llm_client.CompletionChunk` per token, and with the last one (a stop token, a
    completed stop string, ``max_tokens``) ``finish_reason`` set and the usage chunk after it. ``finished`` tells
    whether the sequence is over and ``last_token`` is the id to feed to the next decode step. A set ``cancel``
    (the reader is gone) finishes it with no chunk. Raises NonFiniteOutputError when ``logits`` are not all
    finite. The seed is taken modulo 2**63 (as vLLM's int64 seeds are by the client).
    """

    def __init__(self, tokenizer, request: CompletionRequest, cancel: threading.Event | None = None):
        self.request = request
        self.params = SamplingParams(request.max_tokens, request.temperature, request.top_p, request.seed,
                                     list(request.stop), request.logprobs is not None, request.logprobs or 0,
                                     request.repetition_penalty)
        self.stop_ids = set(request.stop_token_ids)
        self.cancel = cancel
        seed = request.seed
        self.generator = torch.Generator(device="cpu").manual_seed(int(seed) % SEED_LIMIT) if seed is not None \
            else None
        self.suppress = tuple(request.banned_tokens)
        self.streamer = TextStreamer(tokenizer, request.stop, request.skip_special_tokens)
        self.n = 0
        self.finished = False
        self.last_token: int | None = None
        # Ids the repetition penalty sees (the prompt's when it is ids, and the answer's), kept only when it is on.
        self.seen: list[int] = [int(i) for i in request.prompt] if request.repetition_penalty != 1.0 \
            and request.prompt_is_ids else []

    def _last(self, text: str, tok: int, lp, reason: str) -> list[CompletionChunk]:
        self.finished = True
        return [CompletionChunk(text, [tok], lp, reason), CompletionChunk("", [], None, None, self.n)]

    def step(self, logits: torch.Tensor) -> list[CompletionChunk]:
        """Consume one step's logits; see the class docstring."""
        if self.cancel is not None and self.cancel.is_set():
            self.finished = True
            return []
        if not torch.isfinite(logits).all():
            raise NonFiniteOutputError(f"the model produced non-finite logits at completion token {self.n + 1}")
        p = self.params
        scores = logits
        if p.repetition_penalty != 1.0:
            scores = apply_repetition_penalty(logits, torch.tensor(self.seen, dtype=torch.long), p.repetition_penalty)
        tok = sample_next(scores, p, self.generator, self.suppress)
        if p.repetition_penalty != 1.0:
            self.seen.append(tok)
        self.n += 1
        self.last_token = tok
        lp = None
        if p.logprobs:
            v, top = token_logprobs(logits, tok, p.top_logprobs)
            lp = [TokenLogprob(tok, v, top)]
        if tok in self.stop_ids:
            return self._last(self.streamer.flush(), tok, lp, "stop")
        delta = self.streamer.push(tok)
        if self.streamer.stopped:
            return self._last(delta, tok, lp, "stop")
        if self.n >= p.max_new_tokens:
            return self._last(delta + self.streamer.flush(), tok, lp, "length")
        return [CompletionChunk(delta, [tok], lp)]


def prefill(llm, prompt):
    """Run the causal LM ``llm`` over a whole prompt: token ids (``list[int]``) or ``(T, H)`` input embeddings
    (a float tensor in the LLM's dtype). Returns its output (``logits`` ``(1, T, V)`` and the KV ``cache``)."""
    device = llm.get_input_embeddings().weight.device
    if isinstance(prompt, (list, tuple)):
        return llm(input_ids=torch.tensor([list(prompt)], dtype=torch.long, device=device), use_cache=True)
    return llm(inputs_embeds=prompt[None].to(device), use_cache=True)


@torch.inference_mode()
def generate_stream(llm, tokenizer, request: CompletionRequest,
                    cancel: threading.Event | None = None) -> Iterator[CompletionChunk]:
    """Prefill ``request.prompt``, then decode token by token with the KV cache, yielding the chunks of
    :class:`SequenceState` (the last one the usage chunk; nothing more once ``cancel`` is set, checked before
    every decode step). One sequence, no batching (:mod:`grafting.batching` decodes several together).
    Raises NonFiniteOutputError when the logits of a step are not all finite."""
    state = SequenceState(tokenizer, request, cancel)
    out = prefill(llm, request.prompt)
    cache, logits = out.cache, out.logits[0, -1]
    device = llm.get_input_embeddings().weight.device
    while True:
        yield from state.step(logits)
        if state.finished:
            return
        out = llm(input_ids=torch.tensor([[state.last_token]], device=device), cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]
