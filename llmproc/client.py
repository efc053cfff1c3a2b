"""A small typed client of an OpenAI-compatible ``/v1/completions`` endpoint with vLLM's extensions.

Used by the VLM engine's ``vllm`` backend (and next by the speech LM). Only what we send is modelled:
:class:`CompletionRequest` (token-id or embedding prompts, sampling, logprobs, structured outputs) and the stream
of :class:`CompletionChunk` it yields. vLLM specifics relied on (vllm 0.32 ``CompletionRequest``):
``prompt_embeds`` (base64 of ``torch.save`` of a ``(T, H)`` tensor; the server needs ``--enable-prompt-embeds``),
``return_token_ids`` (each chunk carries its new token ids), ``return_tokens_as_token_ids`` (logprob tokens as
``"token_id:<id>"``, so alternatives are identified by id, not by possibly ambiguous text), ``stop_token_ids``,
``structured_outputs`` (vLLM's ``StructuredOutputsParams``: ``json`` schema or ``json_object``, with options such as
``disable_any_whitespace``). Closing the stream
early closes the HTTP connection, which makes vLLM abort the request.

Errors: :class:`EngineUnavailableError` (HTTP 503, code ``engine_unavailable``: the engine cannot be reached or
dropped the connection mid-request, e.g. its process died) and :class:`EngineRequestError` (the engine refused
the request with a 4xx: e.g. a JSON schema its grammar compiler cannot handle; HTTP 400).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

TOKEN_ID_PREFIX = "token_id:"


class EngineUnavailableError(RuntimeError):
    """The engine process is down, restarting, or dropped the request: HTTP 503 ``engine_unavailable``."""

    status_code = 503
    code = "engine_unavailable"
    param = None


class EngineRequestError(ValueError):
    """The engine refused the request (its 4xx): HTTP 400 with the engine's message; ``param`` when it names
    one."""

    status_code = 400
    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class CompletionRequest:
    """One ``/v1/completions`` request. Exactly one of ``prompt`` (token ids) and ``prompt_embeds`` (base64
    ``torch.save`` of a ``(T, H)`` float tensor) is set. ``logprobs``: None for none, else the number of top
    alternatives (0-20) besides the sampled token. ``logit_bias``: token id (as a string) -> additive bias.
    ``structured_outputs``: vLLM's ``StructuredOutputsParams`` as a dict, e.g. ``{"json": schema}`` or
    ``{"json_object": true}``.
    """

    model: str
    max_tokens: int
    prompt: list[int] | None = None
    prompt_embeds: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body (streaming, token ids returned, logprob tokens as ids, usage in the last chunk)."""
        if (self.prompt is None) == (self.prompt_embeds is None):
            raise ValueError("exactly one of prompt and prompt_embeds must be given")
        b = {k: v for k, v in asdict(self).items() if v is not None}
        b.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True,
                 return_tokens_as_token_ids=True, skip_special_tokens=True)
        return b


@dataclass
class TokenLogprob:
    """Log-probability of one generated token (``token_id``, ``logprob`` in nats, the raw model distribution
    as vLLM reports it by default) and ``top``: the requested number of most likely ``(token_id, logprob)``,
    most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class CompletionChunk:
    """One streamed step: new ``text`` (incrementally detokenised by the engine), the new ``token_ids``,
    their ``logprobs`` (one per token id, when requested), ``finish_reason`` (``stop`` | ``length`` | None),
    and on the final usage chunk ``completion_tokens`` (else None)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None


def _token_id(s: str) -> int:
    if not s.startswith(TOKEN_ID_PREFIX):
        raise EngineUnavailableError(f"engine returned a logprob token {s!r} that is not an id")
    return int(s[len(TOKEN_ID_PREFIX):])


def parse_logprobs(lp: dict[str, Any] | None, k: int) -> list[TokenLogprob] | None:
    """vLLM completions ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs`` dicts keyed
    ``"token_id:<id>"``, holding the sampled token and the top ``k``) -> :class:`TokenLogprob` per token, with
    ``top`` sorted most likely first and cut to ``k``."""
    if lp is None:
        return None
    out = []
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"] or [None] * len(lp["tokens"])):
        alts = sorted(((_token_id(t), v) for t, v in (top or {}).items()), key=lambda x: -x[1])[:k] if k else []
        out.append(TokenLogprob(_token_id(tok), float(val), alts))
    return out


def _error_message(raw: bytes | str) -> tuple[str, str | None]:
    try:
        err = json.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else {}
        return str(err.get("message") or raw), err.get("param")
    except (json.JSONDecodeError, TypeError, AttributeError):
        return (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)[:2000], None


class CompletionsClient:
    """Async client of ``{base_url}/v1/completions``.

    ``stream(request)`` yields :class:`CompletionChunk` until the engine's ``[DONE]``; raises
    EngineUnavailableError / EngineRequestError (see the module docstring). ``timeout_s`` bounds connecting and
    each read (seconds)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """Stream one completion (see the class docstring)."""
        k = request.logprobs or 0
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                async with client.stream("POST", f"{self.base_url}/v1/completions", json=request.body()) as r:
                    if r.status_code >= 400:
                        raw = await r.aread()
                        msg, param = _error_message(raw)
                        if 400 <= r.status_code < 500:
                            raise EngineRequestError(msg, param)
                        raise EngineUnavailableError(f"engine error {r.status_code}: {msg}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            return
                        obj = json.loads(data)
                        if "error" in obj:  # after the 200: a request it refuses late (4xx code), or a failure
                            msg, param = _error_message(data)
                            code = obj["error"].get("code") if isinstance(obj["error"], dict) else None
                            if isinstance(code, int) and 400 <= code < 500:
                                raise EngineRequestError(msg, param)
                            raise EngineUnavailableError(f"engine failed mid-request: {msg}")
                        usage = obj.get("usage")
                        for c in obj.get("choices") or []:
                            yield CompletionChunk(c.get("text") or "", list(c.get("token_ids") or []),
                                                  parse_logprobs(c.get("logprobs"), k), c.get("finish_reason"))
                        if usage and not obj.get("choices"):
                            yield CompletionChunk("", [], None, None, int(usage["completion_tokens"]))
        except httpx.HTTPError as exc:  # refused, reset, or cut mid-stream: the engine process is not serving
            raise EngineUnavailableError(f"the language-model engine is unavailable: {type(exc).__name__}") \
                from None

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 within 2 s."""
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(f"{self.base_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False
