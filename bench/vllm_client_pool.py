"""The VLM's engine client: an ``httpx.AsyncClient`` per completion (before issue 24) vs the one keep-alive pool of
:class:`core.vllm_client.VLLMClient`, side by side in one run.

No vLLM: a scripted stand-in (:class:`KeepAliveServer`, HTTP/1.1 on ``127.0.0.1``) answers ``POST
/v1/completions`` as vLLM's streaming completions do (``tokens`` chunks of one token id each with
``return_token_ids``, then ``data: [DONE]``), keeping the connection open afterwards, as vLLM's uvicorn does. So
what differs between the arms is only the connection handling: ``old`` opens a client (and a TCP connection) for
every completion and closes it after, as ``VLLMClient.stream`` did before issue 24 (kept here as the baseline, the
stream parsed by the same ``_chunks``); ``new`` is ``VLLMClient.stream``. Rounds alternate the arms; prints the
median milliseconds per completion of each, the ratio old / new, and the TCP connections the server accepted per
arm (old: one per completion; new: one in all).

    .venv/bin/python bench/vllm_client_pool.py [--completions 200] [--rounds 5] [--tokens 8]
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


class KeepAliveServer:
    """A scripted stand-in for vLLM's OpenAI server on a free ``127.0.0.1`` port (``base_url``; ``state`` ready):
    ``POST /v1/completions`` answers ``max_tokens`` chunks (token id 42 each, the last with ``finish_reason:
    "length"``) and ``data: [DONE]`` as one ``text/event-stream`` body with a Content-Length, over HTTP/1.1 keep-alive.
    ``connections`` counts the TCP connections accepted. A context manager (serves from a daemon thread)."""

    def __init__(self):
        self.connections = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                outer.connections += 1

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                n = int(body["max_tokens"])
                lines = [b"data: " + json.dumps({"choices": [{"index": 0, "text": "x", "token_ids": [42],
                                                              "finish_reason": "length" if i == n - 1 else None}]}
                                                ).encode() + b"\n\n" for i in range(n)]
                payload = b"".join(lines) + b"data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.state = "ready"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


async def old_stream(client, body):
    """The pre-issue-24 connection handling: a new ``httpx.AsyncClient`` per completion, closed after it."""
    import httpx

    from core.vllm_client import _chunks

    async with httpx.AsyncClient(timeout=client.timeout) as c:
        async with c.stream("POST", f"{client.base_url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    for chunk in _chunks(line[6:], 0):
                        yield chunk


async def run_arm(client, arm: str, completions: int, tokens: int) -> float:
    """Milliseconds per completion of ``completions`` sequential completions of ``tokens`` tokens each."""
    body = {"prompt": [1, 2, 3], "max_tokens": tokens, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    for _ in range(completions):
        stream = old_stream(client, body) if arm == "old" else client.stream(body)
        got = sum([len(c.token_ids) async for c in stream])
        assert got == tokens, (arm, got)
    return (time.perf_counter() - t0) * 1000 / completions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--completions", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    from core.vllm_client import VLLMClient

    with KeepAliveServer() as server:
        client = VLLMClient(SimpleNamespace(base_url=server.base_url, state="ready"))
        ms = {"old": [], "new": []}
        conns = {"old": 0, "new": 0}

        async def rounds():
            for _ in range(args.rounds):
                for arm in ("old", "new"):
                    before = server.connections
                    ms[arm].append(await run_arm(client, arm, args.completions, args.tokens))
                    conns[arm] += server.connections - before
            await client.aclose()

        asyncio.run(rounds())
    old, new = statistics.median(ms["old"]), statistics.median(ms["new"])
    print(f"{args.completions} completions x {args.rounds} rounds, {args.tokens} tokens each")
    print(f"old (a client per completion): {old:.3f} ms/completion, {conns['old']} TCP connections")
    print(f"new (one keep-alive pool):     {new:.3f} ms/completion, {conns['new']} TCP connections")
    print(f"old / new: {old / new:.2f}x")


if __name__ == "__main__":
    main()
