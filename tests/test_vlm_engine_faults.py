"""The chat path against a scripted stand-in for vLLM's OpenAI server: engine faults and connection reuse.

The stand-in (:data:`STAND_IN`, run by the real supervisor ``services.engines.process.ServerProcess``) answers
``/health`` and ``/v1/completions`` like vLLM, but misbehaves on purpose as its ``mode`` says (``POST /mode``): a
stream line that is not JSON, before or after the first token, a logprob token that is not an id, an HTTP 500 or
404. Each is the engine's fault, so chat must answer 500 ``engine_error`` (streamed or not; mid-stream an SSE error
event), never a 400 blaming the client. It also counts the TCP connections it accepted, so the tests can check that
the VLM's client (``core.vllm_client.VLLMClient``) reuses one pooled connection across completions, closes a
stream's connection when the stream is abandoned (that is what aborts the request in vLLM), and leaves no socket
open once closed. No model misbehaves here: the VLM deployment is the cpu profile's (tower, projector, embedding
table, tokenizer), only its LLM engine is the stand-in. No Ray: the deployment sits behind the real ingress app
over ``httpx.ASGITransport``, driven by ``openai.AsyncOpenAI``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import textwrap
import time

import httpx
import openai
import psutil
import pytest

from services.api.app import build_app
from services.deployments.backends import LocalBackend
from core.vllm_client import VLLMClient
from services.engines.process import ServerProcess, ServerSpec
from services.config.profiles import parse_profile

STAND_IN = textwrap.dedent('''
    import argparse, http.server, json, threading
    ap = argparse.ArgumentParser()
    ap.add_argument("--host"); ap.add_argument("--port", type=int)
    a = ap.parse_args()
    # connections: TCP connections that carried a completion; health: /health answered
    state = {"mode": "ok", "connections": 0, "completions": 0, "health": 0}
    release = {"event": threading.Event()}  # mode "hold": the answer waits on it after its first chunk

    def chunk(text, ids, finish=None, logprobs=None):
        return {"choices": [{"index": 0, "text": text, "token_ids": ids, "logprobs": logprobs,
                             "finish_reason": finish}]}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like vLLM's uvicorn

        def reply(self, status, body, ctype="application/json"):
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                state["health"] += 1
                self.reply(200, b"")
            elif self.path == "/stats":
                self.reply(200, json.dumps(state).encode())
            else:
                self.reply(404, b"{}")

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path == "/mode":
                state["mode"] = body.decode()
                release["event"].set()  # a held answer goes on
                release["event"] = threading.Event()
                return self.reply(200, b"")
            if not getattr(self, "counted", False):  # one handler per accepted connection
                self.counted = True
                state["connections"] += 1
            state["completions"] += 1
            mode = state["mode"]
            if mode in ("http500", "http404"):
                return self.reply(int(mode[4:]), json.dumps({"error": {"message": "boom", "type": "x",
                                                                        "code": int(mode[4:])}}).encode())
            lines = [chunk(" Hi", [21041]), chunk(" there", [665]), chunk(".", [30], "length"),
                     {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}]
            lines = ["data: " + json.dumps(x) for x in lines]
            if mode == "bad_first":
                lines.insert(0, "data: Internal Server Error")
            elif mode == "bad_after":
                lines.insert(1, "data: {not json")
            elif mode == "bad_logprob":
                lines[0] = "data: " + json.dumps(chunk(" Hi", [21041], None, {
                    "tokens": ["token_id:x"], "token_logprobs": [-0.1], "top_logprobs": None}))
            payload = ("\\n\\n".join(lines + ["data: [DONE]"]) + "\\n\\n").encode()
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            if mode == "hold":  # the first chunk, then nothing until released (the client leaves first)
                first = payload.index(b"\\n\\n") + 2
                self.wfile.write(payload[:first]); self.wfile.flush()
                release["event"].wait(120)
                payload = payload[first:]
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer((a.host, a.port), H).serve_forever()
''')


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A :class:`VLLMClient` of the stand-in, started and ready (stopped at the end)."""
    d = tmp_path_factory.mktemp("stand_in")
    (d / "stand_in_vllm.py").write_text(STAND_IN)
    spec = ServerSpec(python=sys.executable, module="stand_in_vllm", env={"PYTHONPATH": str(d)},
                      startup_timeout_s=120, health_period_s=1.0, health_timeout_s=10.0)
    client = VLLMClient(ServerProcess(spec).start())
    assert client.wait_ready(120), client.server.log_tail()
    # No more health checks once one has come after this (the supervisor reads the period before each wait), so
    # that every socket of this process to the stand-in is the client's: counted by open_sockets().
    client.server.spec.health_period_s = 3600.0
    seen = stats(client)["health"]
    deadline = time.monotonic() + 120  # a bound on a failure, not a timing claim
    while stats(client)["health"] == seen and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats(client)["health"] > seen
    yield client
    client.close()


