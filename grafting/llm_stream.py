"""From a prepared VLM prompt to the VLM's output stream, through the LLM client protocol (either backend alike).

- :func:`completion_request`: a :class:`~grafting.processor.Prompt` and :class:`~grafting.generate.SamplingParams`
  -> a :class:`~core.llm_client.CompletionRequest`: the prompt as token ids when it has no image (so a text-only
  answer is the base LLM's, and prefix caching and n-gram lookup see the ids), as ``(T, H)`` embeddings when it has
  images (:meth:`grafting.model.GraftedVLM.embed`: the LLM's own rows for the text, projected image features at
  the placeholders; the placeholder ids are then banned, never sampled) with ``prompt_token_ids`` saying which
  rows are the text's ids (None at the image positions), so a client can send the text as ids (vLLM's mixed
  prompt, :func:`core.vllm_client.request_body`); the LLM's EOS ids as stop ids.
- :func:`to_deltas`: the client's chunks -> :class:`~grafting.generate.Delta` events, one per generated token
  (a chunk's text on its first token), the stop token counted but not shown, then one final event with
  ``finish_reason`` and ``completion_tokens``.
- :func:`answer`: both, with the collapse guard (:func:`grafting.collapse_guard.guard_chunks`) between them:
  what :meth:`grafting.engine.VLMEngine.stream` runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import torch

from core.llm_client import CompletionChunk, CompletionRequest, EngineRequestError, EngineUnavailableError, LLMClient

from .collapse_guard import GuardReport, continuation, guard_chunks, retry_params
from .config import CollapseGuardConfig
from .generate import Delta, SamplingParams
from .model import GraftedVLM
from .processor import Prompt


def structured_outputs(response_format: dict | None) -> dict | None:
    """An OpenAI ``response_format`` (as validated by ``VLMEngine.response_format``) -> vLLM's structured outputs:
    ``{"json": schema}`` or ``{"json_object": True}``; None for none. The server runs them without optional
    whitespace (``services/engines/vllm_server.py``)."""
    if response_format is None:
        return None
    if response_format["type"] == "json_object":
        return {"json_object": True}
    return {"json": response_format["json_schema"]["schema"]}


@torch.inference_mode()
def completion_request(model: GraftedVLM, prompt: Prompt, params: SamplingParams, eos_token_ids: set[int],
                       structured: dict | None = None) -> CompletionRequest:
    """The request for a prepared ``prompt`` (see the module docstring; embeddings in the LLM's dtype, computed
    here: call it off the event loop when the prompt has images). ``structured``: :func:`structured_outputs`."""
    req = CompletionRequest(
        prompt=None, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        repetition_penalty=params.repetition_penalty, seed=params.seed, stop=list(params.stop),
        stop_token_ids=sorted(eos_token_ids), logprobs=params.top_logprobs if params.logprobs else None,
        structured_outputs=structured)
    if prompt.pixel_values is None:
        req.prompt = prompt.input_ids[0].tolist()
    else:
        req.prompt = model.embed(prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw)[0]
        image = model.image_token_ids.image
        req.prompt_token_ids = [None if i == image else i for i in prompt.input_ids[0].tolist()]
        req.banned_tokens = model.image_token_ids.banned()
    return req


async def to_deltas(chunks: AsyncIterator[CompletionChunk], eos_token_ids: set[int]) -> AsyncIterator[Delta]:
    """The :class:`Delta` events of a chunk stream (see the module docstring): a token that completes a stop
    string is a delta of its own; an EOS id ending the answer gets none (its chunk's text, if any, comes as a
    delta without a token) but is counted. Raises EngineUnavailableError when the stream ends without
    ``stop`` or ``length`` (the engine dropped the request). Closing this closes ``chunks``."""
    n, finish, usage_n = 0, None, None
    try:
        async for chunk in chunks:
            if chunk.completion_tokens is not None:
                usage_n = chunk.completion_tokens
                continue
            text = chunk.text
            for i, tok in enumerate(chunk.token_ids):
                n += 1
                last = i == len(chunk.token_ids) - 1
                if last and chunk.finish_reason == "stop" and tok in eos_token_ids:
                    if text:
                        yield Delta(text, None, None, n - 1, time.perf_counter())
                    break
                lp = chunk.logprobs[i] if chunk.logprobs else None
                yield Delta(text, tok, None, n, time.perf_counter(), lp.logprob if lp else None,
                            lp.top if lp else None)
                text = ""
            else:
                if text:  # text with no new token (a flushed tail)
                    yield Delta(text, None, None, n, time.perf_counter())
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
    finally:
        await chunks.aclose()
    if finish not in ("stop", "length"):
        raise EngineUnavailableError(f"the language-model engine ended the request with {finish!r}")
    yield Delta("", None, finish, usage_n if usage_n is not None else n, time.perf_counter())


async def answer(model: GraftedVLM, client: LLMClient, tokenizer, prompt: Prompt, params: SamplingParams,
                 eos_token_ids: set[int], guard: CollapseGuardConfig, response_format: dict | None = None,
                 report: GuardReport | None = None) -> AsyncIterator[Delta]:
    """The answer to ``prompt`` as :class:`Delta` events: each attempt one :func:`completion_request` streamed by
    ``client`` (a resumed attempt: :func:`~grafting.collapse_guard.continuation` of the prompt and
    :func:`~grafting.collapse_guard.retry_params`), the collapse guard over the chunks (off for a
    ``response_format``: a grammar cannot resume mid-answer), then :func:`to_deltas`. A refusal of the client
    (EngineRequestError) for a structured request names ``response_format`` (vLLM compiles the grammar after the
    response has begun, so a refusal then is a schema it cannot compile). Closing this closes the client's
    stream (the request is aborted)."""
    structured = structured_outputs(response_format)
    if structured is not None:
        guard = guard.model_copy(update={"enabled": False})

    async def attempt(kept: list[int], retry: int) -> AsyncIterator[CompletionChunk]:
        p = prompt if retry == 0 else continuation(prompt, kept)
        sp = params if retry == 0 else retry_params(params, len(kept), guard, retry)
        if p.pixel_values is None:
            req = completion_request(model, p, sp, eos_token_ids, structured)
        else:
            req = await asyncio.to_thread(completion_request, model, p, sp, eos_token_ids, structured)
        stream = client.stream(req)
        try:
            async for c in stream:
                yield c
        except EngineRequestError as exc:
            if structured is not None and exc.param is None:
                exc.param = "response_format"
            raise
        finally:
            await stream.aclose()

    chunks = guard_chunks(attempt, guard, tokenizer, list(params.stop), params.max_new_tokens, report)
    deltas = to_deltas(chunks, eos_token_ids)
    try:
        async for d in deltas:
            yield d
    finally:
        await deltas.aclose()
