"""End to end on Ray Serve with the cpu profile's ``vllm`` backend: the engine process dies mid-request.

Runs under the e2e lock (fixture ``serve_url``). The request being streamed gets an SSE error event with code
``engine_unavailable``; while the replica's supervisor restarts vLLM's server, ``/readyz`` is 503 and new requests
get a 503 with the same code; then the service answers again, exactly as before (greedy).
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
from ray import serve


def engine_stats() -> dict:
    return serve.get_deployment_handle("vlm", app_name="chimera").stats.remote().result()


def wait_for_readyz(url: str, status: int, timeout: float) -> bool:
    """Poll /readyz until it answers ``status`` (a bound for a failing run, not a timing claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/readyz", timeout=10).status_code == status:
            return True
        time.sleep(0.2)
    return False


def test_killing_the_engine_mid_stream_is_a_clean_error_then_recovery(serve_url, openai_client):
    short = [{"role": "user", "content": "What is the capital of France?"}]
    before = openai_client.chat.completions.create(model="chimera-vlm", messages=short, max_tokens=12, temperature=0)
    stats = engine_stats()
    assert stats["backend"] == "vllm" and stats["engine_state"] == "ready"
    body = {"messages": [{"role": "user", "content": "Write a very long essay about the sea."}], "max_tokens": 400,
            "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{serve_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:  # the role chunk and two tokens: vLLM is mid-request
                os.kill(stats["engine_pid"], signal.SIGKILL)
    assert events[-1] != "[DONE]"
    err = json.loads(events[-1])["error"]
    assert err["code"] == "engine_unavailable" and err["type"] == "service_unavailable" and err["message"]
    assert all("choices" in json.loads(e) for e in events[:-1])
    assert wait_for_readyz(serve_url, 503, 30)
    r = httpx.post(f"{serve_url}/v1/chat/completions", json={"messages": short, "max_tokens": 4}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert wait_for_readyz(serve_url, 200, 600)
    after = openai_client.chat.completions.create(model="chimera-vlm", messages=short, max_tokens=12, temperature=0)
    assert after.choices[0].message.content == before.choices[0].message.content
    stats2 = engine_stats()
    assert stats2["engine_restarts"] == stats["engine_restarts"] + 1 and stats2["engine_pid"] != stats["engine_pid"]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = openai_client.chat.completions.create(
        model="chimera-vlm", messages=short, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop" and set(json.loads(r.choices[0].message.content)) == {"city"}
