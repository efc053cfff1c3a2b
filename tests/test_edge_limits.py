"""Limits at the edge (services/api/edge.py, services/profiles.EdgeLimits), without Ray: body size per route from
Content-Length and while a chunked body streams, refused before anything reaches the app; multipart upload caps;
the websocket's limits; remote image fetch errors. One end-to-end check through the ``openai`` SDK against the
real service (413 from Ray's proxy)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from services.api.edge import DEFAULT_LIMITS, LIMITS_ENV, EdgeMiddleware, limits_from_env

LIMITS = {"routes": {"/v1/chat/completions": 1000, "/v1/audio/speech": 100}, "default": 10}


class _Inner:
    """A stand-in app: records every request that reaches it and the body it read."""

    def __init__(self):
        self.calls = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.calls.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def _drive(app, path: str, headers: list, chunks: list[bytes]):
    """Run one HTTP request through ``app`` as an ASGI server would: returns (status, headers, body, number of
    body messages the app pulled)."""
    pulled, out = [0], []
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        pulled[0] += 1
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(msg):
        out.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
    asyncio.run(app(scope, receive, send))
    start = out[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in out[1:]), pulled[0]


def test_content_length_over_the_route_limit_is_413_before_the_app_sees_it():
    inner = _Inner()
    app = EdgeMiddleware(inner, LIMITS)
    # 1001 bytes declared on a 1000-byte route: refused; the body (2 messages) is read and dropped first so a
    # client still writing it gets the answer.
    status, headers, body, pulled = _drive(app, "/v1/chat/completions", [(b"content-length", b"1001")],
                                           [b"x" * 500, b"x" * 501])
    err = json.loads(body)["error"]
    assert status == 413 and err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "1000 bytes" in err["message"] and err["param"] is None
    assert pulled == 2 and inner.calls == []
    # Expect: 100-continue: the client has sent nothing yet, so nothing is read and the connection closes.
    status, headers, _, pulled = _drive(app, "/v1/chat/completions",
                                        [(b"content-length", b"5000"), (b"expect", b"100-continue")], [b""])
    assert status == 413 and pulled == 0 and headers[b"connection"] == b"close" and inner.calls == []
    # The same 101 bytes pass on the chat route and are refused on the speech route (100) and elsewhere (10).
    assert _drive(app, "/v1/chat/completions", [(b"content-length", b"101")], [b"y" * 101])[0] == 200
    assert inner.calls == [("/v1/chat/completions", b"y" * 101)]
    assert _drive(app, "/v1/audio/speech", [(b"content-length", b"101")], [b"y" * 101])[0] == 413
    assert _drive(app, "/v1/models", [(b"content-length", b"11")], [b"y" * 11])[0] == 413
    assert _drive(app, "/v1/audio/speech/", [(b"content-length", b"100")], [b"y" * 100])[0] == 200
    assert len(inner.calls) == 2


def test_chunked_body_is_counted_while_it_streams_and_handed_on_whole():
    inner = _Inner()
    app = EdgeMiddleware(inner, LIMITS)
    te = [(b"transfer-encoding", b"chunked")]
    # 10 chunks of 100 bytes = exactly the limit: the app gets it whole, as one message.
    status, _, body, _ = _drive(app, "/v1/chat/completions", te, [bytes([65 + i]) * 100 for i in range(10)])
    assert status == 200 and inner.calls == [("/v1/chat/completions", b"".join(bytes([65 + i]) * 100
                                                                               for i in range(10)))]
    # One byte more, in an 11th chunk: 413, and the app was never called.
    status, _, body, _ = _drive(app, "/v1/chat/completions", te, [b"z" * 100] * 10 + [b"z"])
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large" and len(inner.calls) == 1
    # A client that disconnects mid-body: no response, no call.
    pending = [{"type": "http.request", "body": b"q" * 50, "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return pending.pop(0)

    async def send(msg):
        sent.append(msg)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": te,
                     "query_string": b""}, receive, send))
    assert sent == [] and len(inner.calls) == 1


def test_bad_content_length_is_400():
    status, _, body, _ = _drive(EdgeMiddleware(_Inner(), LIMITS), "/v1/chat/completions",
                                [(b"content-length", b"12x")], [b""])
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_content_length"


def test_limits_come_from_the_profile_or_the_environment(monkeypatch, profile):
    monkeypatch.delenv(LIMITS_ENV, raising=False)
    assert limits_from_env() == DEFAULT_LIMITS
    assert profile.server.limits.body_limits() == DEFAULT_LIMITS  # the profile's defaults are the proxy's
    monkeypatch.setenv(LIMITS_ENV, json.dumps({"routes": {"/v1/x": 5}, "default": 7}))
    mw = EdgeMiddleware(_Inner())
    assert mw.limit_for("/v1/x") == 5 and mw.limit_for("/v1/y") == 7
    monkeypatch.setenv(LIMITS_ENV, "[1]")
    with pytest.raises(ValueError, match=LIMITS_ENV):
        limits_from_env()


class _Counting:
    """A stand-in deployment that counts the calls reaching it."""

    def __init__(self):
        self.calls = 0

    async def ready(self):
        return True

    async def generate(self, *args, **kwargs):  # noqa: D401 - any chat call
        self.calls += 1
        raise AssertionError("a refused request reached the deployment")


def test_a_30_mb_chat_body_is_413_through_the_app_and_the_sdk(profile):
    """The ingress app of the cpu profile (default limits, 20 MiB for chat): a 30 MB body through the ``openai``
    SDK (AsyncOpenAI over ASGITransport) is ``openai.APIStatusError`` 413 ``request_too_large``; the stand-in
    deployment is never called."""
    import openai

    from services.api.app import build_app
    from services.deployments.backends import LocalBackend
    from services.config.profiles import parse_profile

    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    dep = _Counting()
    app = build_app(parse_profile(data), {"vlm": LocalBackend(dep)})

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(model="chimera-vlm", messages=[
                    {"role": "user", "content": "a" * (30 * 1000 * 1000)}])
            assert info.value.status_code == 413
            assert info.value.body["code"] == "request_too_large"

    asyncio.run(go())
    assert dep.calls == 0


def test_e2e_30_mb_chat_body_is_413_from_the_proxy(openai_client, serve_url):
    """Through Ray's HTTP proxy (its edge middleware, limits from CHIMERA_EDGE_LIMITS): the SDK gets 413
    ``request_too_large``, and the service answers a normal request afterwards."""
    import time

    import openai

    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        openai_client.chat.completions.create(model="chimera-vlm", messages=[
            {"role": "user", "content": "a" * (30 * 1000 * 1000)}], max_tokens=1)
    print(f"30 MB chat body -> {info.value.status_code} in {time.monotonic() - t0:.3f} s")
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
    assert httpx.get(f"{serve_url}/healthz", timeout=60).status_code == 200


class _SlowSpeech:
    """A scripted speech stand-in whose synthesis never finishes on its own (until the socket closes), so
    committed utterances stay pending."""

    async def ready(self):
        return True

    async def active(self):
        return 0

    async def speak(self, sentences, voice=None, speed=1.0, seed=None, first_index=0):
        await asyncio.sleep(3600)
        yield {"type": "done", "usage": {}}


def _speech_app(profile, **limits):
    from services.api.app import build_app
    from services.deployments.backends import LocalBackend
    from services.config.profiles import parse_profile

    data = profile.model_dump(mode="json")
    data["video"] = data["vlm"] = None
    data["server"]["limits"].update(limits)
    return build_app(parse_profile(data), {"tts": LocalBackend(_SlowSpeech())})


def test_websocket_message_size_closes_1009_and_commit_queue_is_bounded(profile):
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    app = _speech_app(profile, ws_max_message_bytes=200, ws_max_pending_commits=2)
    with TestClient(app) as client:
        with client.websocket_connect("/v1/audio/speech/stream") as ws:
            assert ws.receive_json()["type"] == "session.created"
            for _ in range(2):  # two utterances committed: both wait for audio that never comes
                ws.send_json({"type": "input_text.append", "text": "Hello there."})
                ws.send_json({"type": "input_text.commit"})
            ws.send_json({"type": "input_text.append", "text": "One more."})
            ws.send_json({"type": "input_text.commit"})
            err = ws.receive_json()
            assert err["type"] == "error" and err["error"]["code"] == "too_many_commits"
            # The socket stays open after that error: a cancel is answered.
            ws.send_json({"type": "response.cancel"})
            assert ws.receive_json()["status"] == "cancelled"
            # A frame of 201 bytes: closed with 1009.
            ws.send_text(json.dumps({"type": "input_text.append", "text": "x" * 201})[:201])
            with pytest.raises(WebSocketDisconnect) as info:
                ws.receive_json()
            assert info.value.code == 1009


def test_websocket_idle_timeout_closes_1001(profile):
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    app = _speech_app(profile, ws_idle_timeout_s=0.2)
    with TestClient(app) as client:
        with client.websocket_connect("/v1/audio/speech/stream") as ws:
            assert ws.receive_json()["type"] == "session.created"
            with pytest.raises(WebSocketDisconnect) as info:
                ws.receive_json()  # nothing sent: the server closes after 0.2 s idle
            assert info.value.code == 1001


def test_remote_image_fetch_errors_are_400_image_fetch_failed():
    """Connection refused (a port nobody listens on), DNS failure (the reserved ``.invalid`` TLD) and a
    timeout (a listening socket that never answers; timeout 0.2 s) are each 400 ``image_fetch_failed``."""
    import socket

    from core.media import ImageInputError, load_image_url

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        for url, hosts in ((f"http://127.0.0.1:{port}/a.png", ["127.0.0.1"]),
                           ("http://nowhere.invalid/a.png", ["nowhere.invalid"]),
                           (f"http://127.0.0.1:{silent.getsockname()[1]}/a.png", ["127.0.0.1"])):
            with pytest.raises(ImageInputError) as info:
                load_image_url(url, 1000, 1000, hosts, "messages[0].content[0].image_url", timeout_s=0.2)
            assert info.value.status_code == 400 and info.value.code == "image_fetch_failed", url
            assert info.value.param == "messages[0].content[0].image_url"
    finally:
        silent.close()


class _NoVideo:
    """A stand-in video deployment: a refused upload must never reach it."""

    calls = 0

    async def ready(self):
        return True

    async def queue_length(self):
        return 0

    async def create(self, *args, **kwargs):
        _NoVideo.calls += 1
        raise AssertionError("a refused upload reached the deployment")


def test_multipart_file_is_capped_while_it_streams(profile):
    """An ``input_reference`` file over ``video.limits.max_image_bytes`` (set to 100,000 here; the edge body
    limit is raised to 1 GiB so only the file cap acts) is 413 ``too_large`` naming the field, and the parser
    stops reading the body as soon as the file passes the cap: of the 64 KiB chunks of a 6.4 MB body, at most
    cap / 64 KiB + 3 (the form headers and the chunk that crosses the cap, rounded up) are pulled."""
    from services.api.app import build_app
    from services.deployments.backends import LocalBackend
    from services.config.profiles import parse_profile

    data = profile.model_dump(mode="json")
    data["vlm"] = data["tts"] = None
    data["video"]["engine"]["limits"]["max_image_bytes"] = 100_000
    data["server"]["limits"]["video_body_bytes"] = 1 << 30
    app = build_app(parse_profile(data), {"video": LocalBackend(_NoVideo())})
    boundary, chunk, n_chunks = "b0undary", 64 * 1024, 100
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na cat\r\n--{boundary}\r\n"
            "Content-Disposition: form-data; name=\"input_reference\"; filename=\"a.png\"\r\n"
            "Content-Type: image/png\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    pulled = [0]

    async def body():
        pulled[0] += 1
        yield head
        for _ in range(n_chunks):
            pulled[0] += 1
            yield b"\0" * chunk
        yield tail

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            size = len(head) + chunk * n_chunks + len(tail)
            r = await c.post("/v1/videos", content=body(), headers={
                "content-type": f"multipart/form-data; boundary={boundary}", "content-length": str(size)})
            return r

    r = asyncio.run(go())
    err = r.json()["error"]
    assert r.status_code == 413 and err["code"] == "too_large" and err["param"] == "input_reference"
    assert "100000 bytes" in err["message"]
    assert pulled[0] <= 100_000 // chunk + 3, pulled[0]
    assert _NoVideo.calls == 0


def _mp4(tmp_path, frames: int, w: int, h: int) -> bytes:
    import numpy as np

    from video.media import encode_mp4

    path = tmp_path / "v.mp4"
    encode_mp4(np.zeros((frames, h, w, 3), dtype=np.uint8), 8, path)
    return path.read_bytes()


def test_extension_upload_is_probed_from_its_header_before_any_decode(tmp_path, profile):
    """``probe_video`` reads frames and size from the container header: a 9-frame 32x16 MP4 reads as exactly
    that; against a 8-frame limit it is 413 ``too_many_frames``, against a 16-pixel width 413
    ``video_too_large``; bytes that are no container are 415. Through the video deployment's ``extend`` (a
    stand-in manager that must not be called), an upload over the profile's frame limit comes back as the
    probe's ``too_many_frames`` error event, not decode_video's later ``too_large``."""
    from video.media import MediaError, probe_video

    data = _mp4(tmp_path, 9, 32, 16)
    assert probe_video(data, 9, 64, 64, 4096) == {"frames": 9, "width": 32, "height": 16, "fps": 8.0}
    with pytest.raises(MediaError) as info:
        probe_video(data, 8, 64, 64, 4096)
    assert (info.value.status_code, info.value.code, info.value.param) == (413, "too_many_frames", "video")
    with pytest.raises(MediaError) as info:
        probe_video(data, 9, 16, 64, 4096)
    assert (info.value.status_code, info.value.code) == (413, "video_too_large")
    with pytest.raises(MediaError) as info:
        probe_video(b"not a video at all" * 10, 9, 64, 64, 4096)
    assert info.value.status_code == 415

    from services.config.profiles import FamilySection
    from services.deployments.video import Deployment
    from video.config import VideoConfig

    section = profile.video.model_dump(mode="json")
    section["engine"]["limits"].update(max_clips=1, max_frames_per_clip=5)
    section["engine"]["defaults"]["frames_per_clip"] = 5  # a default over the limit is refused at load
    dep = object.__new__(Deployment)
    dep.section = FamilySection[VideoConfig].model_validate(section)
    dep.cfg = dep.section.engine
    dep.manager = None  # any manager call would fail with AttributeError, not an error event
    ev = asyncio.run(dep.extend({"prompt": "more", "seconds": "1"}, video=data))
    assert ev["type"] == "error" and (ev["status"], ev["code"], ev["param"]) == (413, "too_many_frames", "video")


def test_one_lone_surrogate_check_per_side():
    """The model side's ``core.validate.find_invalid_unicode`` names the path of the first bad string (speech
    and video requests use it); the video router's JSON bodies use the services side's
    ``reject_invalid_unicode`` (400 ``invalid_unicode`` naming the path)."""
    from audio.validate import SpeechInputError, check_unicode
    from core.validate import find_invalid_unicode
    from services.api.body import reject_invalid_unicode
    from services.api.errors import APIError
    from video.request import RequestError, plan_request

    bad = "ok \ud800"
    assert find_invalid_unicode({"a": ["x", {"b": bad}]}) == "a[1].b"
    assert find_invalid_unicode({bad: 1}, "session") == "session"
    assert find_invalid_unicode({"a": "é", "b": ["ü"]}) is None
    with pytest.raises(SpeechInputError) as info:
        check_unicode({"text": bad}, "")
    assert (info.value.code, info.value.param) == ("invalid_unicode", "text")
    from services.config.profiles import load_profile

    with pytest.raises(RequestError) as info:
        plan_request(load_profile("cpu").video.engine, {"prompt": bad})
    assert (info.value.code, info.value.param) == ("invalid_unicode", "prompt")
    with pytest.raises(APIError) as info:
        reject_invalid_unicode({"prompt": "x", "input_reference": {"image_url": bad}})
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_unicode",
                                                                       "input_reference.image_url")


def test_a_slow_refused_body_is_answered_after_the_drain_bound(monkeypatch):
    """A refused body whose sender stalls is not waited for past ``DRAIN_MAX_S`` (0.1 s here): the 413 goes out
    with ``Connection: close``."""
    import services.api.edge as edge

    monkeypatch.setattr(edge, "DRAIN_MAX_S", 0.1)
    sent = []

    async def receive():
        await asyncio.sleep(3600)  # never sends its body

    async def send(msg):
        sent.append(msg)

    app = EdgeMiddleware(_Inner(), LIMITS)
    asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                     "headers": [(b"content-length", b"5000")], "query_string": b""}, receive, send))
    assert sent[0]["status"] == 413 and dict(sent[0]["headers"])[b"connection"] == b"close"
