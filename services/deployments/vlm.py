"""The grafted VLM's Ray Serve replica: one :class:`grafting.engine.VLMEngine` per replica, streaming the events
of ``POST /v1/chat/completions`` (:mod:`services.api.chat` shapes them into OpenAI chunks)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from ..config.profiles import FamilySection
from .base import EngineDeployment
from .events import engine_fault, input_error_event, is_input_error


class Deployment(EngineDeployment):
    """Ray Serve deployment of the grafted VLM: one engine per replica, answering through
    :meth:`grafting.engine.VLMEngine.stream` whatever the backend. With ``transformers`` concurrent requests are
    decoded together by the in-process client's continuous batcher (up to ``max_batch_size``); with ``vllm`` the
    replica owns a supervised vLLM server process (started here, restarted when it dies, stopped with the
    replica) whose continuous batching serves them, and ``ready()`` is False while it is down.

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

    def __init__(self, section: dict, model_dir: str, hold_until_ready: bool = False):
        from grafting.config import VLMConfig
        from grafting.engine import VLMEngine
        from grafting.token_bytes import TokenBytes

        from grafting.backend import needs_engine_process

        cfg = FamilySection[VLMConfig].model_validate(section)
        self._start_engine(cfg.engine, model_dir, needs_engine_process(cfg.engine.backend),
                           lambda client: VLMEngine.from_config(cfg.engine, model_dir, backend=cfg.engine.backend,
                                                                llm_client=client), cfg.deployment.torch_threads,
                           hold_until_ready)
        self.token_bytes = TokenBytes(self.engine.tokenizer)  # logprob ``bytes`` of a token id
        self.traffic = None  # the traffic dataset's writer (grafting.traffic), when the profile turns capture on
        capture = cfg.engine.traffic_capture
        if capture.enabled:
            from core.config import resolve_path
            from grafting.traffic import TrafficWriter

            self.traffic = TrafficWriter(resolve_path(model_dir, capture.path, local=True),
                                         int(capture.max_mb * 2**20))

    async def stats(self) -> dict:
        """The engine's counters (:meth:`grafting.engine.VLMEngine.stats`): ``backend``, ``active`` requests
        being decoded (None while the engine is down), ``generated_tokens`` since start over all requests (the
        work done), and per backend ``max_batch_seen`` or ``engine_state``, ``engine_pid`` (vLLM's API server
        process), ``engine_restarts``."""
        return await self.engine.stats()

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
        async for ev in self._events(prompt, params, response_format, request["messages"]):
            yield ev

    async def _capture(self, messages: list, prompt) -> None:
        """Append the served conversation to the traffic dataset when capture is on (:func:`grafting.traffic.
        record_served`, in a worker thread: text as sent, each image as its image-cache key and, once per key, the
        embeddings the LLM got for it). A failed write is logged, never the request's error."""
        if self.traffic is None:
            return
        from grafting.traffic import record_served

        try:
            await asyncio.to_thread(record_served, self.traffic, self.engine.model, messages, prompt)
        except (OSError, ValueError) as exc:
            logging.getLogger("chimera").warning("traffic capture: not written: %s", exc)

    async def _events(self, prompt, params, response_format, messages):
        """``chat_stream``'s events after validation, the same for both backends: ``start``, ``delta``s, ``end``.
        A refusal before the first token (vLLM cannot compile a schema; the context check) is an input error
        event like ours; an unavailable engine raises. Closing this generator (the client went away) closes the
        generation: the transformers batcher drops the row, vLLM aborts the request."""
        from grafting.collapse_guard import GuardReport

        report = GuardReport()
        gen = self.engine.stream(prompt, params, response_format, report)
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
                    await self._capture(messages, prompt)
                    yield {"type": "end", "finish_reason": d.finish_reason, "completion_tokens": d.completion_tokens,
                           **await self._end_extras(report)}
                    return
                try:
                    d = await gen.__anext__()
                except ValueError as exc:
                    if not is_input_error(exc):
                        raise engine_fault(exc) from exc
                    raise
        finally:
            await gen.aclose()

    def replica_label(self) -> str:
        """The ``replica`` label of this replica's series in /metrics (:func:`_replica_name` of this deployment)."""
        return _replica_name(id(self))

    async def _end_extras(self, report) -> dict:
        """What an ``end`` event carries for /metrics (``metrics.observe_vlm_end_event``): this replica's
        image-cache counters, its engine's speculative-decoding counters (where it speculates and answers: a
        failed read leaves them out of this event), its traffic writer's counters (where capture is on) and the
        answer's collapse-guard report."""
        from core.llm_client import EngineUnavailableError

        out = {"collapse": dataclasses.asdict(report)}
        cache = self.engine.model.image_cache
        if cache is not None:
            out["image_cache"] = {"replica": self.replica_label(), "stats": cache.stats().as_dict()}
        try:
            spec = await self.engine.client.spec_decode()
        except EngineUnavailableError:
            spec = None
        if spec is not None:
            out["spec_decode"] = {"replica": self.replica_label(), "counters": spec}
        if self.traffic is not None:
            out["traffic_capture"] = {"replica": self.replica_label(), "stats": self.traffic.stats()}
        return out


def _replica_name(local: int) -> str:
    """This Ray Serve replica's id; outside Ray Serve (LocalBackend: tests, notebooks) the process id and ``local``
    (the deployment's id), so two deployments in one process keep apart the cumulative counters the ingress folds
    into /metrics (``services.api.metrics.observe_image_cache``, ``observe_spec_decode``)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return f"pid{os.getpid()}-{local:x}"


