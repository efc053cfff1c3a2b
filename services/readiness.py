"""Waiting for a started service to answer ``GET /readyz`` 200 (every model family loaded; the VLM's vLLM server
healthy). Used by the tests' session fixture, the CLI tests and the benchmarks' service wrapper alike."""

from __future__ import annotations

import time
from typing import Callable

import httpx


def wait_ready(base_url: str, ceiling_s: float, alive: Callable[[], bool] | None = None,
               poll_s: float = 0.5) -> float:
    """Poll ``{base_url}/readyz`` until it answers 200; returns the seconds waited (time.monotonic, so a
    wall-clock step cannot cut it short).

    ``ceiling_s`` only turns a hang into a failure: it is set far above a slow machine's start-up (loading three
    model families and vLLM takes 1-3 minutes on 2 busy cores). ``alive``: called each poll; when it returns
    False (the service process exited) waiting stops at once. Each poll may take 5 s (a busy replica).
    Raises RuntimeError("exited before ready" / "not ready after N s")."""
    t0 = time.monotonic()
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"service at {base_url} exited before it was ready")
        try:
            if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > ceiling_s:
            raise RuntimeError(f"service at {base_url} not ready after {ceiling_s:.0f} s")
        time.sleep(poll_s)
