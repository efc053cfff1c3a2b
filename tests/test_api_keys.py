"""API keys (services/app.AuthMiddleware, services/profiles.ServerOptions), without Ray: keys from the profile and
from ``CHIMERA_API_KEYS``, several keys, the key id routes see, ``/metrics`` optionally behind a key, websocket
auth, and the 401 through the ``openai`` SDK."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest

from services.app import build_app, key_id
from services.backends import LocalBackend
from services.profiles import API_KEYS_ENV, ProfileError, parse_profile


class _Ready:
    async def ready(self):
        return True


def _app(profile, families=("vlm",), **server):
    data = profile.model_dump(mode="json")
    for fam in ("vlm", "video", "tts"):
        if fam not in families:
            data[fam] = None
    data["server"].update(server)
    prof = parse_profile(data)
    app = build_app(prof, {f: LocalBackend(_Ready()) for f in families})

    @app.get("/v1/_whoami")
    async def whoami(request: __import__("fastapi").Request):
        """Test route: the key id the auth middleware put in the request state."""
        return {"key_id": getattr(request.state, "key_id", None)}

    return app


def _run(app, coro_fn):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await coro_fn(c)

    return asyncio.run(go())


def test_key_id_is_a_hash_prefix_never_the_key():
    assert key_id("sk-a") == hashlib.sha256(b"sk-a").hexdigest()[:16]
    assert key_id("sk-a") != key_id("sk-b") and "sk-a" not in key_id("sk-a")


def test_several_keys_from_profile_and_environment(monkeypatch, profile):
    monkeypatch.setenv(API_KEYS_ENV, " sk-env-1 ,, sk-env-2,sk-prof")
    app = _app(profile, api_keys=["sk-prof"])

    async def go(c):
        out = {}
        for key in ("sk-prof", "sk-env-1", "sk-env-2", "sk-env", "", "sk-prof2"):
            r = await c.get("/v1/_whoami", headers={"Authorization": f"Bearer {key}"} if key else {})
            out[key] = (r.status_code, r.json().get("key_id") if r.status_code == 200 else r.json()["error"]["code"])
        return out

    out = _run(app, go)
    assert out == {"sk-prof": (200, key_id("sk-prof")), "sk-env-1": (200, key_id("sk-env-1")),
                   "sk-env-2": (200, key_id("sk-env-2")), "sk-env": (401, "invalid_api_key"),
                   "": (401, "invalid_api_key"), "sk-prof2": (401, "invalid_api_key")}


def test_no_keys_means_open_and_no_key_id(monkeypatch, profile):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    r = _run(_app(profile), lambda c: c.get("/v1/_whoami"))
    assert r.status_code == 200 and r.json() == {"key_id": None}


def test_blank_profile_key_is_refused(profile):
    data = profile.model_dump(mode="json")
    data["server"]["api_keys"] = ["sk-a", "  "]
    with pytest.raises(ProfileError, match="blank"):
        parse_profile(data).server.all_api_keys()


def test_metrics_behind_a_key_only_when_asked(monkeypatch, profile):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)

    async def go(c):
        return [(await c.get("/metrics")).status_code,
                (await c.get("/metrics", headers={"Authorization": "Bearer sk-a"})).status_code,
                (await c.get("/healthz")).status_code]

    assert _run(_app(profile, api_keys=["sk-a"]), go) == [200, 200, 200]
    assert _run(_app(profile, api_keys=["sk-a"], metrics_requires_key=True), go) == [401, 200, 200]
    assert _run(_app(profile, metrics_requires_key=True), go) == [200, 200, 200]  # no keys: open


def test_websocket_needs_a_key_by_header_or_query(monkeypatch, profile):
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    app = _app(profile, families=("tts",), api_keys=["sk-ws"])
    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect) as info:
            with client.websocket_connect("/v1/audio/speech/stream?api_key=wrong") as ws:
                ws.receive_json()
        assert info.value.code == 1008
    for url, headers in (("/v1/audio/speech/stream?api_key=sk-ws", {}),
                         ("/v1/audio/speech/stream", {"Authorization": "Bearer sk-ws"})):
        with TestClient(app) as client, client.websocket_connect(url, headers=headers) as ws:
            assert ws.receive_json()["type"] == "session.created"


def test_openai_sdk_gets_401_authentication_error(monkeypatch, profile):
    """The ``openai`` SDK (AsyncOpenAI over ASGITransport, no Ray) with a wrong key: ``openai.AuthenticationError``
    (401, code ``invalid_api_key``); with the right key the model list."""
    import openai

    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    app = _app(profile, api_keys=["sk-right"])

    async def go(c):
        wrong = openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-wrong", http_client=c, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            await wrong.models.list()
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        right = openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-right", http_client=c, max_retries=0)
        return [m.id async for m in right.models.list()]

    assert _run(app, go) == ["chimera-vlm"]
