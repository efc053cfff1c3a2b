"""API keys (services/app.AuthMiddleware, services/profiles.ServerOptions), without Ray: keys from the profile and
from ``CHIMERA_API_KEYS``, several keys, the key id routes see, ``/metrics`` optionally behind a key, websocket
auth, and the 401 through the ``openai`` SDK."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest

from services.api.app import build_app
from services.api.auth import key_id
from services.deployments.backends import LocalBackend
from services.config.profiles import API_KEYS_ENV, ProfileError, parse_profile


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


class _Files:
    """A stand-in video deployment answering ``content`` with a file's path (as the job manager does) and
    recording the owner each call carried."""

    def __init__(self, path):
        self.path, self.owners = str(path), []

    async def ready(self):
        return True

    async def queue_length(self):
        return 0

    async def content(self, video_id, variant="video", owner=None):
        self.owners.append(owner)
        if video_id != "video_a":
            return {"type": "error", "status": 404, "message": "no such video", "param": "video_id",
                    "code": "video_not_found"}
        return {"path": self.path, "size": 0}


def test_download_streams_the_file_with_ranges(monkeypatch, tmp_path, profile):
    """``GET /v1/videos/{id}/content`` serves the file at the path the manager names: whole (200, exact bytes,
    ``Accept-Ranges``), ``bytes=10-19`` (206, those 10 bytes, ``Content-Range: bytes 10-19/1000``), a suffix
    ``bytes=-5`` (the last 5), and ranges it cannot satisfy (past the end, malformed, another unit): 416
    ``range_not_satisfiable`` in the OpenAI error shape with ``Content-Range: bytes */1000``. The request's key
    id reaches the deployment as the owner."""
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    blob = bytes(range(256)) * 3 + bytes(232)
    assert len(blob) == 1000
    f = tmp_path / "video.mp4"
    f.write_bytes(blob)
    dep = _Files(f)
    data = profile.model_dump(mode="json")
    data["vlm"] = data["tts"] = None
    data["server"]["api_keys"] = ["sk-a"]
    app = build_app(parse_profile(data), {"video": LocalBackend(dep)})
    auth = {"Authorization": "Bearer sk-a"}

    async def go(c):
        url = "/v1/videos/video_a/content"
        r = await c.get(url, headers=auth)
        assert r.status_code == 200 and r.content == blob and r.headers["content-type"] == "video/mp4"
        assert r.headers["accept-ranges"] == "bytes"
        assert r.headers["content-disposition"] == 'attachment; filename="video_a.mp4"'
        r = await c.get(url, headers={**auth, "Range": "bytes=10-19"})
        assert r.status_code == 206 and r.content == blob[10:20]
        assert r.headers["content-range"] == "bytes 10-19/1000"
        r = await c.get(url, headers={**auth, "Range": "bytes=-5"})
        assert r.status_code == 206 and r.content == blob[-5:]
        for bad in ("bytes=1000-", "bytes=5-2", "bytes=abc", "items=0-1", "bytes=-0", "bytes="):
            r = await c.get(url, headers={**auth, "Range": bad})
            assert r.status_code == 416, bad
            assert r.json()["error"]["code"] == "range_not_satisfiable"
            assert r.headers["content-range"] == "bytes */1000"
        r = await c.get("/v1/videos/video_b/content", headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"
        assert (await c.get(url)).status_code == 401

    _run(app, go)
    assert dep.owners == [key_id("sk-a")] * 10


def _manager(tmp_path, profile):
    """A JobManager (the class, no Ray) on a store in ``tmp_path``; its job launcher is a scripted no-op (these
    tests are about ownership, not generation)."""
    from services.jobs.manager import JobManager

    cfg = profile.video.engine.model_dump(mode="json")
    cfg["jobs"]["store_url"] = f"sqlite:///{tmp_path}/jobs.sqlite"
    cfg["jobs"]["results_dir"] = str(tmp_path / "results")
    m = JobManager(cfg, str(tmp_path), "chimera-video")
    m._launch = lambda row: None
    return m


def test_each_job_belongs_to_the_key_that_made_it(tmp_path, profile):
    """Key A's job is 404 ``video_not_found`` for key B on get, list (and as a list cursor), content, extension
    source and delete, and stays there after B's delete; A sees it; without keys (owner None) every job is
    visible. Idempotency keys are per key: A and B sending the same key get two jobs, A resending gets its own
    one back. The store holds the key id, never the key."""
    from services.jobs.errors import JobError
    from video.request import plan_request

    m = _manager(tmp_path, profile)
    a, b = key_id("sk-owner-a"), key_id("sk-owner-b")
    req = plan_request(profile.video.engine, {"prompt": "a cat"}).to_dict()

    async def go():
        ja = await m.create(req, idempotency_key="same", owner=a)
        jb = await m.create(req, idempotency_key="same", owner=b)
        assert ja["id"] != jb["id"]
        assert (await m.create(req, idempotency_key="same", owner=a))["id"] == ja["id"]
        m.store.update(ja["id"], status="completed", completed_at=1.0, expires_at=4e9)
        jd = m.store.job_dir(ja["id"])
        (jd / "video.mp4").write_bytes(b"\0" * 1234)
        (jd / "meta.json").write_text('{"reference": {}, "width": 64, "height": 64, "fps": 8, "frames": 9}')
        for call in (m.get(ja["id"], owner=b), m.content_path(ja["id"], owner=b), m.delete(ja["id"], owner=b),
                     m.extension_source(ja["id"], owner=b), m.list(after=ja["id"], owner=b)):
            with pytest.raises(JobError) as info:
                await call
            assert (info.value.status_code, info.value.code) == (404, "video_not_found")
        assert (await m.get(ja["id"], owner=a))["id"] == ja["id"]
        assert [v["id"] for v in (await m.list(owner=a))["data"]] == [ja["id"]]
        assert [v["id"] for v in (await m.list(owner=b))["data"]] == [jb["id"]]
        assert {v["id"] for v in (await m.list())["data"]} == {ja["id"], jb["id"]}  # no keys: open
        where = await m.content_path(ja["id"], owner=a)
        assert where == {"path": str((jd / "video.mp4").resolve()), "size": 1234}
        assert (await m.extension_source(ja["id"], owner=a))["width"] == 64
        assert (await m.delete(ja["id"], owner=a))["deleted"] is True
        with pytest.raises(JobError):
            await m.get(ja["id"])
        return jb

    jb = asyncio.run(go())
    row = m.store.get(jb["id"])
    assert row["owner"] == b and row["idempotency_key"] != "same" and row["idempotency_key"].startswith(b + ":")
    m.store.engine.dispose()
    assert b"sk-owner" not in b"".join(p.read_bytes() for p in tmp_path.glob("jobs.sqlite*"))
