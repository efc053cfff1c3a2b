"""The one seam between an engine and its language model: the :class:`LLMClient` protocol, the typed
:class:`CompletionRequest` it takes, the :class:`CompletionChunk` s it streams, and the errors it raises.

Two implementations, one protocol, so that nothing above a client branches on where the model runs:

- :class:`core.vllm_client.VLLMClient`: a supervised vLLM OpenAI server over HTTP (``/v1/completions``; the
  serving layer starts the process, ``services/engines/process.py``, and hands the engine the client);
- the in-process ``transformers`` references: :class:`grafting.local_client.TransformersClient` (the VLM's LLM,
  continuous batching in this process) and :class:`audio.local_client.TransformersSpeechClient` (the speech LM).

Which one an engine gets is decided in one place per family (``grafting/backend.py``, ``audio/backend.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
    """One streamed step: new ``text`` (incrementally detokenised by the client, stop strings cut: the text of the
    answer so far is the join of the chunks' texts), the new ``token_ids`` (every sampled id; the stop token that
    ended the answer included, as vLLM reports it), their ``logprobs`` (one per token id, when requested),
    ``finish_reason`` (``stop`` | ``length`` on the chunk of the last token, else None), and on the final usage
    chunk (no text, no ids) ``completion_tokens`` (else None). A token that completes a stop string comes in a
    chunk of its own, with the text before the stop string and ``finish_reason`` ``stop``."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None


@dataclass
class CompletionRequest:
    """One completion, whatever serves it.

    ``prompt``: token ids (``list[int]``) or prompt embeddings (a float ``torch.Tensor`` of shape ``(T, H)``, the
    LLM's hidden size ``H``, in the LLM's dtype: e.g. projected image features spliced into the text's embedding
    rows). ``max_tokens`` new tokens at most. Sampling: ``temperature`` (0 = greedy), ``top_p`` in (0, 1],
    ``top_k`` (0 = off), ``repetition_penalty`` (CTRL's, 1 = off; over the prompt's ids when the prompt is ids,
    and the answer's), ``seed`` (None: unseeded; taken modulo 2**63). ``stop``: strings that end the answer (not
    included in the text); ``stop_token_ids``: ids that end it (reported in ``token_ids``, no text).
    ``logprobs``: None for none, else the number (0-20) of top alternatives besides each sampled token's own.
    ``banned_tokens``: ids never sampled, each with its token's text (``{id: text}``; the text must tokenize to
    exactly that one id: a server that bans by text, vLLM's ``bad_words``, re-tokenizes it).
    ``structured_outputs``: vLLM's ``StructuredOutputsParams`` as a dict (``{"json": schema}`` or ``{"json_object": True}``; only where :attr:`LLMClient.supports_structured_outputs`).
    ``extra_args``: per-request arguments of a custom logits processor (vLLM's ``vllm_xargs``; the in-process
    client of the same family reads the same keys). ``skip_special_tokens``: leave special tokens out of the text.
    ``prompt_token_ids``: for an embeddings prompt, what each of its ``T`` rows is: the token id whose own
    input-embedding row it is, or None where it is something else (a projected image feature); None (the
    default) when unknown. A client may send the rows with an id as that id (vLLM's mixed prompt:
    :func:`core.vllm_client.request_body`), which is the same input; the in-process client uses the rows.
    """

    prompt: Any
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    banned_tokens: dict[int, str] = field(default_factory=dict)
    structured_outputs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    prompt_token_ids: list[int | None] | None = None

    @property
    def prompt_is_ids(self) -> bool:
        """True when ``prompt`` is a list of token ids (else a ``(T, H)`` embedding tensor)."""
        return isinstance(self.prompt, (list, tuple))


class LLMClient(Protocol):
    """A language model an engine talks to (see the module docstring).

    ``state``: ``ready`` when it can serve now, else ``starting`` | ``restarting`` | ``failed`` | ``stopped``.
    ``supports_structured_outputs``: whether ``CompletionRequest.structured_outputs`` is honoured.
    ``stream(request)``: the answer to a :class:`CompletionRequest` as :class:`CompletionChunk` s (the last one the
    usage chunk); closing the iterator early aborts the request; raises EngineUnavailableError /
    EngineRequestError / EngineError. ``wait_ready(timeout)``: block until ``ready`` (True) or
    ``failed``/``stopped``/``timeout`` seconds (False). ``await stats()``: a JSON-able dict with at least
    ``backend`` (``transformers`` | ``vllm``), ``active`` (requests held now; None while unknown) and
    ``generated_tokens`` (since start, all requests; None while unknown). ``await spec_decode()``: the engine's
    speculative-decoding counters since it started (:func:`core.spec.acceptance.spec_counters`' dict), None where
    it does not speculate. ``close()``: release the model (a batcher thread joins, an engine process stops);
    idempotent.
    """

    @property
    def state(self) -> str: ...

    @property
    def supports_structured_outputs(self) -> bool: ...

    def stream(self, request: CompletionRequest) -> AsyncIterator[CompletionChunk]: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    async def stats(self) -> dict[str, Any]: ...

    async def spec_decode(self) -> dict[str, Any] | None: ...

    def close(self) -> None: ...
