"""One base class for a Ray Serve replica that owns a model engine (and, on the ``vllm`` backend, the vLLM server
process the engine talks to): start, ready, health, engine stats, stop.

The VLM (:mod:`services.deployments.vlm`) and speech (:mod:`services.deployments.speech`) replicas subclass it;
the video replica's engines live in job workers instead (:mod:`services.deployments.video`). The replica lifecycle
follows Ray Serve's deployment protocol (``check_health``, ``__del__`` at shutdown: docs.ray.io, "Ray Serve:
health checks"), and the server ownership follows vLLM's entrypoint / engine split: the replica starts the engine
process, the model code only holds a client.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any


class EngineDeployment:
    """A replica owning ``self.engine`` and, when its family's backend needs an engine process
    (``grafting.backend.needs_engine_process`` / ``audio.backend.needs_engine_process``), ``self.server`` (a
    supervised :class:`services.engines.process.ServerProcess`) and ``self.llm_client`` (its pooled
    :class:`core.vllm_client.VLLMClient`); both are None when the model runs in this process. Engine counters come
    from the engine's ``stats()`` (its client's), never from here.

    Subclasses call :meth:`_start_engine` from ``__init__``, passing on their ``hold_until_ready`` argument.
    ``ready()`` is the engine's readiness (False while its server is down), ``check_health()`` raises once the
    server has given up so that Ray replaces the replica, and ``__del__`` closes the engine, then stops the
    server."""

    engine: Any = None
    server: Any = None
    llm_client: Any = None

    def _start_engine(self, engine_cfg: Any, model_dir: str, needs_process: bool, build: Callable[[Any], Any],
                      torch_threads: int | None, hold_until_ready: bool = False):
        """Start the vLLM server for ``engine_cfg`` when ``needs_process`` (what the family's backend module says;
        see :func:`services.engines.vllm_server.start_vllm_for`), then ``self.engine = build(llm_client)`` (None
        when no process was started), then, with ``hold_until_ready`` (a replica replacing another in a reload),
        :meth:`_hold_until_ready`. A failing ``build`` stops the server it was given before re-raising, so no
        process outlives a replica that never started. ``torch_threads`` (if set) caps this process's torch
        intra-op threads. Raises what ``start_vllm_for`` or ``build`` raise (OSError for a missing checkpoint,
        ValueError for a bad configuration, RuntimeError for a server that will not start) and
        :meth:`_hold_until_ready`'s RuntimeError."""
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        if needs_process:
            from ..engines.vllm_server import start_vllm_for

            self.llm_client = start_vllm_for(engine_cfg, model_dir)
            self.server = self.llm_client.server
        try:
            self.engine = build(self.llm_client)
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise
        if hold_until_ready:
            self._hold_until_ready()

    def _hold_until_ready(self) -> None:
        """Return only once the engine answers (at once without an engine process; with one, when its server is
        ready). A replica's constructor calls it when it replaces another in a reload
        (``services.serve_app.build_application(..., hold_until_ready=True)``): Ray Serve routes requests to a
        replica as soon as its constructor returns, and stops the old replica then, so without it the old one
        stopped while the new vLLM server was still loading and requests got 503 ``engine_unavailable`` until it
        was up (measured: docs/operations/speculator.md). Raises RuntimeError (the replica fails to start, Serve
        retries it and the old replica keeps serving) when the server gave up."""
        if self.server is not None and not self.server.wait_ready(None):
            why = f"the vLLM server did not start ({self.server.state}): {self.server.last_error}"
            self.engine.close()
            self.server.stop()
            raise RuntimeError(why)

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

    def __del__(self):
        """Replica shutdown (Ray Serve calls this once in-flight requests are done): close the engine (its batcher
        or stream-loop thread), then stop the vLLM server process this replica owns."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


async def iterate_in_thread(events: Iterable[Any], name: str, cancel: threading.Event | None = None,
                            on_start: Callable[[], None] | None = None, on_exit: Callable[[], None] | None = None):
    """Run the blocking iterator ``events`` in a daemon thread and yield its items on the caller's event loop
    (an asyncio queue fed with ``call_soon_threadsafe``). An exception raised by the iterator is re-raised here,
    in order. Closing this generator sets ``cancel`` (which the iterator is expected to poll: one token or frame
    at most) and joins the thread (30 s at most). ``on_start`` runs just before the thread starts (at the first
    ``__anext__``) and ``on_exit`` in the thread when it ends, however it ends: a count kept with them is exact.
    Use it under ``contextlib.aclosing`` when the loop may stop early, so the thread is joined at once."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    def worker():
        try:
            for ev in events:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            loop.call_soon_threadsafe(queue.put_nowait, done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            if on_exit is not None:
                on_exit()

    thread = threading.Thread(target=worker, name=name, daemon=True)
    if on_start is not None:
        on_start()
    thread.start()
    try:
        while True:
            ev = await queue.get()
            if ev is done:
                return
            if isinstance(ev, BaseException):
                raise ev
            yield ev
    finally:
        if cancel is not None:
            cancel.set()
        await asyncio.to_thread(thread.join, 30)
