"""Image question answering: ``POST /v1/chat/completions`` (OpenAI chat format, plain and SSE streaming).

The ``Deployment`` wraps :class:`grafting.engine.VLMEngine` in a Ray Serve replica; the router validates the
request, streams events from the deployment, and shapes ``chat.completion`` / ``chat.completion.chunk``
objects. A client disconnect closes the stream, which cancels generation in the replica.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from sse_starlette.sse import EventSourceResponse

from . import metrics
from .app import check_model, json_object
from .backends import Backend
from .errors import APIError, error_body, to_api_error
from .profiles import FamilySection, Profile


class Deployment:
    """Ray Serve deployment of the grafted VLM: one engine per replica; concurrent requests are decoded together
    by the engine's continuous batcher (up to ``max_batch_size``).

    ``chat_stream(request)`` is an async generator of events: ``{"type": "start", "prompt_tokens"}``, then
    ``{"type": "delta", "text"}`` per token, then ``{"type": "end", "finish_reason", "completion_tokens"}``.
    Input errors (PromptError, ImageInputError) come as a single ``{"type": "error", ...}`` event instead.
    Closing the generator (client gone) drops the request from the batch before the next decode step.
    """

    def __init__(self, section: dict, model_dir: str):
        import torch

        from grafting.config import VLMConfig
        from grafting.engine import VLMEngine

        cfg = FamilySection[VLMConfig].model_validate(section)
        if cfg.deployment.torch_threads:
            torch.set_num_threads(cfg.deployment.torch_threads)
        self.engine = VLMEngine.from_config(cfg.engine, model_dir)
        self.batcher = self.engine.batcher()

    async def ready(self) -> bool:
        """True once the engine is loaded (the constructor has returned)."""
        return True

    def __del__(self):
        """Replica shutdown (Ray Serve calls this once in-flight requests are done): stop the batcher thread."""
        if hasattr(self, "engine"):
            self.engine.close()

    async def stats(self) -> dict:
        """Batcher state: ``active`` rows being decoded now, ``max_batch_seen`` since start."""
        return {"active": self.batcher.active, "max_batch_seen": self.batcher.max_batch_seen}

    def _logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict:
        """OpenAI ``ChatCompletionTokenLogprob``: token text, its UTF-8 bytes, logprob, top alternatives."""
        def one(tid: int, lp: float) -> dict:
            text = self.engine.tokenizer.decode([tid])
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

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
        except ValueError as exc:  # bad input: answered as a 4xx, not logged as a replica failure
            yield input_error_event(exc)
            return
        yield {"type": "start", "prompt_tokens": prompt.num_tokens, "image_tokens": prompt.num_image_tokens}
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        self.batcher.submit(prompt, params, cancel, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        try:
            while True:
                d = await queue.get()
                if isinstance(d, BaseException):
                    raise d
                if d.text or d.finish_reason is None:
                    ev = {"type": "delta", "text": d.text}
                    if d.logprob is not None:
                        ev["logprobs"] = [self._logprob_entry(d.token_id, d.logprob, d.top_logprobs)]
                    yield ev
                if d.finish_reason is not None:
                    yield {"type": "end", "finish_reason": d.finish_reason, "completion_tokens": d.completion_tokens}
                    return
        finally:
            cancel.set()  # the client went away or the stream ended: the batcher drops the row at its next step


def input_error_event(exc: Exception) -> dict:
    """An input error as a stream event: ``{"type": "error", "status", "message", "param", "code"}``."""
    return {"type": "error", "status": getattr(exc, "status_code", 400), "message": str(exc),
            "param": getattr(exc, "param", None), "code": getattr(exc, "code", None)}


def raise_if_error_event(event: dict) -> None:
    """Raise the APIError carried by an ``error`` event (see :func:`input_error_event`)."""
    if event.get("type") == "error":
        raise APIError(event["status"], event["message"], param=event.get("param"), code=event.get("code"))


class ChatRequest(BaseModel):
    """The OpenAI chat request fields we honour (others are accepted and ignored, as OpenAI does).

    Types are strict: ``"stream": "yes"`` or ``"max_tokens": true`` are 400s, not coerced."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    messages: list[Any]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    n: StrictInt | None = None
    stream_options: dict | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None


async def parse_json_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """Read a JSON object body into ``model``; malformed JSON or fields -> APIError 400."""
    data = await json_object(request)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        param = str(e["loc"][0]) if e["loc"] else None  # the request field (not pydantic's union-member tags)
        raise APIError(400, f"{param}: {e['msg']}", param=param, code="invalid_value") from None


def make_router(section: FamilySection, backend: Backend, profile: Profile) -> APIRouter:
    """Routes of the VLM family: ``POST /v1/chat/completions``."""
    router = APIRouter(tags=["chat"])

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI chat completions with images (base64 data URLs) in user turns; ``stream`` gives SSE chunks."""
        t0 = time.perf_counter()
        req: ChatRequest = await parse_json_body(request, ChatRequest)
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
                   "top_logprobs": req.top_logprobs}
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

        include_usage = bool((req.stream_options or {}).get("include_usage"))

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
