"""Issue 14: websocket churn. 200 connect / append / disconnect cycles against the session's real service leave
zero active sessions (the ``chimera_tts_websocket_sessions_active`` gauge) and bounded ingress memory.

Each cycle appends 4,000 characters without a sentence end (held in the session's buffer, nothing to
synthesize) and closes; every 20th cycle appends a complete sentence first, so synthesis starts and the close
has to cancel it. Memory: the resident set of the ingress replica (the process that holds the sessions, found
by its process title) after 200 cycles, against after 20 warm-up cycles (allocator and import warm-up
excluded). The bound, 64 MiB, is far above what the 180 cycles in between may legitimately leave (nothing) and
far below a leak of the sessions: each holds its 4,000-character buffer, a queue, two tasks and the socket, so
keeping them all (or the cancelled syntheses' audio) would be visible only beyond; the gauge is the exact check.
"""

from __future__ import annotations

import os
import re
import time

import httpx
import psutil
from websockets.sync.client import connect

CYCLES, WARMUP = 200, 20
MEMORY_BOUND = 64 * 2**20
GAUGE_CEILING_S = 60  # a closed socket's handler ends within a second (api.md); a hang guard on a busy machine


def _gauge(serve_url: str) -> float:
    text = httpx.get(f"{serve_url}/metrics", timeout=30).text
    values = [float(v) for v in re.findall(r'^chimera_tts_websocket_sessions_active\{[^}]*\} (\S+)$', text, re.M)]
    return sum(values)


def _ingress_rss() -> int:
    """RSS of this session's ingress replica: a descendant of this process (the Ray that ``ray_cluster`` started)
    whose process title is Ray's ``ray::ServeReplica:chimera:ingress``."""
    procs = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "ServeReplica:chimera:ingress" in " ".join(p.cmdline()):
                procs.append(p)
        except psutil.Error:
            pass
    assert len(procs) == 1, procs
    return procs[0].memory_info().rss


def _cycle(url: str, i: int) -> None:
    with connect(url, open_timeout=60) as ws:
        assert '"session.created"' in ws.recv(timeout=60)
        if i % 20 == 0:
            ws.send('{"type": "input_text.append", "text": "This sentence starts synthesis. "}')
        ws.send('{"type": "input_text.append", "text": "%s"}' % ("w" * 4000))


def test_200_websocket_cycles_leave_no_session(serve_url, ray_cluster):
    url = serve_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    for i in range(WARMUP):
        _cycle(url, i)
    rss0 = _ingress_rss()
    for i in range(WARMUP, CYCLES):
        _cycle(url, i)
    t0 = time.monotonic()
    while _gauge(serve_url) != 0:
        assert time.monotonic() - t0 < GAUGE_CEILING_S, f"sessions still open: {_gauge(serve_url)}"
        time.sleep(0.2)
    grown = _ingress_rss() - rss0
    print(f"ingress RSS growth over {CYCLES - WARMUP} cycles: {grown / 2**20:.1f} MiB")
    assert grown < MEMORY_BOUND, grown
