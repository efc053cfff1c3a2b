"""What an engine needs from a language-model engine process: the :class:`LLMClient` protocol, the chunks it
streams, and the errors it raises (the VLM's and the speech LM's ``vllm`` backends alike).

Model code never imports ``services/``: the serving layer starts and owns the engine process (vLLM's
OpenAI-compatible server, ``services/engines/process.py``) and hands the engine a client of it
(:class:`core.vllm_client.VLLMClient`, over HTTP); :class:`grafting.engine.VLMEngine` and
:class:`audio.engine.TTSEngine` receive such a client by injection and send it plain vLLM ``/v1/completions``
request bodies (:class:`grafting.vllm_backend.CompletionRequest`, ``audio/vllm_backend.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol


class EngineUnavailableError(RuntimeError):
    """The engine process is down, restarting, or dropped the request: HTTP 503 ``engine_unavailable``."""

    status_code = 503
    code = "engine_unavailable"
    param = None


class EngineError(RuntimeError):
    """The engine answered with something malformed (a stream line that is not JSON, a chunk without its
    fields, a logprob token that is not an id) or failed the request itself (a 5xx other than 503): the engine's
    fault, never the client's. HTTP 500 ``engine_error``."""

    status_code = 500
    code = "engine_error"
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


class LLMClient(Protocol):
    """A client of one supervised engine process serving vLLM's ``/v1/completions``.

    ``state``: ``ready`` when it can serve now, else ``starting`` | ``restarting`` | ``failed`` | ``stopped``.
    ``stream(body)``: the engine's answer to a streaming completions request body as :class:`CompletionChunk`
    (the last one carries ``completion_tokens``); closing the iterator early aborts the request in the engine;
    raises EngineUnavailableError / EngineRequestError / EngineError. ``wait_ready(timeout)``: block until ``ready`` (True) or
    ``failed``/``stopped``/``timeout`` seconds (False). ``close()``: release the engine (its process stops);
    idempotent.
    """

    @property
    def state(self) -> str: ...

    def stream(self, body: dict[str, Any]) -> AsyncIterator[CompletionChunk]: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...
