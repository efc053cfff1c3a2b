"""Readiness on both sides of ``GET /readyz``.

Server side: :class:`ReadyStates`, the ingress's per-family ready states, so that ``/readyz`` answers within
about a second even while the deployments are starting. Client side: :func:`wait_ready`, waiting for a started
service to answer 200 (every model family loaded; the VLM's vLLM server healthy), used by ``chimera serve``, the
tests' session fixture, the CLI tests and the benchmarks' service wrapper alike."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import httpx

#: How long ``/readyz`` waits for fresh answers before it answers from the last known states (s).
READY_WAIT_S = 0.8
#: How long one probe of a deployment may take before it counts as not ready (s); a replica that is still being
#: created makes Serve hold the call until it exists.
PROBE_TIMEOUT_S = 5.0


class ReadyStates:
    """Per-family ready states, probed in the background and cached.

    ``probes``: family -> async callable returning truthy when that family can serve (its deployment's
    ``ready()``). :meth:`current` starts a probe of each family that has none in flight, waits up to ``wait_s``
    seconds for them, and returns ``{family: bool}``: a probe's answer when it came in time, else the family's
    last known state (False before its first answer). A probe that takes longer keeps running and updates the
    cache when it ends (a raise, or ``probe_timeout_s`` passing, counts as not ready); the caller being cancelled
    (a client that gave up) does not cancel it, and it is not started twice."""

    def __init__(self, probes: dict[str, Callable[[], Awaitable]], wait_s: float = READY_WAIT_S,
                 probe_timeout_s: float = PROBE_TIMEOUT_S):
        self.probes = probes
        self.wait_s = wait_s
        self.probe_timeout_s = probe_timeout_s
        self.states = {f: False for f in probes}
        self._inflight: dict[str, asyncio.Task] = {}

    async def _probe(self, family: str) -> None:
        try:
            ok = bool(await asyncio.wait_for(self.probes[family](), self.probe_timeout_s))
        except Exception:  # noqa: BLE001 - any failure means not ready
            ok = False
        self.states[family] = ok

    async def current(self) -> dict[str, bool]:
        """The ready state of every family (see the class docstring); returns within about ``wait_s`` s."""
        loop = asyncio.get_running_loop()
        tasks = []
        for fam in self.probes:
            task = self._inflight.get(fam)
            if task is None or task.done() or task.get_loop() is not loop:
                task = self._inflight[fam] = loop.create_task(self._probe(fam))
            tasks.append(task)
        if tasks:  # a profile with no model family (an ingress only) is ready at once
            await asyncio.wait(tasks, timeout=self.wait_s)  # neither its timeout nor our cancellation cancels them
        return dict(self.states)


def wait_ready(base_url: str, ceiling_s: float, alive: Callable[[], bool] | None = None,
               poll_s: float = 0.5, progress: Callable[[list[str]], None] | None = None) -> float:
    """Poll ``{base_url}/readyz`` until it answers 200; returns the seconds waited (time.monotonic, so a
    wall-clock step cannot cut it short).

    ``ceiling_s`` only turns a hang into a failure: it is set far above a slow machine's start-up (loading three
    model families and vLLM takes 1-3 minutes on 2 busy cores); ``math.inf`` waits for as long as it takes.
    ``alive``: called each poll; when it returns False (the service process exited) waiting stops at once.
    ``progress``: called with the model ids still loading (from the 503 body, ``[]`` while nothing answers)
    each time that list changes. Each poll may take 5 s (a busy replica).
    Raises RuntimeError("exited before ready" / "not ready after N s")."""
    t0, last = time.monotonic(), None
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"service at {base_url} exited before it was ready")
        loading: list[str] = []
        try:
            r = httpx.get(f"{base_url}/readyz", timeout=5)
            if r.status_code == 200:
                return time.monotonic() - t0
            models = r.json().get("models", {}) if r.headers.get("content-type", "").startswith(
                "application/json") else {}
            loading = sorted(m for m, state in models.items() if state != "ready")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        if progress is not None and loading != last:
            progress(loading)
            last = loading
        if time.monotonic() - t0 > ceiling_s:
            raise RuntimeError(f"service at {base_url} not ready after {ceiling_s:.0f} s")
        time.sleep(poll_s)
