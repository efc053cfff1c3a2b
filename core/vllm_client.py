"""The typed HTTP client of a supervised vLLM OpenAI server (``/v1/completions`` with vLLM's extensions, and
``/v1/chat/completions`` for mixed prompts).

:class:`VLLMClient` implements :class:`core.llm_client.LLMClient` over a :class:`Server` (the service's
``services.engines.process.ServerProcess``): the VLM and speech deployments start the server and hand the engine this
client. The body is built here from a :class:`~core.llm_client.CompletionRequest` (:func:`request_body`, with
:func:`embeds_payload` for embeddings); the stream is parsed into :class:`~core.llm_client.CompletionChunk`. A
token-id prompt goes to ``/v1/completions`` as ``prompt``. An embeddings prompt that says which rows are token
ids (``CompletionRequest.prompt_token_ids``: the VLM's image prompts) goes, when the client holds the served LLM's
tokenizer, to ``/v1/chat/completions`` as vLLM's mixed prompt (:func:`mixed_parts`: text parts that vLLM tokenizes
back into exactly those ids, ``prompt_embeds`` parts for the other rows, under the server's
:data:`MIXED_CHAT_TEMPLATE`), which an EAGLE proposer can serve; any other embeddings prompt goes to
``/v1/completions`` as ``prompt_embeds`` alone. vLLM specifics relied on (vllm 0.32 ``CompletionRequest`` /
``ChatCompletionRequest``): ``prompt_embeds`` (base64 of ``torch.save`` of a ``(T, H)`` tensor; the server needs
``--enable-prompt-embeds``), ``return_token_ids`` (each chunk carries its new token ids; the first chat chunk the
prompt's, checked against a mixed prompt's),
``return_tokens_as_token_ids`` (logprob tokens as ``"token_id:<id>"``, so alternatives are identified by id, not
by possibly ambiguous text), ``stop_token_ids``, ``bad_words`` (banned tokens, by text), ``structured_outputs``
(vLLM's ``StructuredOutputsParams``: ``json`` schema or ``json_object``, with options such as
``disable_any_whitespace``). Closing the stream early closes the HTTP connection, which makes vLLM abort the
request.

Connections: one pooled ``httpx.AsyncClient`` per :class:`VLLMClient` (one per engine, so one per replica), kept
alive between completions (at most ``max_connections``); a stream closed before its end closes its connection
(HTTP/1.1 cannot reuse it mid-response), which is what aborts the request in vLLM. See :class:`VLLMClient`.

Errors (declared in ``core/llm_client.py``, where the engines catch them): EngineUnavailableError (HTTP 503,
code ``engine_unavailable``: the engine cannot be reached, dropped the connection mid-request, e.g. its process
died, or answered 503), EngineRequestError (the engine refused the request with a 400: e.g. a JSON schema its
grammar compiler cannot handle; HTTP 400) and EngineError (HTTP 500 ``engine_error``: any other status from the
engine, a mid-stream error that is not a 4xx, or a malformed stream: a line that is not JSON, a chunk missing its
fields, a logprob token that is not an id, a mixed prompt that vLLM tokenized into other ids than ours).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx

from .constants import SERVED_NAME
from .llm_client import (CompletionChunk, CompletionRequest, EngineError, EngineRequestError, EngineUnavailableError,
                         TokenLogprob)
from .validate import SEED_LIMIT
from .vllm_marker import VLLM_EMBEDS_MARKER

TOKEN_ID_PREFIX = "token_id:"
# The chat template of a mixed prompt (the server's ``--chat-template``, with ``--chat-template-content-format
# openai``): the content parts of the one message, concatenated as they are. vLLM renders a ``prompt_embeds`` part
# as its marker text (vllm/renderers/chat_utils.py:2021), so the rendered prompt is our text with one marker per
# embeddings part, and nothing of a template of vLLM's own is added.
_TOKENIZER_LOCK = threading.Lock()  # one tokenizer call at a time (:func:`_as_text`)
MIXED_CHAT_TEMPLATE = ("{%- for message in messages -%}{%- for part in message['content'] -%}{{- part['text'] -}}"
                       "{%- endfor -%}{%- endfor -%}")


def embeds_payload(embeds: Any) -> str:
    """``(T, H)`` float prompt embeddings (a ``torch.Tensor``, any device) -> base64 of ``torch.save`` of the
    contiguous CPU tensor: what vLLM's ``prompt_embeds`` takes (the server needs ``--enable-prompt-embeds``)."""
    import torch

    buf = io.BytesIO()
    torch.save(embeds.detach().cpu().contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _as_text(ids: list[int], tokenizer: Any) -> str | None:
    """The text that ``tokenizer`` (the served LLM's) turns back into exactly ``ids`` (no special tokens added),
    or None when there is none that vLLM accepts: the decoded text does not re-encode to ``ids`` (e.g. plain-text
    pieces of a control token, :meth:`grafting.processor.GraftProcessor.template_ids`), or holds vLLM's
    :data:`VLLM_EMBEDS_MARKER`. Calls are serialized (:data:`_TOKENIZER_LOCK`): requests are encoded in worker
    threads, and a fast tokenizer's calls can set its truncation and padding state, which concurrent calls refuse
    (tokenizers' "Already borrowed")."""
    with _TOKENIZER_LOCK:
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if VLLM_EMBEDS_MARKER in text or tokenizer.encode(text, add_special_tokens=False) != list(ids):
            return None
    return text


def mixed_parts(embeds: Any, token_ids: list[int | None], tokenizer: Any) -> tuple[list[dict[str, Any]],
                                                                                    list[int | None]]:
    """A ``(T, H)`` embeddings prompt and its ``token_ids`` (``CompletionRequest.prompt_token_ids``: an id where
    the row is that id's own embedding, None elsewhere) -> the content parts of vLLM's mixed prompt and the ids
    vLLM will hold for the positions sent as text.

    Each run of rows with ids becomes a ``text`` part (:func:`_as_text`), the other rows ``prompt_embeds`` parts
    (:func:`embeds_payload` of those rows); a run with no exact text is sent as its rows (they are those ids' own
    embeddings: the same input). The second value has, per position, the id vLLM must hold there (None for the
    rows sent as embeddings): :meth:`VLLMClient.stream_body` checks it against the prompt ids vLLM returns.
    vLLM tokenizes the whole rendered prompt, its marker a special token, and a fast tokenizer splits at special
    tokens before anything else, so each text part's ids are those of the part alone. Raises ValueError when the
    lengths differ."""
    if len(token_ids) != int(embeds.shape[0]):
        raise ValueError(f"prompt_token_ids has {len(token_ids)} entries for {int(embeds.shape[0])} rows")
    runs: list[tuple[int, int, str | None]] = []  # [start, end) and its text (None: rows)
    i, n = 0, len(token_ids)
    while i < n:
        j = i + 1
        while j < n and (token_ids[j] is None) == (token_ids[i] is None):
            j += 1
        text = None if token_ids[i] is None else _as_text(token_ids[i:j], tokenizer)
        if runs and text is None and runs[-1][2] is None:
            runs[-1] = (runs[-1][0], j, None)  # adjacent rows: one part
        else:
            runs.append((i, j, text))
        i = j
    parts: list[dict[str, Any]] = []
    expected: list[int | None] = []
    for a, b, text in runs:
        if text is None:
            parts.append({"type": "prompt_embeds", "data": embeds_payload(embeds[a:b])})
            expected += [None] * (b - a)
        else:
            parts.append({"type": "text", "text": text})
            expected += token_ids[a:b]
    return parts, expected


def request_body(req: CompletionRequest, model: str = SERVED_NAME, tokenizer: Any = None) -> dict[str, Any]:
    """The streaming body of ``req`` for the served ``model``: for ``/v1/completions``, ``prompt`` (ids) or
    ``prompt_embeds`` (:func:`embeds_payload`); for ``/v1/chat/completions`` (a body with ``messages``), an
    embeddings prompt with ``prompt_token_ids`` when the served LLM's ``tokenizer`` is given: vLLM's mixed prompt
    (:func:`mixed_parts`: ids at the text's positions, embeddings only at the others). Then the sampling fields
    (``seed`` modulo 2**63), ``stop`` / ``stop_token_ids``, ``logprobs`` when asked (chat: ``logprobs`` true and
    ``top_logprobs``), ``banned_tokens``' texts as ``bad_words``, ``structured_outputs``, ``extra_args`` as
    ``vllm_xargs``; always streamed, token ids returned per chunk (and the prompt's, chat), logprob tokens as
    ``token_id:<id>``, usage in a last chunk. Raises ValueError for a prompt that is neither ids nor a 2-D
    tensor, or ``prompt_token_ids`` of another length.

    Mixed prompt (vLLM 0.32): only the chat endpoint builds one, ``vllm/renderers/hf.py:1290``
    ``_apply_prompt_embeds_to_prompt`` (the token ids, a full-length embeddings tensor and the
    ``prompt_is_token_ids`` mask of ``vllm/inputs/llm.py:130`` ``EmbedsPrompt``); ``/v1/completions`` makes an
    embeddings-only prompt of ``prompt_embeds`` (``vllm/renderers/base.py:514``). The server renders the parts
    with :data:`MIXED_CHAT_TEMPLATE` (``services/engines/vllm_server.py``). With the ids known at every position,
    an EAGLE proposer can serve the request (it cannot serve an embeddings-only one: ``docs/operations/
    speculator.md``). The private ``_expected_prompt_ids`` key (removed before sending) carries
    :func:`mixed_parts`' second value.

    The ban is ``bad_words``, not ``logit_bias``: vLLM 0.32 refuses ``logit_bias`` while speculative decoding is on
    (``vllm/sampling_params.py`` ``_validate_spec_decode``), while its rejection sampler applies ``bad_words`` to
    every draft position (``vllm/v1/sample/rejection_sampler.py`` ``apply_logits_processors`` ->
    ``apply_bad_words_with_drafts``) and its sampler to the bonus token. vLLM tokenizes each word without special
    tokens added (``SamplingParams.update_from_tokenizer``): a text that is one token bans exactly that id (its
    space-prefixed form is added only when it is a different id sequence of the same length, which a special
    token's is not: a space token and the token)."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "top_k": req.top_k, "repetition_penalty": req.repetition_penalty,
                            "stop": list(req.stop), "stop_token_ids": list(req.stop_token_ids),
                            "skip_special_tokens": req.skip_special_tokens}
    chat = False
    if req.prompt_is_ids:
        body["prompt"] = [int(i) for i in req.prompt]
    elif getattr(req.prompt, "ndim", None) == 2:
        if req.prompt_token_ids is not None and tokenizer is not None:
            parts, expected = mixed_parts(req.prompt, req.prompt_token_ids, tokenizer)
            body["messages"] = [{"role": "user", "content": parts}]
            body["_expected_prompt_ids"] = expected
            chat = True
        else:
            body["prompt_embeds"] = embeds_payload(req.prompt)
    else:
        raise ValueError("a CompletionRequest prompt is token ids or a (T, H) embedding tensor")
    if req.seed is not None:
        body["seed"] = req.seed % SEED_LIMIT
    if req.logprobs is not None:
        if chat:
            body.update(logprobs=True, top_logprobs=req.logprobs)
        else:
            body["logprobs"] = req.logprobs
    if req.banned_tokens:
        body["bad_words"] = list(req.banned_tokens.values())
    if req.structured_outputs is not None:
        body["structured_outputs"] = req.structured_outputs
    if req.extra_args:
        body["vllm_xargs"] = req.extra_args
    body.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True,
                return_tokens_as_token_ids=True)
    return body


class Server(Protocol):
    """The supervised server a :class:`VLLMClient` talks to (``services.engines.process.ServerProcess``):
    ``base_url`` (``http://host:port``, read per request: it moves after a failed start), ``state`` (``ready`` |
    ``starting`` | ``restarting`` | ``failed`` | ``stopped``), ``wait_ready(timeout)`` (True once ready, False on
    failed/stopped/``timeout`` seconds) and ``stop()`` (idempotent)."""

    supports_structured_outputs = True

    @property
    def base_url(self) -> str: ...

    @property
    def state(self) -> str: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def stop(self) -> None: ...


def _token_id(s: str) -> int:
    if not s.startswith(TOKEN_ID_PREFIX):
        raise EngineError(f"engine returned a logprob token {s!r} that is not an id")
    return int(s[len(TOKEN_ID_PREFIX):])  # a ValueError for "token_id:x": the caller makes it an EngineError


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


def parse_chat_logprobs(lp: dict[str, Any] | None, k: int) -> list[TokenLogprob] | None:
    """vLLM chat ``logprobs`` (``content``: per token ``token`` ``"token_id:<id>"``, ``logprob``,
    ``top_logprobs`` a list of such) -> :class:`TokenLogprob` per token, ``top`` sorted most likely first and cut
    to ``k`` (as :func:`parse_logprobs`)."""
    if lp is None:
        return None
    out = []
    for item in lp.get("content") or []:
        alts = sorted(((_token_id(t["token"]), t["logprob"]) for t in item.get("top_logprobs") or []),
                      key=lambda x: -x[1])[:k] if k else []
        out.append(TokenLogprob(_token_id(item["token"]), float(item["logprob"]), alts))
    return out


def _check_prompt_ids(got: list[int], expected: list[int | None]) -> None:
    """Raise EngineError unless vLLM's prompt ``got`` has ``expected``'s ids wherever one is given (the positions
    sent as text) and its length: the guard that vLLM's tokenization of the text parts is ours."""
    if len(got) != len(expected) or any(e is not None and g != e for g, e in zip(got, expected)):
        first = next((i for i, (g, e) in enumerate(zip(got, expected)) if e is not None and g != e), None)
        raise EngineError(f"the language-model engine tokenized the mixed prompt differently ({len(got)} ids for "
                          f"{len(expected)}, first difference at {first})")


def _error_message(raw: bytes | str) -> tuple[str, str | None]:
    try:
        err = json.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else {}
        return str(err.get("message") or raw), err.get("param")
    except (json.JSONDecodeError, TypeError, AttributeError):
        return (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)[:2000], None


def _refusal(status: int, raw: bytes | str) -> Exception:
    """The error for an engine's HTTP error ``status`` with body ``raw``: 400 is a refusal of the request
    (EngineRequestError), 503 EngineUnavailableError, anything else the engine's fault (EngineError)."""
    msg, param = _error_message(raw)
    if status == 400:
        return EngineRequestError(msg, param)
    if status == 503:
        return EngineUnavailableError(f"engine unavailable ({status}): {msg}")
    return EngineError(f"engine error {status}: {msg}")


def _chunks(data: str, k: int, expected: list[int | None] | None = None) -> list[CompletionChunk]:
    """One SSE ``data`` payload of vLLM's completions or chat stream -> its chunks (``k``: top logprobs asked;
    ``expected``: a mixed prompt's ids, checked against the ``prompt_token_ids`` of the chat stream's first
    chunk). A chat chunk's text is its ``delta.content``; a chunk with neither text, tokens nor a finish reason
    (the chat stream's first, the assistant role) gives none. Raises EngineRequestError / EngineUnavailableError
    / EngineError for an error object (by its ``code``: see :func:`_refusal`), EngineError for a payload that is
    not such a JSON object or a mixed prompt vLLM tokenized differently."""
    try:
        obj = json.loads(data)
        if "error" in obj:  # after the 200: a request it refuses late (4xx code), or a failure
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            raise _refusal(code if isinstance(code, int) and code in (400, 503) else 500, data)
        if expected is not None and obj.get("prompt_token_ids") is not None:
            _check_prompt_ids(obj["prompt_token_ids"], expected)
        out = []
        for c in obj.get("choices") or []:
            if "delta" in c:
                chunk = CompletionChunk((c["delta"] or {}).get("content") or "", list(c.get("token_ids") or []),
                                        parse_chat_logprobs(c.get("logprobs"), k), c.get("finish_reason"))
                if not (chunk.text or chunk.token_ids or chunk.finish_reason):
                    continue
            else:
                chunk = CompletionChunk(c.get("text") or "", list(c.get("token_ids") or []),
                                        parse_logprobs(c.get("logprobs"), k), c.get("finish_reason"))
            out.append(chunk)
        usage = obj.get("usage")
        if usage and not obj.get("choices"):
            out.append(CompletionChunk("", [], None, None, int(usage["completion_tokens"])))
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        if isinstance(exc, EngineRequestError):
            raise
        raise EngineError(f"the language-model engine sent a malformed stream line ({type(exc).__name__}): "
                          f"{data[:200]!r}") from None


async def _closes_with_loop(pool: httpx.AsyncClient) -> AsyncIterator[None]:
    """A suspended async generator that closes ``pool`` when it is closed: ``asyncio.run`` (and
    ``loop.shutdown_asyncgens()``) closes every unfinished async generator of a loop before the loop ends, so a pool
    never outlives its loop with open sockets."""
    try:
        yield
    finally:
        await pool.aclose()


class VLLMClient:
    """Async client of the ``/v1/completions`` of the vLLM server that ``server`` supervises (see the module
    docstring); reads the server's address per request (it moves after a failed start).

    ``stream(request)`` (a :class:`~core.llm_client.CompletionRequest`, :func:`request_body`) and
    ``stream_body(body)`` (a body as is) yield :class:`CompletionChunk` until the engine's ``[DONE]``; raise
    EngineUnavailableError / EngineRequestError / EngineError. ``timeout_s`` bounds connecting and each read
    (seconds). ``state`` and ``wait_ready`` are the server's; ``await stats()`` the engine's counters;
    ``close()`` stops the server and closes the pool. Structured outputs are supported.

    Completions share one ``httpx.AsyncClient`` (a keep-alive pool of at most ``max_connections`` connections,
    all of them kept alive when idle; a request beyond that waits for a free one, as it would wait in vLLM's
    queue: size it at least the deployment's ``max_ongoing_requests``). An ``httpx.AsyncClient`` belongs to the
    event loop it was first used on (a replica has one for its life); a call from another loop (a test's or bench's
    next ``asyncio.run``) gets a new pool; the old one is closed when its loop shuts down (``asyncio.run``'s end:
    :func:`_closes_with_loop`), or at once on its loop if that still runs in another thread. ``aclose()`` closes
    the pool (the server keeps running).

    ``tokenizer``: the served LLM's (a ``transformers`` tokenizer), for an embeddings prompt that says which rows
    are token ids (``CompletionRequest.prompt_token_ids``, the VLM's image prompts): such a prompt goes to
    ``/v1/chat/completions`` as vLLM's mixed prompt (:func:`request_body`; the server started with
    :data:`MIXED_CHAT_TEMPLATE`). Without one, every embeddings prompt goes to ``/v1/completions`` as
    embeddings alone."""

    def __init__(self, server: Server, timeout_s: float = 600.0, max_connections: int = 64, tokenizer: Any = None):
        self.server = server
        self.tokenizer = tokenizer
        self.timeout = httpx.Timeout(timeout_s, connect=5.0, pool=None)
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._pool: httpx.AsyncClient | None = None
        self._pool_loop: asyncio.AbstractEventLoop | None = None
        self.pools_opened = 0  # pools made so far (one per event loop used): for tests and benches
        self._pool_guard: AsyncIterator[None] | None = None  # closes the pool when its loop shuts down
        self._speculates: bool | None = None  # whether the server's /metrics has spec-decode counters (once seen)
        self._open_streams = 0  # completions whose response vLLM has begun and not ended (stats()["open_streams"])

    supports_structured_outputs = True

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

    async def _client(self) -> httpx.AsyncClient:
        """The pool of the running event loop (made on first use; see the class docstring)."""
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:
            self._drop_pool()
            self._pool = httpx.AsyncClient(timeout=self.timeout, limits=self.limits)
            self._pool_loop = loop
            self.pools_opened += 1
            self._pool_guard = _closes_with_loop(self._pool)
            await self._pool_guard.__anext__()
        return self._pool

    def _drop_pool(self) -> None:
        """Forget the pool; close it on its own loop when that loop runs in another thread (else it ended with
        its loop, or the caller is on it and awaits :meth:`aclose`)."""
        pool, loop, self._pool, self._pool_loop = self._pool, self._pool_loop, None, None
        if pool is None or loop is None or loop.is_closed() or not loop.is_running():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(pool.aclose())
        else:
            asyncio.run_coroutine_threadsafe(pool.aclose(), loop)

    async def aclose(self) -> None:
        """Close the connection pool (idempotent; a later request opens a new one). The server keeps running."""
        pool, loop = self._pool, self._pool_loop
        if pool is not None and loop is asyncio.get_running_loop():
            self._pool = self._pool_loop = None
            await pool.aclose()
        else:
            self._drop_pool()

    def close(self) -> None:
        """Stop the server and its supervision and close the pool (idempotent)."""
        self._drop_pool()
        self.server.stop()

    async def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]:
        """Stream the completion of ``request`` (:func:`request_body` with this client's tokenizer; an embedding
        prompt is encoded in a worker thread). Closing the iterator closes the HTTP stream, which aborts the
        request in vLLM."""
        if request.prompt_is_ids:
            body = request_body(request, tokenizer=self.tokenizer)
        else:
            body = await asyncio.to_thread(request_body, request, SERVED_NAME, self.tokenizer)
        stream = self.stream_body(body)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def stats(self) -> dict[str, Any]:
        """``backend`` ``vllm``; ``active``: requests vLLM holds (running + waiting), ``generated_tokens`` since
        the server started (both from its ``/metrics``; None while it does not answer); ``engine_state``,
        ``engine_pid`` (the API server's process id), ``engine_restarts`` (the supervisor's, when it keeps
        them), ``open_streams``: completions of this client whose response vLLM has begun (status 200 received)
        and not yet ended, counted here, so it holds while vLLM's own counters lag (its API server starved of CPU)."""
        try:
            active, generated = await self.requests_in_engine(), await self.generated_tokens()
        except EngineUnavailableError:
            active = generated = None
        server = self.server
        return {"backend": "vllm", "active": active, "generated_tokens": generated, "engine_state": server.state,
                "engine_pid": getattr(server, "server_pid", None), "engine_restarts": getattr(server, "restarts", None),
                "open_streams": self._open_streams}

    async def stream_body(self, body: dict[str, Any]) -> AsyncIterator[CompletionChunk]:
        """Stream one completion of a streaming request ``body`` as given (tests, benches): to
        ``/v1/chat/completions`` when it has ``messages`` (a mixed prompt, :func:`request_body`; its
        ``_expected_prompt_ids``, taken out of the body sent, are checked against the prompt ids vLLM returns),
        else to ``/v1/completions``."""
        chat = "messages" in body
        expected = None
        if chat:
            body = dict(body)
            expected = body.pop("_expected_prompt_ids", None)
            k = body.get("top_logprobs") or 0 if body.get("logprobs") else 0
        else:
            k = body.get("logprobs") or 0
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            client = await self._client()
            async with client.stream("POST", f"{self.base_url}{path}", json=body) as r:
                if r.status_code >= 400:
                    raise _refusal(r.status_code, await r.aread())
                self._open_streams += 1
                try:
                    done = False
                    async for line in r.aiter_lines():  # read to the end after [DONE]: only a whole response
                        if done or not line.startswith("data: "):  # lets the connection go back to the pool
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            continue
                        for chunk in _chunks(data, k, expected):
                            yield chunk
                finally:
                    self._open_streams -= 1
        except httpx.HTTPError as exc:  # refused, reset, or cut mid-stream: the engine process is not serving
            raise EngineUnavailableError(f"the language-model engine is unavailable: {type(exc).__name__}") \
                from None

    async def metrics_text(self) -> str:
        """The Prometheus text of the server's ``/metrics`` (vLLM's ``vllm:*`` families). Raises
        EngineUnavailableError when the server does not answer."""
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                return (await client.get(f"{self.base_url}/metrics")).text
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"the language-model engine is unavailable: {type(exc).__name__}") \
                from None

    async def spec_decode(self) -> dict[str, Any] | None:
        """vLLM's speculative-decoding counters since the server started (:func:`core.spec.acceptance.spec_counters`
        of :meth:`metrics_text`); None when the server does not speculate (then remembered: the server's command
        line does not change, so later calls do not fetch). Raises EngineUnavailableError when the server does not
        answer."""
        from .spec.acceptance import spec_counters

        if self._speculates is False:
            return None
        counters = spec_counters(await self.metrics_text())
        self._speculates = counters is not None
        return counters

    async def engine_metric(self, *names: str) -> float:
        """The sum of vLLM's Prometheus ``/metrics`` samples named ``names`` (over every label set), e.g.
        ``vllm:generation_tokens_total``. Raises EngineUnavailableError when the server does not answer."""
        text = await self.metrics_text()
        total = 0.0
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                total += float(line.rsplit(" ", 1)[1])
        return total

    async def requests_in_engine(self) -> int:
        """Requests vLLM holds now (running + waiting: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``).
        Raises EngineUnavailableError when the server does not answer."""
        return int(await self.engine_metric("vllm:num_requests_running", "vllm:num_requests_waiting"))

    async def generated_tokens(self) -> int:
        """Tokens vLLM has generated since it started, all requests (``vllm:generation_tokens_total``): the work
        done, which a cancellation test compares. Raises EngineUnavailableError when the server does not answer."""
        return int(await self.engine_metric("vllm:generation_tokens_total"))

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 within 2 s."""
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(f"{self.base_url}/health")).status_code == 200
        except httpx.HTTPError:
            return False
