"""Issue 14: the 413 and 429 paths through the official ``openai`` SDK, and the SDK's retry of a 429 honouring
``Retry-After`` (401 through the SDK is in ``tests/test_api_keys.py``).

- 413: bodies over the edge's per-route limits (``server.limits``: chat 20 MiB, speech 1 MiB) and an
  ``input_reference`` upload over ``video.limits.max_image_bytes`` against the session's real service: the SDK
  raises ``APIStatusError`` 413 with the documented code, and the service answers normally afterwards.
- 429: the ingress in-process (``build_app`` over ``httpx.ASGITransport``) with a scripted stand-in VLM
  deployment whose queue is full: it raises Ray Serve's own ``BackPressureError`` (what a replica handle raises
  at ``max_queued_requests``) with ``retry_after_s=RETRY_AFTER_S``. The SDK (``max_retries=2``) makes exactly 3
  attempts, each at least ``RETRY_AFTER_S`` after the previous one (a lower bound: a slow machine only lengthens
  the gaps; without ``Retry-After`` the SDK's first backoff is at most 0.5 s + jitter), then raises
  ``RateLimitError`` carrying ``queue_full``.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from services.api.app import build_app
from services.deployments.backends import LocalBackend
from services.config.profiles import parse_profile

RETRY_AFTER_S = 2


def test_413_through_the_sdk(openai_client, serve_url):
    with pytest.raises(openai.APIStatusError) as e:
        openai_client.chat.completions.create(model="chimera-vlm", max_tokens=1,
                                              messages=[{"role": "user", "content": "x" * (21 * 2**20)}])
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large", e.value.body
    with pytest.raises(openai.APIStatusError) as e:
        openai_client.audio.speech.create(model="chimera-tts", voice="tara", input="y" * (2 * 2**20))
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large", e.value.body
    with pytest.raises(openai.APIStatusError) as e:
        openai_client.videos.create(prompt="x", size="64x64",
                                    input_reference=("big.png", b"\0" * (8 * 2**20 + 1), "image/png"))
    assert e.value.status_code == 413 and e.value.body["code"] == "too_large", e.value.body
    out = openai_client.chat.completions.create(model="chimera-vlm", max_tokens=1,
                                                messages=[{"role": "user", "content": "hi"}])
    assert out.usage.completion_tokens == 1


class FullQueue:
    """A VLM deployment stand-in whose queue is always full (scripted misbehaviour; no model involved): every
    ``chat_stream`` raises Ray Serve's ``BackPressureError``; ``calls`` holds the monotonic time of each."""

    def __init__(self):
        self.calls: list[float] = []

    async def ready(self):
        return True

    async def chat_stream(self, payload):
        from ray.serve.exceptions import BackPressureError

        self.calls.append(time.monotonic())
        raise BackPressureError(num_queued_requests=16, max_queued_requests=16, retry_after_s=RETRY_AFTER_S)
        yield  # an async generator, as the real deployment's


def test_sdk_retries_429_after_retry_after(profile):
    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    dep = FullQueue()
    app = build_app(parse_profile(data), {"vlm": LocalBackend(dep)})

    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=2, http_client=http)
        try:
            with pytest.raises(openai.RateLimitError) as e:
                await client.chat.completions.create(model="chimera-vlm", max_tokens=1,
                                                     messages=[{"role": "user", "content": "hi"}])
        finally:
            await http.aclose()
        return e.value

    err = asyncio.run(go())
    assert err.status_code == 429 and err.body["code"] == "queue_full"
    assert err.response.headers["retry-after"] == str(RETRY_AFTER_S)
    assert len(dep.calls) == 3  # the first try and max_retries=2
    gaps = [b - a for a, b in zip(dep.calls, dep.calls[1:])]
    assert all(g >= RETRY_AFTER_S for g in gaps), gaps