def stats(client) -> dict:
    return httpx.get(f"{client.base_url}/stats", timeout=10).json()


def set_mode(client, mode: str) -> None:
    assert httpx.post(f"{client.base_url}/mode", content=mode.encode(), timeout=10).status_code == 200


def open_sockets(client) -> int:
    """TCP connections of this process to the stand-in's port that are still open (any state but CLOSED)."""
    port = int(client.base_url.rsplit(":", 1)[1])
    return sum(1 for c in psutil.Process().net_connections(kind="tcp")
               if c.raddr and c.raddr.port == port and c.status != psutil.CONN_CLOSE)


@pytest.fixture(scope="module")
def app(stand_in, profile, model_dir):
    """The ingress app over the cpu profile's VLM deployment whose engine is the stand-in."""
    import services.engines.vllm_server
    from services.deployments.vlm import Deployment

    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    prof = parse_profile(data)
    section = copy.deepcopy(prof.vlm.model_dump(mode="json"))
    assert section["engine"]["backend"] == "vllm"
    mp = pytest.MonkeyPatch()
    mp.setattr(services.engines.vllm_server, "start_vllm_for", lambda cfg, model_dir: stand_in)  # this engine, not vLLM
    try:
        dep = Deployment(section, str(model_dir))
    finally:
        mp.undo()
    return build_app(prof, {"vlm": LocalBackend(dep)})


def ask(app, stream: bool):
    """One chat completion through the openai SDK: ``("ok", text)`` or ``(status or None, error body)``."""
    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
        kw = dict(model="chimera-vlm", messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
                  temperature=0)
        text = ""
        try:
            if stream:
                async for ch in await client.chat.completions.create(stream=True, **kw):
                    text += ch.choices[0].delta.content or "" if ch.choices else ""
            else:
                text = (await client.chat.completions.create(**kw)).choices[0].message.content
            return "ok", text
        except openai.APIStatusError as exc:
            return exc.status_code, exc.response.json()["error"]
        except openai.APIError as exc:  # an SSE error event mid-stream (after the 200)
            return ("mid-stream", text), exc.body
        finally:
            await client.close()
    return asyncio.run(main())


def test_a_well_behaved_stand_in_answers(app, stand_in):
    set_mode(stand_in, "ok")
    assert ask(app, False) == ("ok", " Hi there.") and ask(app, True) == ("ok", " Hi there.")


@pytest.mark.parametrize("mode", ["bad_first", "bad_after", "http500", "http404"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_engine_fault_is_a_500_engine_error_never_a_400(app, stand_in, mode, stream):
    set_mode(stand_in, mode)
    status, err = ask(app, stream)
    if stream and mode == "bad_after":  # the 200 and the first token are out: an SSE error event follows
        assert status == ("mid-stream", " Hi"), (status, err)
    else:
        assert status == 500, (status, err)
    assert err["code"] == "engine_error" and err["type"] == "server_error", err


def test_a_logprob_token_that_is_not_an_id_is_an_engine_error(stand_in):
    from core.llm_client import EngineError

    set_mode(stand_in, "bad_logprob")

    async def main():
        with pytest.raises(EngineError):
            async for _ in stand_in.stream_body({"prompt": [1], "max_tokens": 3, "stream": True, "logprobs": 1}):
                pass
    asyncio.run(main())


def test_completions_share_one_pooled_connection_and_close_cleanly(stand_in):
    """Five completions in a row on one event loop: one TCP connection (a client per completion opened five). A
    stream abandoned after its first chunk closes its connection (the request is aborted, not left to run on a
    pooled socket), the next completion opens a fresh one; ``aclose()`` leaves no socket open."""
    set_mode(stand_in, "ok")

    async def main():
        before = stats(stand_in)["connections"]
        for _ in range(5):
            chunks = [c async for c in stand_in.stream_body({"prompt": [1], "max_tokens": 3, "stream": True})]
            assert [c.text for c in chunks][:3] == [" Hi", " there", "."]
        reused = stats(stand_in)["connections"] - before
        open_while_idle = open_sockets(stand_in)
        set_mode(stand_in, "hold")
        gen = stand_in.stream_body({"prompt": [1], "max_tokens": 3, "stream": True})
        first = await gen.__anext__()
        await gen.aclose()
        after_abandon = open_sockets(stand_in)
        set_mode(stand_in, "ok")  # also releases the held answer's thread in the stand-in
        [c async for c in stand_in.stream_body({"prompt": [1], "max_tokens": 3, "stream": True})]
        fresh = stats(stand_in)["connections"] - before - reused
        await stand_in.aclose()
        return reused, open_while_idle, first.text, after_abandon, fresh, open_sockets(stand_in)

    reused, idle, first, after_abandon, fresh, after_close = asyncio.run(main())
    assert reused == 1 and idle == 1, (reused, idle)
    assert first == " Hi" and after_abandon == 0 and fresh == 1
    assert after_close == 0
