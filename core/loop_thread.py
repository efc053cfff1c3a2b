"""One asyncio event loop per owner, in a daemon thread, and a bridge from blocking code to async streams.

An engine whose work runs in worker threads (the speech engine synthesizes in one thread per request) reads
its language model's async stream (:meth:`core.llm_client.LLMClient.stream`) through :meth:`LoopThread.iterate`:
every stream of the owner runs on the owner's one loop (a client that pools connections needs them to live on
one loop, and a loop per stream cost its creation and teardown every time: ``bench/tts_stream_loop.py``), and
the blocking side pulls one item at a time, so the stream computes nothing ahead of what is read (an in-process
model decodes a token only when it is asked for one).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
FINALIZER_TURNS = 8  # loop turns given to async-generator finalizers after a stream is closed (4 nested layers)


class LoopClosed(RuntimeError):
    """The owner closed its loop (:meth:`LoopThread.close`) under a stream that was still being read."""


class LoopThread:
    """An event loop running in a daemon thread named ``name``, started on first use (:meth:`loop`) and ended by
    :meth:`close` (idempotent; a later use starts a new one). Thread-safe."""

    def __init__(self, name: str):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (its thread started now if needed)."""
        with self._lock:
            if self._loop is None:
                started = threading.Event()

                async def serve():
                    self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                    started.set()
                    await self._stop.wait()

                # asyncio.run's teardown cancels what is left and runs the async generators' finalizers
                self._thread = threading.Thread(target=asyncio.run, args=(serve(),), name=self.name, daemon=True)
                self._thread.start()
                started.wait()
            return self._loop

    def close(self) -> None:
        """End the loop and join its thread: a stream still on it is cancelled and closed (its reader gets
        :class:`LoopClosed`). Idempotent. Must not be called from the loop's own thread."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
            if loop is not None:
                loop.call_soon_threadsafe(self._stop.set)
                thread.join()

    def iterate(self, make: Callable[[], AsyncIterator[T]], cancel: threading.Event | None = None,
                poll_s: float = 0.05, cancelled: Callable[[], BaseException] | None = None) -> Iterator[T]:
        """The items of the async iterator ``make()`` (made and read on this loop), for a blocking caller in
        another thread, pulled one at a time: the next item is asked for only when the caller wants it.

        ``cancel`` (checked every ``poll_s`` seconds while waiting, and before and after each item) raises
        ``cancelled()`` (default: a ``RuntimeError``). Closing the returned iterator, or any exit, cancels a
        pending read and closes the stream on the loop (its ``finally`` blocks run, e.g. an HTTP stream closes),
        then lets the finalizers that scheduled themselves meanwhile run. Errors of the stream are raised here;
        a loop closed under the read raises :class:`LoopClosed`."""
        loop = self.loop()
        state: dict[str, Any] = {}

        async def first():
            state["agen"] = make()

        async def pull():
            state["task"] = asyncio.current_task()
            return await state["agen"].__anext__()

        async def finish():
            task = state.get("task")
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            agen = state.get("agen")
            if agen is not None:
                await agen.aclose()
            # a stream closed or returned from inside ``async for`` leaves its inner iterator to the finalizer,
            # which schedules a callback that creates the aclose() task: two turns of the loop per nested layer
            for _ in range(FINALIZER_TURNS):
                await asyncio.sleep(0)

        def stop_requested() -> bool:
            return cancel is not None and cancel.is_set()

        def raise_cancelled():
            raise (cancelled() if cancelled is not None else RuntimeError("cancelled"))

        try:
            asyncio.run_coroutine_threadsafe(first(), loop).result()
            while True:
                fut = asyncio.run_coroutine_threadsafe(pull(), loop)
                while True:
                    try:
                        item = fut.result(timeout=poll_s)
                        break
                    except concurrent.futures.TimeoutError:
                        if stop_requested():
                            raise_cancelled()
                    except StopAsyncIteration:
                        return
                    except (concurrent.futures.CancelledError, asyncio.CancelledError):
                        raise LoopClosed("the stream's event loop was closed under it") from None
                if stop_requested():
                    raise_cancelled()
                yield item
                if stop_requested():
                    raise_cancelled()
        finally:
            try:
                asyncio.run_coroutine_threadsafe(finish(), loop).result()
            except (RuntimeError, concurrent.futures.CancelledError):  # the loop was closed under this read
                pass
