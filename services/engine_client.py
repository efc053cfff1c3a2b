"""The typed HTTP client of a supervised vLLM OpenAI server (``/v1/completions`` with vLLM's extensions).

:class:`VLLMClient` implements :class:`grafting.llm_client.LLMClient` over a :class:`ServerProcess`
(``services/engine_process.py``): the VLM deployment starts the server and hands the engine this client (next the
speech LM). The request body is built by the caller (``grafting.vllm_backend.CompletionRequest``); the stream is
parsed into :class:`~grafting.llm_client.CompletionChunk`. vLLM specifics relied on (vllm 0.32
``CompletionRequest``): ``prompt_embeds`` (base64 of ``torch.save`` of a ``(T, H)`` tensor; the server needs
``--enable-prompt-embeds``), ``return_token_ids`` (each chunk carries its new token ids),
``return_tokens_as_token_ids`` (logprob tokens as ``"token_id:<id>"``, so alternatives are identified by id, not
by possibly ambiguous text), ``stop_token_ids``, ``structured_outputs`` (vLLM's ``StructuredOutputsParams``:
``json`` schema or ``json_object``, with options such as ``disable_any_whitespace``). Closing the stream early
closes the HTTP connection, which makes vLLM abort the request.

Errors (declared in ``grafting/llm_client.py``, where the engine catches them): EngineUnavailableError (HTTP 503,
code ``engine_unavailable``: the engine cannot be reached or dropped the connection mid-request, e.g. its process
died) and EngineRequestError (the engine refused the request with a 4xx: e.g. a JSON schema its grammar compiler
cannot handle; HTTP 400).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from grafting.llm_client import CompletionChunk, EngineRequestError, EngineUnavailableError, TokenLogprob

from .engine_process import ServerProcess

TOKEN_ID_PREFIX = "token_id:"


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


class VLLMClient:
    """Async client of the ``/v1/completions`` of the vLLM server that ``server`` supervises (see the module
    docstring); reads the server's address per request (it moves after a failed start).

    ``stream(body)`` yields :class:`CompletionChunk` until the engine's ``[DONE]``; raises
    EngineUnavailableError / EngineRequestError. ``timeout_s`` bounds connecting and each read (seconds).
    ``state`` and ``wait_ready`` are the server's; ``close()`` stops it."""

    def __init__(self, server: ServerProcess, timeout_s: float = 600.0):
        self.server = server
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)

    @property
    def base_url(self) -> str:
        """The server's current address, ``http://host:port``."""
        return self.server.base_url

    @property
    def state(self) -> str:
        """The server's state (``ready`` | ``starting`` | ``restarting`` | ``failed`` | ``stopped``)."""
        return self.server.state

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the server is ready (True) or failed/stopped/``timeout`` seconds (False)."""
        return self.server.wait_ready(timeout)

    def close(self) -> None:
        """Stop the server and its supervision (idempotent)."""
        self.server.stop()

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[CompletionChunk]:
        """Stream one completion of a streaming ``/v1/completions`` request ``body`` (see the class docstring)."""
        k = body.get("logprobs") or 0
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                async with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as r:
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

    async def requests_in_engine(self) -> int:
        """Requests vLLM holds now (running + waiting), read from its Prometheus ``/metrics``
        (``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, summed over label sets). Raises
        EngineUnavailableError when the server does not answer."""
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                text = (await client.get(f"{self.base_url}/metrics")).text
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"the language-model engine is unavailable: {type(exc).__name__}") \
                from None
        total = 0.0
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 within 2 s."""
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(f"{self.base_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False
