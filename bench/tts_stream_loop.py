"""Speech on vLLM: an event loop per sentence attempt (before issue 24) vs the one pooled loop of
:class:`audio.lm_stream.SpeechLM`, side by side in one run.

No vLLM, two stand-ins for it, both scripted: ``memory``, a client whose stream yields ``max_tokens`` audio ids, one
frame of 7 per chunk, from memory (:class:`MemoryClient`: the cost of driving a stream and nothing else), and
``http``, a server (:class:`StandInServer`) streaming the same chunks as vLLM's ``/v1/completions`` does with
``return_token_ids``, answering the real engine client (``core.vllm_client.VLLMClient``, which today builds
an httpx client per request: that dominates this arm). What differs between the two arms is only how the
attempt's stream is driven. ``old``: the pre-issue-24 ``stream_tokens`` (a new event loop per attempt, its async generators shut down
and the loop closed at the end; kept here verbatim as the baseline); ``new``: ``SpeechLM.stream_tokens``.
Rounds alternate the arms; prints the median milliseconds per attempt of each, the ratio old/new, and the
threads and sockets left after ``close()``.

    .venv/bin/python bench/tts_stream_loop.py [--attempts 200] [--rounds 5] [--frames 1 8] [--client memory http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class StandInServer:
    """A scripted stand-in for vLLM's OpenAI server on ``127.0.0.1`` (a free port; ``base_url``, ``state``
    ``ready``, as :class:`core.vllm_client.VLLMClient` reads them from a ServerProcess): ``POST
    /v1/completions`` streams ``max_tokens`` audio ids of the default token layout (frame ``f``'s codes all ``f %
    4096``), 7 per ``data:`` chunk, the last with ``finish_reason: "length"``, then ``data: [DONE]``; the body
    ends when the server closes the connection. Use as a context manager (serves from a daemon thread)."""

    def __init__(self):
        from audio.config import TokenLayoutConfig
        from audio.layout import TokenLayout

        layout = TokenLayout(TokenLayoutConfig())

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                n = int(body["max_tokens"]) // layout.positions
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                for f in range(n):
                    ids = [layout.audio_id(p, f % layout.cfg.codebook_size) for p in range(layout.positions)]
                    choice = {"index": 0, "text": "", "token_ids": ids,
                              "finish_reason": "length" if f == n - 1 else None}
                    self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.state = "ready"
        self.layout = layout
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="stand-in-vllm", daemon=True)

    def __enter__(self) -> "StandInServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


class MemoryClient:
    """An LLMClient stand-in whose ``stream(request)`` yields ``request.max_tokens // 7`` chunks of one frame of
    audio ids each (the stand-in server's chunks), from memory; ``state`` ``ready``."""

    state = "ready"

    def __init__(self, layout):
        self.layout = layout

    async def stream(self, request):
        """The chunks of ``request`` (see the class docstring), the last with ``finish_reason`` ``length``."""
        lay = self.layout
        n = int(request.max_tokens) // lay.positions
        for f in range(n):
            yield SimpleNamespace(token_ids=[lay.audio_id(p, f % lay.cfg.codebook_size) for p in range(lay.positions)],
                                  finish_reason="length" if f == n - 1 else None)


def old_stream_tokens(lm, input_ids, prompt_len, sampling, layout, seed, max_tokens, cancel=None, allow_end=True):
    """The pre-issue-24 ``stream_tokens``: its own event loop per attempt (the baseline)."""
    from audio.generate import Cancelled
    from audio.lm_stream import POLL_S

    loop = asyncio.new_event_loop()
    chunks = lm.client.stream(lm.request(input_ids, prompt_len, sampling, layout, seed, max_tokens, allow_end))
    eos = layout.cfg.end_of_speech
    try:
        while True:
            task = loop.create_task(chunks.__anext__())
            while not task.done():
                loop.run_until_complete(asyncio.wait({task}, timeout=POLL_S))
                if cancel is not None and cancel.is_set() and not task.done():
                    task.cancel()
                    loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
                    raise Cancelled()
            try:
                chunk = task.result()
            except StopAsyncIteration:
                return
            yield from chunk.token_ids
            if chunk.finish_reason == "stop" and (not chunk.token_ids or chunk.token_ids[-1] != eos):
                yield eos
    finally:
        loop.run_until_complete(chunks.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def sockets_to(port: int) -> int:
    """TCP connections of this process to ``port`` that are not closed."""
    import psutil

    return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attempts", type=int, default=200, help="attempts per arm and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--frames", type=int, nargs="+", default=[1, 8], help="frames (7 tokens each) per attempt")
    ap.add_argument("--client", nargs="+", default=["memory", "http"], choices=["memory", "http"])
    args = ap.parse_args()

    from audio.config import SamplingConfig
    from audio.lm_stream import SpeechLM
    from core.vllm_client import VLLMClient

    sampling = SamplingConfig()
    prompt = list(range(1, 40))
    print(f"{'client':>7} {'frames/attempt':>14} {'old ms/attempt':>15} {'new ms/attempt':>15} {'old/new':>8}")
    with StandInServer() as server:
        for kind in args.client:
            client = (MemoryClient(server.layout) if kind == "memory" else
                      VLLMClient(SimpleNamespace(base_url=server.base_url, state=server.state)))
            lm = SpeechLM(client)
            arms = {"old": lambda n: old_stream_tokens(lm, prompt, len(prompt), sampling, server.layout, 0, n),
                    "new": lambda n: lm.stream_tokens(prompt, len(prompt), sampling, server.layout, 0, n)}
            threads0 = threading.active_count()
            for frames in args.frames:
                n = frames * server.layout.positions
                for arm in arms.values():  # warm-up (imports, the first connection, the loop thread)
                    assert len(list(arm(n))) == n
                per = {k: [] for k in arms}
                for _ in range(args.rounds):
                    for name, arm in arms.items():
                        t0 = time.perf_counter()
                        for _ in range(args.attempts):
                            assert len(list(arm(n))) == n
                        per[name].append((time.perf_counter() - t0) / args.attempts * 1e3)
                old, new = statistics.median(per["old"]), statistics.median(per["new"])
                print(f"{kind:>7} {frames:>14} {old:>15.3f} {new:>15.3f} {old / new:>7.2f}x", flush=True)
            lm.close()
            print(f"{kind:>7} after close: {threading.active_count() - threads0} threads more than before the "
                  f"loop started, {sockets_to(int(server.base_url.rsplit(':', 1)[1]))} sockets to the server open")

if __name__ == "__main__":
    main()
