"""Image question answering: ``POST /v1/chat/completions`` (OpenAI chat format, plain and SSE streaming).

The router validates the request (:mod:`services.api.chat_request`), streams events from the VLM replica
(:mod:`services.deployments.vlm`) and shapes ``chat.completion`` / ``chat.completion.chunk`` objects. A client
disconnect closes the stream, which cancels generation in the replica.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from core.validate import InputError, check_max_tokens, check_messages

from ..config.profiles import FamilySection, Profile
from ..deployments.backends import Backend
from ..deployments.routing import PAYLOAD_KEY, image_routing_keys
from . import metrics
from .body import json_object
from .chat_request import ChatRequest
from .errors import APIError, error_body, raise_if_error_event, to_api_error
from .models import check_model


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
        try:  # the engine's own checks (core.validate), answered here before the replica is asked
            check_messages(req.messages)
            if max_tokens is not None:
                check_max_tokens(max_tokens, section.engine.max_new_tokens)
        except InputError as err:
            raise APIError(400, str(err), param=err.param, code=err.code) from None
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
