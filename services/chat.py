"""Image question answering: ``POST /v1/chat/completions`` (OpenAI chat format, plain and SSE streaming).

The ``Deployment`` wraps :class:`grafting.engine.VLMEngine` in a Ray Serve replica; the router validates the
request, streams events from the deployment, and shapes ``chat.completion`` / ``chat.completion.chunk``
objects. A client disconnect closes the stream, which cancels generation in the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from sse_starlette.sse import EventSourceResponse

from core.llm_client import EngineError

from . import metrics
from .app import check_model, json_object
from .backends import Backend
from .errors import APIError, error_body, to_api_error
from .profiles import FamilySection, Profile
from .routing import PAYLOAD_KEY, image_routing_keys


class Deployment:
    """Ray Serve deployment of the grafted VLM: one engine per replica. With the ``transformers`` backend,
    concurrent requests are decoded together by the engine's continuous batcher (up to ``max_batch_size``); with
    ``vllm`` the replica owns a supervised vLLM server process (started here, restarted when it dies, stopped
    with the replica) whose continuous batching serves them, and ``ready()`` is False while it is down.

    ``chat_stream(request)`` is an async generator of events: ``{"type": "start", "prompt_tokens"}``, then
    ``{"type": "delta", "text"}`` per token, then ``{"type": "end", "finish_reason", "completion_tokens"}``.
    Input errors (PromptError, ImageInputError) come as a single ``{"type": "error", ...}`` event instead.
    Both backends yield the same events. An engine failure (the vLLM process died or is restarting) raises
    EngineUnavailableError (HTTP 503 ``engine_unavailable``; mid-stream an SSE error event); a malformed answer
    from the engine, or any other ValueError that is not an input error (:func:`is_input_error`), raises
    EngineError (HTTP 500 ``engine_error``), never a 400.
    Closing the generator (client gone) drops the request from the batch before the next decode step (vllm:
    closes the HTTP stream, which aborts the request there).
    """

    def __init__(self, section: dict, model_dir: str):
        import torch

        from grafting.config import VLMConfig
        from grafting.engine import VLMEngine
        from grafting.token_bytes import TokenBytes

        cfg = FamilySection[VLMConfig].model_validate(section)
        if cfg.deployment.torch_threads:
            torch.set_num_threads(cfg.deployment.torch_threads)
        self.server = None  # the vLLM server process this replica owns (backend vllm)
        llm_client = None
        if cfg.engine.backend == "vllm":
            from .vllm_server import start_vllm_for

            llm_client = start_vllm_for(cfg.engine, model_dir)
            self.server = llm_client.server
        self.llm_client = llm_client
        try:
            self.engine = VLMEngine.from_config(cfg.engine, model_dir, backend=cfg.engine.backend,
                                                llm_client=llm_client)
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise
        self.batcher = self.engine.batcher() if self.engine.backend == "transformers" else None
        self.token_bytes = TokenBytes(self.engine.tokenizer)  # logprob ``bytes`` of a token id

    async def ready(self) -> bool:
        """True once the engine is loaded (the constructor has returned) and, with the ``vllm`` backend, while
        its server process is up and healthy."""
        return self.engine.ready()

    def check_health(self) -> None:
        """Ray Serve's periodic replica health check. Raises RuntimeError when the vllm backend's server has given
        up (state ``failed``: its starts keep failing), so that Ray replaces the replica; a server that is starting
        or restarting is healthy (``ready()`` answers for it)."""
        if self.server is not None and self.server.state == "failed":
            raise RuntimeError(f"the vLLM server failed: {self.server.last_error}")

    async def stats(self) -> dict:
        """Backend state: ``backend``; ``generated_tokens``, tokens generated since start over all requests (the
        work done; None while the engine is down); transformers: ``active`` rows being decoded now,
        ``max_batch_seen`` since start; vllm: ``active`` requests vLLM holds (running + waiting, from its
        ``/metrics``; None while the engine is down), ``engine_state``, ``engine_pid`` (vLLM's API server process),
        ``engine_restarts``."""
        if self.batcher is not None:
            return {"backend": "transformers", "active": self.batcher.active,
                    "max_batch_seen": self.batcher.max_batch_seen, "generated_tokens": self.batcher.generated_tokens}
        from core.llm_client import EngineUnavailableError

        server = self.server
        try:
            active, generated = await self.llm_client.requests_in_engine(), await self.llm_client.generated_tokens()
        except EngineUnavailableError:
            active = generated = None
        return {"backend": "vllm", "active": active, "generated_tokens": generated, "engine_state": server.state,
                "engine_pid": server.server_pid, "engine_restarts": server.restarts}

    def __del__(self):
        """Replica shutdown (Ray Serve calls this once in-flight requests are done): release the engine and stop
        the vLLM server process this replica owns."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()

    def _logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict:
        """OpenAI ``ChatCompletionTokenLogprob``: token text, its raw bytes (:class:`grafting.token_bytes.TokenBytes`:
        a token holding part of a multi-byte character has those bytes, so the answer's tokens' bytes joined are
        its UTF-8), logprob, top alternatives (the same fields each)."""
        def one(tid: int, lp: float) -> dict:
            return {"token": self.engine.tokenizer.decode([tid]), "logprob": lp,
                    "bytes": list(self.token_bytes(tid))}

        entry = one(token_id, logprob)
        entry["top_logprobs"] = [one(t, v) for t, v in (top or [])]
        return entry

    async def chat_stream(self, request: dict[str, Any]):
        """Prepare and generate an answer to ``request`` (messages + sampling fields), streaming events."""
        engine = self.engine
        try:
            prompt = await asyncio.to_thread(engine.prepare, request["messages"])
            params = engine.sampling_params(request.get("max_tokens"), request.get("temperature"),
                                            request.get("top_p"), request.get("seed"), request.get("stop"),
                                            request.get("logprobs"), request.get("top_logprobs"))
            response_format = engine.response_format(request.get("response_format"))
        except ValueError as exc:  # bad input: answered as a 4xx, not logged as a replica failure
            if not is_input_error(exc):  # any other ValueError is ours, not the client's (to_api_error: 400)
                raise engine_fault(exc) from exc
            yield input_error_event(exc)
            return
        async for ev in self._events(prompt, params, response_format):
            yield ev

    async def _events(self, prompt, params, response_format):
        """``chat_stream``'s events after validation, the same for both backends: ``start``, ``delta``s, ``end``.
        A refusal before the first token (vLLM cannot compile a schema; the context check) is an input error
        event like ours; an unavailable engine raises. Closing this generator (the client went away) closes the
        generation: the transformers batcher drops the row, vLLM aborts the request."""
        from grafting.collapse_guard import GuardReport

        report = GuardReport()
        gen = self._guarded(prompt, params, response_format, report)
        try:
            try:
                d = await gen.__anext__()
            except ValueError as exc:
                if not is_input_error(exc):
                    raise engine_fault(exc) from exc
                yield input_error_event(exc)
                return
            yield {"type": "start", "prompt_tokens": prompt.num_tokens, "image_tokens": prompt.num_image_tokens}
            while True:
                if d.text or d.finish_reason is None:
                    ev = {"type": "delta", "text": d.text}
                    if d.logprob is not None:
                        ev["logprobs"] = [self._logprob_entry(d.token_id, d.logprob, d.top_logprobs)]
                    yield ev
                if d.finish_reason is not None:
                    yield {"type": "end", "finish_reason": d.finish_reason, "completion_tokens": d.completion_tokens,
                           **self._end_extras(report)}
                    return
                try:
                    d = await gen.__anext__()
                except ValueError as exc:
                    if not is_input_error(exc):
                        raise engine_fault(exc) from exc
                    raise
        finally:
            await gen.aclose()

    # --- issue 11 hooks: the collapse guard over both backends' Delta streams, image-cache stats in end events --
    def _batcher_attempt(self, prompt, params):
        """One generation on the transformers backend's batcher as an async iterator of Delta events (closing
        it drops the row from the batch at its next step)."""
        async def gen():
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            cancel = threading.Event()
            self.batcher.submit(prompt, params, cancel,
                                lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
            try:
                while True:
                    d = await queue.get()
                    if isinstance(d, BaseException):
                        raise d
                    yield d
                    if d.finish_reason is not None:
                        return
            finally:
                cancel.set()
        return gen()

    def _guarded(self, prompt, params, response_format, report):
        """The answer's Delta stream through the collapse guard (``vlm.engine.collapse_guard``). Off for
        ``response_format`` answers: a JSON grammar cannot resume in the middle of an answer."""
        from grafting.collapse_guard import guarded_stream

        cfg = self.engine.config.collapse_guard
        if response_format is not None:
            cfg = cfg.model_copy(update={"enabled": False})
        if self.engine.backend == "vllm":
            def attempt(p, sp):
                return self.engine.agenerate(p, sp, response_format)
        else:
            attempt = self._batcher_attempt
        return guarded_stream(attempt, prompt, params, cfg, self.engine.tokenizer, report)

    def _end_extras(self, report) -> dict:
        """What an ``end`` event carries for /metrics (``metrics.observe_vlm_end_event``): this replica's
        image-cache counters and the answer's collapse-guard report."""
        out = {"collapse": dataclasses.asdict(report)}
        cache = self.engine.model.image_cache
        if cache is not None:
            out["image_cache"] = {"replica": _replica_name(), "stats": cache.stats().as_dict()}
        return out


def _replica_name() -> str:
    """This Ray Serve replica's id (the process id outside Ray Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica (LocalBackend: tests, notebooks)
        return f"pid{os.getpid()}"


def is_input_error(exc: BaseException) -> bool:
    """True for the errors the chat path answers as the client's fault (4xx): ValueErrors carrying a 4xx
    ``status_code`` (``PromptError``: a malformed conversation, ``ImageInputError``: a bad image,
    ``EngineRequestError``: a request vLLM refused with a 400, e.g. a schema it cannot compile)."""
    status = getattr(exc, "status_code", None)
    return isinstance(exc, ValueError) and isinstance(status, int) and 400 <= status < 500


def engine_fault(exc: ValueError) -> Exception:
    """A ValueError from the engine's side that is not an input error (:func:`is_input_error`) as the engine's
    fault: :class:`core.llm_client.EngineError` (HTTP 500 ``engine_error``), never a 400 blaming the client."""
    return EngineError(f"the engine failed: {type(exc).__name__}: {exc}")


def input_error_event(exc: Exception) -> dict:
    """An input error as a stream event: ``{"type": "error", "status", "message", "param", "code"}``."""
    return {"type": "error", "status": getattr(exc, "status_code", 400), "message": str(exc),
            "param": getattr(exc, "param", None), "code": getattr(exc, "code", None)}


def raise_if_error_event(event: dict) -> None:
    """Raise the APIError carried by an ``error`` event (see :func:`input_error_event`)."""
    if event.get("type") == "error":
        raise APIError(event["status"], event["message"], param=event.get("param"), code=event.get("code"))


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` (a last chunk with ``usage``) and ``include_obfuscation`` (only
    false or null: the service does not pad chunks). Other keys are a 400."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


def _is_number(v: Any, value: float) -> bool:
    """True when ``v`` is a JSON number (not a bool) equal to ``value``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == value


# OpenAI chat fields the service does not implement, each with the values that mean exactly what leaving the
# field out means (null always does). Any other value is a 400 ``unsupported_parameter`` naming the field.
NO_OP_VALUES: dict[str, Callable[[Any], bool]] = {
    "audio": lambda v: False,
    "frequency_penalty": lambda v: _is_number(v, 0),
    "function_call": lambda v: v == "none",
    "functions": lambda v: False,
    "logit_bias": lambda v: v == {},
    "metadata": lambda v: v == {},
    "modalities": lambda v: v == ["text"],
    "moderation": lambda v: False,
    "parallel_tool_calls": lambda v: False,
    "prediction": lambda v: False,
    "presence_penalty": lambda v: _is_number(v, 0),
    "prompt_cache_key": lambda v: False,
    "prompt_cache_options": lambda v: False,
    "prompt_cache_retention": lambda v: False,
    "reasoning_effort": lambda v: v == "none",
    "safety_identifier": lambda v: False,
    "service_tier": lambda v: v in ("auto", "default"),
    "store": lambda v: v is False,
    "tool_choice": lambda v: v == "none",
    "tools": lambda v: False,
    "user": lambda v: False,
    "verbosity": lambda v: v == "medium",
    "web_search_options": lambda v: False,
}


class ChatRequest(BaseModel):
    """A ``POST /v1/chat/completions`` body. No field is accepted and silently ignored; the rule, per field of
    OpenAI's chat completions request (``openai.types.chat.completion_create_params``):

    - Honoured (declared below): ``model``, ``messages``, ``max_tokens`` / ``max_completion_tokens`` (both given
      and different: 400), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``
      (``include_usage``; ``include_obfuscation`` only false; only with ``stream: true``), ``n`` (1 only),
      ``logprobs`` / ``top_logprobs``, ``response_format`` (``text``; ``json_object`` and ``json_schema`` on the
      ``vllm`` backend, through vLLM's structured outputs; the ``transformers`` backend answers 400
      ``unsupported_parameter`` for them).
    - Not implemented (:data:`NO_OP_VALUES`): accepted only at null or at the value that means the same as leaving
      it out: ``frequency_penalty`` / ``presence_penalty`` 0, ``logit_bias`` / ``metadata`` ``{}``, ``tool_choice`` / ``function_call`` ``"none"``, ``store`` false,
      ``modalities`` ``["text"]``, ``service_tier`` ``"auto"`` / ``"default"`` (there is one tier),
      ``reasoning_effort`` ``"none"``, ``verbosity`` ``"medium"`` (OpenAI's default). ``audio``, ``functions``,
      ``tools``, ``parallel_tool_calls``, ``prediction``, ``moderation``, ``web_search_options``, ``user``,
      ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_options`` and ``prompt_cache_retention``: null
      only. Any other value: 400 ``unsupported_parameter``, ``param`` the field.
    - Any field OpenAI does not define (``top_k``, ``repetition_penalty``, a typo): 400 ``unsupported_parameter``,
      whatever its value.
    - Message fields other than ``role`` and ``content`` (``name``, ``tool_calls``, ...) are refused by the
      processor (``grafting/processor.py``) the same way.

    Types are strict: ``"stream": "yes"`` or ``"max_tokens": true`` are 400 ``invalid_value``, not coerced.
    Build with :meth:`parse`, which applies the rule above; raises APIError."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    messages: list[Any]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    n: StrictInt | None = None
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict | None = None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "ChatRequest":
        """Validate a JSON body: unsupported fields or values -> APIError 400 ``unsupported_parameter`` (first in
        body order); wrong types -> APIError 400 ``invalid_value``."""
        for key, value in data.items():
            if key in cls.model_fields or value is None and key in NO_OP_VALUES:
                continue
            if key in NO_OP_VALUES:
                if NO_OP_VALUES[key](value):
                    continue
                msg = f"{key} is not supported by this service (only null or its no-op default is accepted)"
            else:
                msg = f"{key} is not a supported chat completions parameter"
            raise APIError(400, msg, param=key, code="unsupported_parameter")
        req = validate_model(cls, {k: v for k, v in data.items() if k in cls.model_fields})
        opts = req.stream_options
        if opts is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                           code="unsupported_parameter")
        if opts is not None and opts.include_obfuscation:
            raise APIError(400, "stream_options.include_obfuscation is not supported (only false)",
                           param="stream_options.include_obfuscation", code="unsupported_parameter")
        if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens disagree (send one of them)",
                           param="max_tokens", code="invalid_value")
        return req


def validate_model(model: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    """``model.model_validate(data)``; a pydantic error -> APIError 400 whose ``param`` is the request field
    (``stream_options.<key>`` inside stream options; pydantic's union-member tags dropped): an unknown key there
    is ``unsupported_parameter``, a wrong type ``invalid_value``."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = [str(x) for x in e["loc"]]
        param = loc[0] if loc else None
        if loc[:1] == ["stream_options"] and len(loc) > 1:
            param = f"stream_options.{loc[1]}"
        code = "unsupported_parameter" if e["type"] == "extra_forbidden" else "invalid_value"
        raise APIError(400, f"{param}: {e['msg']}", param=param, code=code) from None


def make_router(section: FamilySection, backend: Backend, profile: Profile) -> APIRouter:
    """Routes of the VLM family: ``POST /v1/chat/completions``."""
    router = APIRouter(tags=["chat"])

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI chat completions with images (base64 data URLs) in user turns; ``stream`` gives SSE chunks."""
        t0 = time.perf_counter()
        req = ChatRequest.parse(await json_object(request))
        model_id = check_model(profile, "vlm", req.model)
        if req.n not in (None, 1):
            raise APIError(400, "n must be 1", param="n", code="invalid_value")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens", code="invalid_value")
        if not req.messages:
            raise APIError(400, "messages must be a non-empty list", param="messages", code="empty_messages")
        payload = {"messages": req.messages, "max_tokens": max_tokens, "temperature": req.temperature,
                   "top_p": req.top_p, "seed": req.seed, "stop": req.stop, "logprobs": req.logprobs,
                   "top_logprobs": req.top_logprobs, "response_format": req.response_format}
        payload[PAYLOAD_KEY] = image_routing_keys(req.messages)  # issue 11 hook: cache-aware routing
        stream = backend.stream("chat_stream", payload)
        try:
            start = await stream.__anext__()
            raise_if_error_event(start)
        except Exception as exc:  # noqa: BLE001 - input errors surface here, before any byte is sent
            await stream.aclose()
            raise to_api_error(exc) from None
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        timing = {"first": None, "last": None}

        def observe_token(now: float) -> None:
            if timing["first"] is None:
                timing["first"] = now
                metrics.TTFT.labels(model_id).observe(now - t0)
            else:
                metrics.ITL.labels(model_id).observe(now - timing["last"])
            timing["last"] = now
            metrics.TOKENS.labels(model_id).inc()

        if not req.stream:
            parts, end, token_logprobs = [], None, []
            metrics.ACTIVE_CHAT.labels(model_id).inc()
            try:
                async for ev in stream:
                    if ev["type"] == "delta":
                        observe_token(time.perf_counter())
                        parts.append(ev["text"])
                        token_logprobs += ev.get("logprobs", [])
                    elif ev["type"] == "end":
                        end = ev
                        metrics.observe_vlm_end_event(model_id, ev)
            except Exception as exc:  # noqa: BLE001
                raise to_api_error(exc) from None
            finally:
                metrics.ACTIVE_CHAT.labels(model_id).dec()
                await stream.aclose()
            usage = {"prompt_tokens": start["prompt_tokens"], "completion_tokens": end["completion_tokens"],
                     "total_tokens": start["prompt_tokens"] + end["completion_tokens"]}
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": model_id,
                "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts), "refusal": None},
                             "logprobs": {"content": token_logprobs, "refusal": None} if req.logprobs else None,
                             "finish_reason": end["finish_reason"]}],
                "usage": usage})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, finish_reason: str | None = None, usage: dict | None = None, choices: bool = True,
                  logprobs: list | None = None):
            lp = {"content": logprobs, "refusal": None} if logprobs else None
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                    "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]
                    if choices else []}
            if usage is not None:
                body["usage"] = usage
            return json.dumps(body)

        async def events():
            metrics.ACTIVE_CHAT.labels(model_id).inc()
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for ev in stream:
                    if ev["type"] == "delta":
                        observe_token(time.perf_counter())
                        if ev["text"] or ev.get("logprobs"):
                            yield chunk({"content": ev["text"]}, logprobs=ev.get("logprobs"))
                    elif ev["type"] == "end":
                        metrics.observe_vlm_end_event(model_id, ev)
                        yield chunk({}, ev["finish_reason"])
                        if include_usage:
                            n = ev["completion_tokens"]
                            yield chunk({}, usage={"prompt_tokens": start["prompt_tokens"], "completion_tokens": n,
                                                   "total_tokens": start["prompt_tokens"] + n}, choices=False)
                yield "[DONE]"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an error mid-stream is sent as an SSE error event
                err = to_api_error(exc)
                yield json.dumps(error_body(err.message, err.type, err.param, err.code))
            finally:
                metrics.ACTIVE_CHAT.labels(model_id).dec()
                await stream.aclose()

        return EventSourceResponse(events(), ping=15, sep="\n")

    return router
