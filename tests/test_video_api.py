"""``/v1/videos`` end to end: the real Ray Serve app of the cpu profile, the official ``openai`` SDK as client.

Sizes are tiny (64x64, 9 frames per clip at 2 fps, 2 denoising steps) so the whole file runs in well under a
minute once the service is up. Durations follow :mod:`video.request`: ``seconds`` s at 2 fps is ``2 * seconds``
frames (``"4"``: one clip cut to 8 frames), and the object's ``seconds`` is the served MP4's frames / fps.

The tests at the end run the ingress and the video deployment in-process instead (``httpx.ASGITransport``, no
Ray), with a recording stand-in for the job manager: upload caps, what an extension inherits, and a 400 naming
the field for every field of another type than the documented one.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import struct
import time
import uuid
import zlib
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import wait_for_video

from video.media import decode_video

FAST = {"num_inference_steps": 2}


def _wait(client, video_id, timeout=600):
    return wait_for_video(client, video_id, timeout)


def _frames(client, video_id):
    frames, fps = decode_video(client.videos.download_content(video_id).content)
    return frames, fps


def _assert_lasts(video, frames, fps):
    """The object's ``seconds`` is the served file's duration (frames / fps), to the label's 6 digits."""
    assert abs(len(frames) / fps - float(video.seconds)) < 1e-5 * len(frames) / fps, (video.seconds, len(frames), fps)


def _extend(client, video_id, **kw):
    """``client.videos.extend(video={"id": ...})``. openai 3.57's ``extend`` refuses a dict for ``video`` on the
    client side (its multipart extraction expects a file), so then the same SDK client posts the JSON body."""
    try:
        return client.videos.extend(video={"id": video_id}, **kw)
    except RuntimeError as err:
        if "Expected entry at `video`" not in str(err):
            raise
        return client.post("/videos/extensions", body={"video": {"id": video_id}, **kw}, cast_to=openai.types.Video)


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _newest(url):
    return httpx.get(f"{url}/v1/videos", params={"limit": 1}).json()["first_id"]


@pytest.fixture(scope="module")
def t2v(openai_client):
    v = openai_client.videos.create(prompt="a lighthouse at dusk", seconds="4", size="64x64", extra_body=FAST)
    assert v.status == "queued" and v.progress == 0 and v.model == "chimera-video" and v.size == "64x64"
    assert v.model_extra["phase"] == "queued"
    return v


def test_text_to_video(openai_client, t2v):
    v = _wait(openai_client, t2v.id)
    assert v.status == "completed" and v.progress == 100, v.error
    assert v.seconds == "4" and v.completed_at >= v.created_at and v.expires_at > v.completed_at
    extra = v.model_extra
    assert extra["clips_total"] == extra["clips_done"] == 1
    assert extra["phase"] is None  # a finished job has no phase (README)
    frames, fps = _frames(openai_client, v.id)
    assert frames.shape == (8, 64, 64, 3) and fps == 2  # 4 s at 2 fps (was 9 frames = 4.5 s)
    _assert_lasts(v, frames, fps)
    thumb = openai_client.videos.download_content(v.id, variant="thumbnail")
    from PIL import Image

    assert Image.open(io.BytesIO(thumb.content)).size == (64, 64)


def test_image_to_video_from_a_photograph(openai_client, astronaut):
    v = openai_client.videos.create(prompt="an astronaut waves", seconds="8", size="64x64",
                                    input_reference=("astronaut.png", _png(astronaut), "image/png"),
                                    extra_body=FAST)
    v = _wait(openai_client, v.id)
    assert v.status == "completed", v.error
    assert v.model_extra["clips_total"] == 2 and v.seconds == "8"
    frames, fps = _frames(openai_client, v.id)
    assert frames.shape == (16, 64, 64, 3)  # 2 chained clips, no repeated frame at the seam, cut to 8 s
    _assert_lasts(v, frames, fps)


def test_extend_appends_to_the_original(openai_client, t2v):
    _wait(openai_client, t2v.id)
    original, _ = _frames(openai_client, t2v.id)
    e = _extend(openai_client, t2v.id, prompt="the light turns on", seconds="4")
    assert e.status == "queued" and e.seconds == "8"
    e = _wait(openai_client, e.id)
    assert e.status == "completed" and e.seconds == "8", e.error  # the whole joined video: 4 s + 4 s
    frames, fps = _frames(openai_client, e.id)
    assert frames.shape == (16, 64, 64, 3)
    _assert_lasts(e, frames, fps)
    head = np.abs(frames[:8].astype(float) - original.astype(float)).mean()
    other = np.abs(frames[8:].astype(float) - original.astype(float)).mean()
    assert head < 6 and head < other / 3, (head, other)


def test_extend_by_multipart_video_id(serve_url, openai_client, t2v):
    """What the SDK's multipart encoding of ``video={"id": ...}`` sends: a ``video[id]`` form field."""
    _wait(openai_client, t2v.id)
    r = httpx.post(f"{serve_url}/v1/videos/extensions", data={"prompt": "on", "seconds": "4"},
                   files={"video[id]": (None, t2v.id)})  # a multipart field without filename
    assert r.status_code == 200, r.text
    e = _wait(openai_client, r.json()["id"])
    assert e.status == "completed" and _frames(openai_client, e.id)[0].shape == (16, 64, 64, 3)


def test_idempotency_key_returns_the_same_job(openai_client, serve_url):
    h = {"Idempotency-Key": f"test-{uuid.uuid4().hex}"}
    a = openai_client.videos.create(prompt="same", size="64x64", extra_headers=h, extra_body=FAST)
    b = openai_client.videos.create(prompt="same", size="64x64", extra_headers=h, extra_body=FAST)
    assert a.id == b.id
    # the same request in another encoding (JSON, vLLM-Omni width/height) is the same canonical request
    r = httpx.post(f"{serve_url}/v1/videos", headers=h, json={"prompt": "same", "width": 64, "height": 64,
                                                               "num_inference_steps": 2})
    assert r.status_code == 200 and r.json()["id"] == a.id, r.text
    for other, extra in (({"prompt": "different", "size": "64x64"}, FAST), ({"prompt": "same", "size": "32x64"}, FAST),
                         ({"prompt": "same", "size": "64x64"}, {"num_inference_steps": 3})):
        with pytest.raises(openai.ConflictError) as e:
            openai_client.videos.create(**other, extra_headers=h, extra_body=extra)
        assert e.value.status_code == 409
        assert e.value.body["code"] == "idempotency_key_reused" and e.value.body["param"] == "Idempotency-Key"
    assert _newest(serve_url) == a.id
    assert openai_client.videos.delete(a.id).deleted is True


def test_vllm_omni_fields_in_json(serve_url, openai_client):
    r = httpx.post(f"{serve_url}/v1/videos", json={"prompt": "waves", "width": 32, "height": 64, "num_frames": 5,
                                                    "fps": 4, "num_inference_steps": 2, "seed": 5,
                                                    "drift_correction": False})
    assert r.status_code == 200, r.text
    v = _wait(openai_client, r.json()["id"])
    assert v.status == "completed" and v.size == "32x64"
    frames, fps = _frames(openai_client, v.id)
    assert frames.shape == (5, 64, 32, 3) and fps == 4 and v.seconds == "1.25"  # one 5-frame clip, no seconds


def test_non_ascii_text_in_every_body_encoding(serve_url, openai_client):
    """Valid UTF-8 stays text in multipart (the SDK), urlencoded (raw and %-encoded) and JSON bodies; only text
    that is not valid Unicode is refused (``invalid_unicode``, tested with the bad requests)."""
    prompt = "café ☕ über"
    v = openai_client.videos.create(prompt=prompt, size="64x64", extra_body=FAST)
    sent = [(v.id, v.prompt)]
    for kw in ({"content": b"prompt=caf%C3%A9+%E2%98%95+%C3%BCber&size=64x64&num_inference_steps=2",
                "headers": {"content-type": "application/x-www-form-urlencoded"}},
               {"content": "prompt=café ☕ über&size=64x64&num_inference_steps=2".encode(),
                "headers": {"content-type": "application/x-www-form-urlencoded"}},
               {"json": {"prompt": prompt, "size": "64x64", "num_inference_steps": 2}}):
        r = httpx.post(f"{serve_url}/v1/videos", **kw)
        assert r.status_code == 200, r.text
        sent.append((r.json()["id"], r.json()["prompt"]))
    assert [p for _, p in sent] == [prompt] * 4
    for video_id, _ in sent:
        assert openai_client.videos.delete(video_id).deleted is True


def test_download_of_an_unfinished_job_is_409(openai_client, serve_url):
    v = openai_client.videos.create(prompt="slow", seconds="32", size="128x128",
                                    extra_body={"num_inference_steps": 50})
    with pytest.raises(openai.ConflictError):
        openai_client.videos.download_content(v.id)
    openai_client.videos.delete(v.id)
    with pytest.raises(openai.NotFoundError):  # deleting twice
        openai_client.videos.delete(v.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.videos.retrieve(v.id)


def test_unknown_id_is_404(openai_client, serve_url):
    for call in (lambda: openai_client.videos.retrieve("video_doesnotexist"),
                 lambda: openai_client.videos.download_content("video_doesnotexist"),
                 lambda: openai_client.videos.delete("video_doesnotexist")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "video_not_found" and e.value.body["param"] == "video_id"
    with pytest.raises(openai.NotFoundError) as e:
        _extend(openai_client, "video_doesnotexist", prompt="x", seconds="4")
    assert e.value.body["code"] == "video_not_found" and e.value.body["param"] == "video"  # the request field
    r = httpx.post(f"{serve_url}/v1/videos/extensions", data={"prompt": "on", "seconds": "4"},
                   files={"video[id]": (None, "video_doesnotexist")})
    assert r.status_code == 404 and r.json()["error"]["param"] == "video", r.text


@pytest.mark.parametrize("kwargs,status,param,code", [
    ({"size": "big"}, 400, "size", "invalid_size"),
    ({"size": "100x64"}, 400, "size", "invalid_size"),
    ({"seconds": "0"}, 400, "seconds", "invalid_duration"),
    ({"seconds": "100"}, 400, "seconds", "invalid_duration"),
    ({"prompt": "p" * 2001}, 400, "prompt", "prompt_too_long"),
    ({"input_reference": ("x.png", b"this is not an image", "image/png")}, 415, "input_reference",
     "unsupported_image_type"),
    ({"extra_body": {"num_frames": 8}}, 400, "num_frames", "invalid_frame_count"),
    ({"extra_body": {"num_frames": 1}}, 400, "num_frames", "invalid_frame_count"),
    ({"extra_body": {"response_format": "mp4"}}, 400, "response_format", "unsupported_parameter"),
    ({"extra_body": {"n": 2}}, 400, "n", "unsupported_parameter"),
    ({"extra_body": {"size": "64x64", "width": 32}}, 400, "size", "invalid_size"),
    ({"extra_body": {"guidance_scale": 99}}, 400, "guidance_scale", "invalid_value"),
    ({"model": "no-such-model"}, 404, "model", "model_not_found"),
])
def test_bad_input_leaves_no_job(openai_client, serve_url, kwargs, status, param, code):
    before = _newest(serve_url)
    args = {"prompt": "a cat", "size": "64x64", **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        openai_client.videos.create(**args)
    assert e.value.status_code == status
    err = e.value.body
    assert err["param"] == param and err["code"] == code and err["message"], err
    assert _newest(serve_url) == before


def _b64_png(img) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(img)).decode()


@pytest.mark.parametrize("method,path,kw,status,code", [
    ("post", "/v1/videos", {"json": {"size": "64x64"}}, 400, "missing_required_parameter"),      # no prompt
    ("post", "/v1/videos", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400,
     "invalid_json"),
    ("post", "/v1/videos", {"content": b'{"prompt": "\xff"}', "headers": {"content-type": "application/json"}}, 400,
     "invalid_json"),                                                                             # not UTF-8
    ("post", "/v1/videos", {"json": ["a list"]}, 400, "invalid_json"),
    ("post", "/v1/videos", {"content": b"x", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
    ("post", "/v1/videos", {"json": {"prompt": "x", "input_reference": {"file_id": "file_1"}}}, 400, "invalid_value"),
    ("post", "/v1/videos", {"json": {"prompt": "x", "input_reference": {"image_url": "http://a/b.png"}}}, 400,
     "invalid_image_url"),
    ("post", "/v1/videos", {"json": {"prompt": "x", "input_reference": {"image_url": "data:image/png;base64,@@"}}},
     400, "invalid_base64"),                                                 # core.media's data-URL codes, as chat's
    ("post", "/v1/videos", {"json": {"prompt": "x", "input_reference": {"image_url": "data:text/plain;base64,aGk="}}},
     415, "unsupported_image_type"),
    ("post", "/v1/videos", {"data": {"prompt": "x"}, "files": {"other": ("a.bin", b"123")}}, 400, "unexpected_file"),
    ("post", "/v1/videos", {"json": {"prompt": "x"}, "headers": {"Idempotency-Key": "k" * 300}}, 400,
     "invalid_idempotency_key"),
    ("post", "/v1/videos", {"json": {"prompt": "x", "sparsity": 0}}, 400, "invalid_value"),
    ("post", "/v1/videos", {"json": {"prompt": 5}}, 400, "invalid_value"),
    ("post", "/v1/videos", {"json": {"prompt": "x", "model": 5}}, 400, "invalid_value"),
    ("post", "/v1/videos", {"data": {"prompt": "x"},
                            "files": {"input_reference": ("big.png", b"\0" * (8 * 2**20 + 1), "image/png")}}, 413,
     "too_large"),
    ("post", "/v1/videos", {"data": {"prompt": "x"}, "files": {"input_reference": ("bomb.png", "BOMB", "image/png")}},
     413, "image_too_large"),                                                # over max_image_pixels: core.media
    ("post", "/v1/videos", {"json": {"prompt": "x", "guidance_scale": "loud"}}, 400, "invalid_value"),
    # fields the service does not implement are named, never ignored (JSON, multipart, extensions)
    ("post", "/v1/videos", {"json": {"prompt": "x", "quality": "high"}}, 400, "invalid_value"),
    ("post", "/v1/videos", {"data": {"prompt": "x", "remix_video_id": "v"}, "files": {"n": (None, "1")}}, 400,
     "unsupported_parameter"),
    ("post", "/v1/videos/extensions", {"json": {"prompt": "x", "seconds": "4", "video": {"id": "v"}, "size": "64x64"}},
     400, "unsupported_parameter"),
    ("post", "/v1/videos/extensions", {"data": {"prompt": "x", "seconds": "4", "video[id]": "v", "style": "noir"},
                                       "files": {"n": (None, "1")}}, 400, "unsupported_parameter"),
    # a lone UTF-16 surrogate escaped in JSON; its bytes (not UTF-8) in multipart and urlencoded fields
    ("post", "/v1/videos", {"content": b'{"prompt": "a \\ud800 cat"}', "headers": {"content-type": "application/json"}},
     400, "invalid_unicode"),
    ("post", "/v1/videos", {"content": b'{"prompt": "x", "negative_prompt": "\\udc00"}',
                            "headers": {"content-type": "application/json"}}, 400, "invalid_unicode"),
    ("post", "/v1/videos/extensions", {"content": b'{"prompt": "\\ud800", "seconds": "4", "video": {"id": "v"}}',
                                       "headers": {"content-type": "application/json"}}, 400, "invalid_unicode"),
    ("post", "/v1/videos", {"content": "MULTIPART-SURROGATE"}, 400, "invalid_unicode"),
    ("post", "/v1/videos", {"content": b"prompt=a%ED%A0%80", "headers": {"content-type":
                                                                         "application/x-www-form-urlencoded"}}, 400,
     "invalid_unicode"),
    ("post", "/v1/videos/extensions", {"json": {"prompt": "x", "seconds": "4"}}, 400,
     "missing_required_parameter"),                                                               # no video
    ("post", "/v1/videos/extensions", {"json": {"seconds": "4", "video": {"id": "v"}}}, 400,
     "missing_required_parameter"),                                                               # no prompt
    ("post", "/v1/videos/extensions", {"json": {"prompt": "x", "seconds": "4", "video": [1]}}, 400, "invalid_value"),
    ("post", "/v1/videos/extensions", {"data": {"prompt": "x", "seconds": "4"},
                                       "files": {"video": ("v.mp4", b"not a video", "video/mp4")}}, 415,
     "unsupported_media_type"),
    ("post", "/v1/videos/extensions", {"content": b'{\x00"\x00x', "headers": {"content-type": "application/json"}},
     400, "invalid_json"),                                                                       # odd UTF-16
    ("get", "/v1/videos?limit=0", {}, 400, "invalid_value"),
    ("get", "/v1/videos?limit=many", {}, 400, "invalid_value"),
    ("get", "/v1/videos?order=sideways", {}, 400, "invalid_value"),
    ("get", "/v1/videos?after=video_nope", {}, 404, "video_not_found"),
    # what a tester found accepted by the served app (each in-process test below has the details)
    ("post", "/v1/videos", {"json": {"prompt": "x", "model": "chimera-tts"}}, 400, "model_not_supported"),
    ("post", "/v1/videos", {"json": {"prompt": "x", "fps": "2"}}, 400, "invalid_value"),
    ("post", "/v1/videos", {"json": {"prompt": "x", "drift_correction": "no"}}, 400, "invalid_value"),
    ("post", "/v1/videos", {"content": b"prompt=a&prompt=b", "headers": {"content-type":
                                                                         "application/x-www-form-urlencoded"}}, 400,
     "duplicate_parameter"),
    ("post", "/v1/videos/extensions", {"data": {"prompt": "x", "seconds": "0.5"},
                                       "files": {"video": ("v.png", "STILL", "image/png")}}, 415,
     "unsupported_media_type"),
    ("post", "/v1/videos/extensions", {"data": {"prompt": "x", "seconds": "4", "video[id]": "v"},
                                       "files": {"video": ("v.mp4", b"not a video", "video/mp4")}}, 400,
     "invalid_value"),
    ("get", "/v1/videos?foo=1", {}, 400, "unknown_parameter"),
    ("get", "/v1/videos/video_nope/content?foo=1", {}, 400, "unknown_parameter"),
])
def test_bad_requests_over_http(serve_url, method, path, kw, status, code):
    before = _newest(serve_url)
    if kw.get("content") == "MULTIPART-SURROGATE":  # the UTF-8-style bytes of U+D800 in a form field
        body = (b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na \xed\xa0\x80 cat\r\n--b\r\n'
                b'Content-Disposition: form-data; name="size"\r\n\r\n64x64\r\n--b--\r\n')
        kw = {"content": body, "headers": {"content-type": "multipart/form-data; boundary=b"}}
    files = kw.get("files", {})
    if files.get("input_reference", (None, None))[1] == "BOMB":  # 5000x4000 pixels in a small PNG
        from PIL import Image

        files["input_reference"] = ("bomb.png", _png(Image.new("RGB", (5000, 4000))), "image/png")
    if files.get("video", (None, None))[1] == "STILL":  # a PNG still uploaded as the video to extend
        from PIL import Image

        files["video"] = ("v.png", _png(Image.new("RGB", (64, 64), (200, 30, 30))), "image/png")
    r = getattr(httpx, method)(f"{serve_url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["message"], err
    if code == "unsupported_parameter":  # the first field not implemented is named
        assert err["param"] in ("quality", "remix_video_id", "n", "size", "style") and err["param"] in err["message"]
    if code == "invalid_unicode" and "urlencoded" not in str(kw.get("headers")):
        assert err["param"] in ("prompt", "negative_prompt"), err
    assert _newest(serve_url) == before


def _requests_counted(url, endpoint, status) -> float:
    pat = re.compile(r'^chimera_requests_total\{(?=.*endpoint="%s")(?=.*method="POST")(?=.*status="%s").*\} (\S+)$'
                     % (re.escape(endpoint), status), re.M)
    return sum(float(v) for v in pat.findall(httpx.get(f"{url}/metrics").text))


def test_invalid_utf8_body_is_a_counted_400(serve_url):
    """Bytes that are not UTF-8 text: a clear 400 ``invalid_json``, counted as a 400 (not a 500) in /metrics."""
    n400, n500 = _requests_counted(serve_url, "/v1/videos", 400), _requests_counted(serve_url, "/v1/videos", 500)
    # latin-1 (not UTF-8); and NUL-laced bytes that json.loads(bytes) would sniff as odd-length UTF-16 and fail
    # with a codec error: the body is read as UTF-8 text first, so they are valid UTF-8 but malformed JSON
    for body, why in ((b'{"prompt": "caf\xe9"}', "it is not UTF-8 text"),
                      (b'{\x00"\x00x', "Expecting property name")):
        r = httpx.post(f"{serve_url}/v1/videos", content=body, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_json", r.text
        assert "codec" not in err["message"] and why in err["message"], err
    assert _requests_counted(serve_url, "/v1/videos", 400) == n400 + 2
    assert _requests_counted(serve_url, "/v1/videos", 500) == n500


def _queue_gauge(url) -> float:
    m = re.search(r"^chimera_video_queue_length (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(m.group(1))


def test_queue_length_gauge_reads_the_store(serve_url, openai_client):
    """The gauge is the job store's count of queued + running jobs at scrape time, not the count last seen at a
    create/delete: after jobs finish (no create/delete since), a scrape reads 0."""
    ids = [openai_client.videos.create(prompt=f"burst {i}", size="64x64", extra_body=FAST).id for i in range(3)]
    deadline = time.monotonic() + 600  # a ceiling against a hang
    while time.monotonic() < deadline:  # polled through the list (the scrape hook alone must refresh the gauge)
        page = httpx.get(f"{serve_url}/v1/videos", params={"limit": 100}).json()["data"]
        if not any(v["status"] in ("queued", "in_progress") for v in page):
            break
        time.sleep(0.3)
    assert {v["id"]: v["status"] for v in page if v["id"] in ids} == {i: "completed" for i in ids}
    assert all(v["phase"] is None for v in page if v["id"] in ids)
    assert _queue_gauge(serve_url) == 0


def test_bad_input_leaves_no_traceback_in_replica_logs(serve_url, ray_cluster):
    """Ordinary 4xx come back from the video deployment as values: its calls log ``OK``, never an ERROR with a
    traceback (Ray Serve logs every exception a replica method raises)."""
    marker = f"video_marker{uuid.uuid4().hex[:12]}"
    responses = [httpx.get(f"{serve_url}/v1/videos/{marker}"),                        # JobError in the manager
                 httpx.post(f"{serve_url}/v1/videos", json={"prompt": "x", "size": marker}),         # RequestError
                 httpx.post(f"{serve_url}/v1/videos/extensions",
                            json={"prompt": "x", "seconds": "4", "video": {"id": marker}})]
    assert [r.status_code for r in responses] == [404, 400, 404]
    request_ids = {r.headers["x-request-id"] for r in responses}
    ctx = ray_cluster.get_runtime_context()  # public API: the session folder is <temp dir>/<session name>
    logs = Path(ctx.get_temp_dir()) / ctx.get_session_name() / "logs" / "serve"
    deadline = time.monotonic() + 120  # Ray writes its logs asynchronously; a ceiling against a hang
    while True:
        calls, bad = {}, []
        for f in logs.glob("replica_chimera_video_*.log"):
            for line in f.read_text(errors="ignore").splitlines():
                rid = next((i for i in request_ids if i in line), None)
                if rid is not None and " CALL " in line:
                    calls[rid] = line
                if marker in line or (rid is not None and ("ERROR" in line or "Traceback" in line)):
                    bad.append(line)
        if len(calls) == len(request_ids) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(calls) == request_ids, calls  # each request reached the video replica and was logged there
    assert all(" OK " in line for line in calls.values()), calls
    for f in logs.parent.rglob("*"):  # nor anywhere else (the job manager's worker, the ingress, the proxy)
        if f.is_file() and f.stat().st_size < 50_000_000:
            bad += [f"{f.name}: {line}" for line in f.read_text(errors="ignore").splitlines()
                    if marker in line and ("Error" in line or "ERROR" in line or "Traceback" in line)]
    assert not bad, bad[:5]


def test_bad_variant_and_extension_of_unfinished(serve_url, openai_client, t2v):
    r = httpx.get(f"{serve_url}/v1/videos/{t2v.id}/content", params={"variant": "spritesheet"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "variant"
    assert r.json()["error"]["code"] == "invalid_value"
    v = openai_client.videos.create(prompt="slow", seconds="32", size="128x128", extra_body={"num_inference_steps": 50})
    before = _newest(serve_url)
    with pytest.raises(openai.ConflictError) as e:
        _extend(openai_client, v.id, prompt="x", seconds="4")
    assert e.value.body["code"] == "video_not_ready" and e.value.body["param"] == "video"
    with pytest.raises(openai.ConflictError) as e:
        openai_client.videos.download_content(v.id)
    assert e.value.body["code"] == "video_not_ready"
    assert openai_client.videos.retrieve(v.id).model_extra["phase"] in ("queued", "denoising", "decoding")
    assert _newest(serve_url) == before
    openai_client.videos.delete(v.id)


def test_image_url_data_and_uploaded_video_extension(serve_url, openai_client, astronaut, t2v):
    r = httpx.post(f"{serve_url}/v1/videos", json={"prompt": "astronaut", "size": "64x64", "num_inference_steps": 2,
                                                    "input_reference": {"image_url": _b64_png(astronaut)}})
    assert r.status_code == 200, r.text
    assert _wait(openai_client, r.json()["id"]).status == "completed"
    _wait(openai_client, t2v.id)
    mp4 = openai_client.videos.download_content(t2v.id).content
    e = openai_client.videos.extend(video=("clip.mp4", mp4, "video/mp4"), prompt="more", seconds="4")
    e = _wait(openai_client, e.id)
    assert e.status == "completed" and e.seconds == "8", e.error  # the uploaded 4 s + 4 s
    frames, fps = _frames(openai_client, e.id)
    assert frames.shape == (16, 64, 64, 3)
    _assert_lasts(e, frames, fps)


def test_served_video_lasts_the_requested_seconds(openai_client):
    """Through the SDK (``create_and_poll``): ``seconds="5"`` at 2 fps is 10 frames, two chained clips (9 + a
    5-frame clip cut to 1 new frame), and the MP4 lasts 5 s; extending it by 3 s adds 6 frames (16 = 8 s) and
    the object reports the total. Durations are whole frames: the checks are exact, and within one frame of
    the request is what the rule promises."""
    v = openai_client.videos.create_and_poll(prompt="a kite", seconds="5", size="64x64", poll_interval_ms=200,
                                             extra_body={**FAST, "seed": 2})
    assert v.status == "completed" and v.seconds == "5" and v.model_extra["clips_total"] == 2, v.error
    frames, fps = _frames(openai_client, v.id)
    assert (len(frames), fps) == (10, 2)
    _assert_lasts(v, frames, fps)
    assert abs(len(frames) / fps - 5) <= 1 / fps
    e = _wait(openai_client, _extend(openai_client, v.id, prompt="higher", seconds="3").id)
    assert e.status == "completed" and e.seconds == "8", e.error
    joined, fps = _frames(openai_client, e.id)
    assert (len(joined), fps) == (16, 2)
    _assert_lasts(e, joined, fps)
    assert abs((len(joined) - len(frames)) / fps - 3) <= 1 / fps  # the added length is what was asked
    assert np.abs(joined[:10].astype(float) - frames.astype(float)).mean() < 6  # the source, re-encoded


def test_list_newest_first_and_metrics(serve_url, openai_client, t2v):
    page = openai_client.videos.list(limit=3)
    ids = [v.id for v in page.data]
    created = [v.created_at for v in page.data]
    assert created == sorted(created, reverse=True) and len(ids) <= 3
    if len(ids) == 3:  # cursor pagination: the page after the first item starts at the second
        nxt = openai_client.videos.list(limit=2, after=ids[0])
        assert [v.id for v in nxt.data] == ids[1:3]
        asc = openai_client.videos.list(limit=100, order="asc").data
        assert [v.created_at for v in asc] == sorted(v.created_at for v in asc)
    text = httpx.get(f"{serve_url}/metrics").text
    assert "chimera_video_queue_length" in text and "chimera_video_jobs_created_total" in text


# --- The ingress and the video deployment in-process (no Ray; httpx.ASGITransport): what reaches the job manager.
# The manager is a recording stand-in (its door, not a model): it keeps each create's planned request and answers
# a queued Video object; no job runs.

class _Remote:
    """One method of the stand-in manager, called the way a Ray actor handle's is: ``.remote(...)`` -> awaitable."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        async def call():
            return self.fn(*args, **kwargs)
        return call()


class _RecordingManager:
    """Stands in for the job-manager actor: ``created`` lists each ``create``'s (request dict, keyword arguments);
    ``extension_source`` answers ``source`` (a stored source video's record) under the asked id; ``list`` answers
    an empty page and records its (limit, after, order) in ``listed``."""

    def __init__(self):
        self.created, self.source = [], None
        self.create = _Remote(self._create)
        self.extension_source = _Remote(lambda video_id, owner=None: dict(self.source, id=video_id))
        self.queue_length = _Remote(lambda: 0)
        self.listed = []
        self.list = _Remote(self._list)

    def _list(self, limit, after, order, owner=None):
        self.listed.append((limit, after, order))
        return {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}

    def _create(self, request, **kw):
        self.created.append((request, kw))
        return {"id": f"video_{len(self.created)}", "object": "video", "status": "queued", "progress": 0,
                "created_at": 0, "model": "chimera-video"}


def _video_ingress(profile, **limits_and_engine):
    """(ASGI app of the ingress with only the video family, its recording manager, the VideoConfig)."""
    from services.api.app import build_app
    from services.deployments.backends import LocalBackend
    from services.config.profiles import parse_profile
    from services.deployments.video import Deployment

    data = profile.model_dump(mode="json")
    data["vlm"] = data["tts"] = None
    engine = data["video"]["engine"]
    engine["limits"].update(limits_and_engine.pop("limits", {}))
    engine.update(limits_and_engine)
    prof = parse_profile(data)
    dep = object.__new__(Deployment)  # its __init__ would get the Ray actor
    dep.section, dep.cfg, dep.model_dir, dep.manager = prof.video, prof.video.engine, "unused", _RecordingManager()
    return build_app(prof, {"video": LocalBackend(dep)}), dep.manager, prof.video.engine


def _source(cfg, **fields) -> dict:
    """A completed source video's record as ``extension_source`` gives it (its request planned as a create's)."""
    from video.request import plan_request

    req = plan_request(cfg, {"prompt": "a kite", **fields}).to_dict()
    return {"id": "video_src", "video": "unused.mp4", "last_frame": "unused.npy", "reference": {},
            "width": req["width"], "height": req["height"], "fps": req["fps"], "frames": req["target_frames"],
            "seconds": "4", "params": req}


def _asgi(app, fn):
    """Run ``await fn(http)`` with an httpx client on ``app`` (in-process)."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as http:
            return await fn(http)
    return asyncio.run(go())


def _png_of(n: int) -> bytes:
    """A readable 4x4 PNG of exactly ``n`` bytes: a private ancillary chunk pads it (readers skip it)."""
    from PIL import Image

    small = _png(Image.new("RGB", (4, 4), (200, 30, 30)))
    body = b"chPd" + b"\0" * (n - len(small) - 12)  # 12: the chunk's length and CRC fields and its type
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    out = small[:33] + chunk + small[33:]  # after the signature (8 bytes) and IHDR (25)
    assert len(out) == n
    return out


def _mp4_of(n: int, tmp_path) -> bytes:
    """A decodable 64x64, 9-frame, 2 fps MP4 of exactly ``n`` bytes: a trailing ``free`` box pads it."""
    from video.media import encode_mp4

    encode_mp4(np.random.default_rng(0).integers(0, 255, (9, 64, 64, 3), dtype=np.uint8), 2, tmp_path / "c.mp4")
    mp4 = (tmp_path / "c.mp4").read_bytes()
    pad = n - len(mp4)
    out = mp4 + struct.pack(">I", pad) + b"free" + b"\0" * (pad - 8)
    assert len(out) == n
    return out


def test_upload_caps_are_exact_through_the_sdk(profile, tmp_path):
    """An upload of N bytes is refused (413 ``too_large``) only when N is over its cap: the ``input_reference``
    image at exactly ``max_image_bytes`` (the cpu profile's 8 MiB) is queued and cap + 1 is refused; the same for
    an extension's uploaded video at ``max_video_bytes`` (configured to 1 MiB here). Each file streamed in used
    to be counted twice (the real cap was half the configured one: a 5 MB image was a 413). The files are sent
    as file objects, as an opened file is: httpx streams them in 64 KiB chunks, as a client's body arrives (the
    double count only showed from a file's second chunk on)."""
    video_cap = 2**20
    app, manager, cfg = _video_ingress(profile, limits={"max_video_bytes": video_cap})
    image_cap = cfg.limits.max_image_bytes
    assert image_cap == 8 * 2**20
    png, mp4 = _png_of(image_cap), _mp4_of(video_cap, tmp_path)

    async def go(http):
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=http)
        v = await client.videos.create(prompt="a red square", size="64x64",
                                       input_reference=("ref.png", io.BytesIO(png), "image/png"))
        e = await client.videos.extend(video=("clip.mp4", io.BytesIO(mp4), "video/mp4"), prompt="more", seconds="4")
        refused = []
        for call in (lambda: client.videos.create(prompt="a red square", size="64x64",
                                                  input_reference=("ref.png", io.BytesIO(png + b"\0"), "image/png")),
                     lambda: client.videos.extend(video=("clip.mp4", io.BytesIO(mp4 + b"\0"), "video/mp4"),
                                                  prompt="more", seconds="4")):
            with pytest.raises(openai.APIStatusError) as err:
                await call()
            refused.append((err.value.status_code, err.value.body["code"], err.value.body["param"]))
        return v, e, refused

    v, e, refused = _asgi(app, go)
    assert v.status == e.status == "queued"
    assert refused == [(413, "too_large", "input_reference"), (413, "too_large", "video")]
    (_, made), (_, extended) = manager.created
    from PIL import Image

    assert Image.open(io.BytesIO(made["image_png"])).size == (4, 4)
    assert len(extended["upload"]["video"]) == video_cap
    assert len(manager.created) == 2  # the refused uploads queued nothing


@pytest.mark.parametrize("source,ext,want", [
    ({"quality": "fast"}, {}, ("fast", 2, 1.0)),                         # inherited quality, its defaults
    ({"quality": "fast"}, {"quality": None}, ("fast", 2, 1.0)),          # null is left out
    ({}, {"quality": "fast"}, ("fast", 2, 1.0)),                         # another quality: its own defaults
    ({"quality": "fast"}, {"quality": "full"}, ("full", 4, 5.0)),
    ({"num_inference_steps": 3, "guidance_scale": 2.0}, {}, ("full", 3, 2.0)),  # same quality: the source's
    ({"quality": "fast", "num_inference_steps": 3}, {"quality": "full"}, ("full", 4, 5.0)),
    ({"quality": "fast"}, {"num_inference_steps": 6}, ("fast", 6, 1.0)),  # given fields win
    ({}, {"quality": "fast", "guidance_scale": 3.0}, ("fast", 2, 3.0)),
    ({"quality": "old-record"}, {}, ("full", 4, 5.0)),                   # a record from before quality: full
])
def test_extension_uses_the_defaults_of_its_own_quality(profile, source, ext, want):
    """An extension of a stored video keeps the source's ``quality`` unless it gives one, and runs with that
    quality's step count and guidance: the source's own under the source's quality, the other quality's defaults
    otherwise (cpu profile with a fast profile: full 4 steps / guidance 5.0, fast 2 / 1.0); given fields win.
    The source's steps and guidance used to be copied whatever the quality (a fast video's extension ran the
    full transformer at the LoRA's step count without guidance, and the reverse)."""
    app, manager, cfg = _video_ingress(profile, fast={"lora": "unused-lora", "num_inference_steps": 2,
                                                      "guidance_scale": 1.0})
    assert (cfg.defaults.num_inference_steps, cfg.defaults.guidance_scale) == (4, 5.0)
    old = source.get("quality") == "old-record"
    manager.source = _source(cfg, negative_prompt="blur", **{k: v for k, v in source.items() if not old})
    if old:
        del manager.source["params"]["quality"]
    r = _asgi(app, lambda http: http.post("/v1/videos/extensions", json={"prompt": "more", "seconds": "4",
                                                                           "video": {"id": "video_src"}, **ext}))
    assert r.status_code == 200, r.text
    req = manager.created[-1][0]
    assert (req["quality"], req["num_inference_steps"], req["guidance_scale"]) == want
    assert req["negative_prompt"] == "blur"  # inherited whatever the quality


STRING = [["x"], 5, 2.5, {"a": 1}, True]
NUMBER = [[1], {"a": 1}, True, False, "5"]  # in JSON a number's text is a string, not the number (forms: below)
INTEGER = NUMBER + [2.5, "2"]
BOOLEAN = [[True], 1, 0, 2.5, {"a": 1}, None, "no", "off", "yes", "0", "true"]
DATA_URL = "data:image/png;base64,iVBORw0KGgo="
REFERENCE = [[1], 5, True, False, {"image_url": [1]}, {"image_url": 5}, {"image_url": {"url": DATA_URL}},
             {"image_url": True}, {"image_url": None}, {"image_url": ""}, {}, {"file_id": "file_1", "image_url": [1]},
             {"file_id": "file_1", "image_url": DATA_URL}, {"file_id": 5}]
VIDEO_REF = [[1], 5, True, {"id": 5}, {"id": ["video_src"]}, {"id": {"id": "video_src"}}, {"id": True},
             {"id": "video_src", "file_id": "x"}]
CREATE_TYPES = {"prompt": STRING + [None], "model": STRING, "seconds": [[4], {"s": 4}, True, False], "size": STRING,
                "width": INTEGER, "height": INTEGER, "num_frames": INTEGER, "fps": INTEGER,
                "num_inference_steps": INTEGER, "guidance_scale": NUMBER, "negative_prompt": STRING, "seed": INTEGER,
                "sparsity": NUMBER, "drift_correction": BOOLEAN, "quality": STRING, "cache": STRING,
                "input_reference": REFERENCE}
EXTEND_TYPES = {"prompt": STRING + [None], "seconds": [[4], {"s": 4}, True, None], "video": VIDEO_REF + [None],
                "model": STRING, "seed": INTEGER, "num_inference_steps": INTEGER, "guidance_scale": NUMBER,
                "negative_prompt": STRING, "drift_correction": BOOLEAN, "sparsity": NUMBER, "quality": STRING,
                "cache": STRING}
CREATE_BASE = {"prompt": "a cat", "size": "64x64"}
EXTEND_BASE = {"prompt": "more", "seconds": "4", "video": {"id": "video_src"}}
# multipart: every value is text, so a wrong type is text that is not of the field's type, or a file
FORM_TYPES = {"seconds": ["long", "[4]"], "width": ["wide", "2.5", "[64]"], "height": ["true"], "num_frames": ["{}"],
              "fps": ["2.5"], "num_inference_steps": ["true"], "guidance_scale": ["loud", "[1]"], "seed": ["true"],
              "sparsity": ["[1]", "false"], "drift_correction": ["maybe", "5"],
              "input_reference": ["[1]", "5", "true", '{"image_url": [1]}', '{"file_id": "f", "image_url": [1]}']}
FORM_EXTEND_TYPES = {"seconds": ["long"], "seed": ["2.5"], "drift_correction": ["maybe"], "quality": ["5"],
                     "video": ["[1]", "5", '{"id": 5}', '{"id": "video_src", "x": 1}']}


def _cases():
    for path, types, base in (("/v1/videos", CREATE_TYPES, CREATE_BASE),
                              ("/v1/videos/extensions", EXTEND_TYPES, EXTEND_BASE)):
        for field, values in types.items():
            for value in values:
                missing = value is None and field == "video"  # {"id": ...} or a file: neither was sent
                yield pytest.param(path, {"json": {**base, field: value}}, field,
                                   "missing_required_parameter" if missing else "invalid_value",
                                   id=f"json{path[10:] or '/create'}-{field}-{json.dumps(value)}")
    form = {"/v1/videos": ({"prompt": "a cat", "size": "64x64"}, FORM_TYPES),
            "/v1/videos/extensions": ({"prompt": "more", "seconds": "4", "video[id]": "video_src"}, FORM_EXTEND_TYPES)}
    for path, (base, types) in form.items():
        for field, values in types.items():
            for value in values:
                data = {k: v for k, v in base.items() if not (field == "video" and k == "video[id]")}
                parts = {k: (None, v) for k, v in {**data, field: value}.items()}  # text parts (no filename)
                yield pytest.param(path, {"files": parts}, field, "invalid_value",
                                   id=f"form{path[10:] or '/create'}-{field}-{value}")
        if path == "/v1/videos":  # an image file and a text input_reference: which one would it be?
            parts = {**{k: (None, v) for k, v in base.items()}, "input_reference": (None, '{"image_url": "x"}')}
            yield pytest.param(path, {"files": [*parts.items(), ("input_reference", ("a.png", b"png", "image/png"))]},
                               "input_reference", "invalid_value", id="form/create-input_reference-twice")
        for field in base:  # a text field sent as a file
            parts = {k: (None, v) if k != field else ("f.txt", v.encode(), "text/plain") for k, v in base.items()}
            yield pytest.param(path, {"files": parts}, field, "unexpected_file",
                               id=f"form{path[10:] or '/create'}-{field}-as-a-file")


@pytest.fixture(scope="module")
def typed_ingress(profile):
    app, manager, cfg = _video_ingress(profile)
    manager.source = _source(cfg)
    return app, manager


@pytest.mark.parametrize("path,kw,param,code", list(_cases()))
def test_a_field_of_another_type_is_a_400_naming_it(typed_ingress, path, kw, param, code):
    """Every field of POST /v1/videos and /v1/videos/extensions (JSON and multipart) with a value of another type
    than the documented one (a list, number, object, boolean, null where null is not allowed; in JSON, a string for
    a number or a boolean; in a form, text that is not of the field's type, or a file for a text field) is a 400
    naming it, and queues nothing. An ``input_reference`` object whose ``image_url`` was a list, number or object
    used to be a 500 (AttributeError), booleans for numbers or numbers for ``drift_correction`` were read as 1/0,
    and JSON strings were converted (``"fps": "2"`` as 2, ``"drift_correction": "no"`` as false)."""
    app, manager = typed_ingress
    before = len(manager.created)

    async def go(http):
        ok = await http.post(path, json=CREATE_BASE if path == "/v1/videos" else EXTEND_BASE)
        return ok, await http.post(path, **kw)

    ok, r = _asgi(app, go)
    assert ok.status_code == 200, ok.text  # the same request without the wrong field is queued
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert err["message"] and err["type"] == "invalid_request_error"
    assert len(manager.created) == before + 1  # only the well-typed request


def test_form_text_is_converted_and_json_keeps_its_types(typed_ingress):
    """Form fields are text by nature: ``fps=2``, ``seed=5``, ``drift_correction=no``, ... are converted (multipart and
    urlencoded). The same values as JSON numbers and booleans are queued too; as JSON strings they are a 400
    ``invalid_value`` naming the field (tested above for every field), where they used to be converted."""
    app, manager = typed_ingress
    text = {"prompt": "a cat", "size": "64x64", "fps": "2", "num_inference_steps": "2", "seed": "5",
            "guidance_scale": "5", "sparsity": "0.5", "drift_correction": "no"}
    typed = {**text, "fps": 2, "num_inference_steps": 2, "seed": 5, "guidance_scale": 5, "sparsity": 0.5,
             "drift_correction": False}

    async def go(http):
        return [await http.post("/v1/videos", files={k: (None, v) for k, v in text.items()}),
                await http.post("/v1/videos", data=text), await http.post("/v1/videos", json=typed),
                await http.post("/v1/videos", json={**typed, "seed": "5"})]

    before = len(manager.created)
    *ok, refused = _asgi(app, go)
    assert [r.status_code for r in ok] == [200, 200, 200], [r.text for r in ok]
    for req, _ in manager.created[before:]:
        assert (req["fps"], req["num_inference_steps"], req["seed"], req["guidance_scale"], req["sparsity"],
                req["drift_correction"]) == (2, 2, 5, 5.0, 0.5, False)
    assert refused.status_code == 400 and len(manager.created) == before + 3
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == ("seed", "invalid_value")


def _image_bytes(fmt: str) -> bytes:
    from PIL import Image

    frames = [Image.new("RGB", (64, 64), (200, 30, 30)), Image.new("RGB", (64, 64), (30, 30, 200))]
    buf = io.BytesIO()
    if fmt == "APNG":
        frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    else:
        frames[0].save(buf, format=fmt, **({"save_all": True, "append_images": frames[1:]} if fmt == "GIF" else {}))
    return buf.getvalue()


def _video_bytes(tmp_path, fmt: str) -> bytes:
    """A 64x64, 3-frame, 2 fps H.264 video in the container ``fmt`` (PyAV's muxer name)."""
    import av

    path = tmp_path / f"clip.{fmt}"
    with av.open(str(path), mode="w", format=fmt) as out:
        stream = out.add_stream("libx264", rate=2)
        stream.width = stream.height = 64
        stream.pix_fmt = "yuv420p"
        for i in range(3):
            frame = np.full((64, 64, 3), 40 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path.read_bytes()


@pytest.mark.parametrize("name,fmt,mime,container", [
    ("v.png", "PNG", "image/png", "png_pipe"), ("v.gif", "GIF", "image/gif", "gif"),
    ("v.jpg", "JPEG", "image/jpeg", "jpeg_pipe"), ("v.webp", "WEBP", "image/webp", "webp_pipe"),
    ("v.png", "APNG", "image/png", "apng"), ("v.mp4", "PNG", "video/mp4", "png_pipe"),  # the name does not matter
])
def test_an_uploaded_image_is_not_a_video(typed_ingress, tmp_path, name, fmt, mime, container):
    """An extension's uploaded ``video`` that FFmpeg reads as a still image or an image sequence is 415
    ``unsupported_media_type`` naming what it is and what is accepted, and queues nothing. A PNG used to be
    extended as a one-frame video (200), a GIF got a 400 about an ``fps`` the client never sent. Real video
    containers (MP4, Matroska) are queued."""
    app, manager = typed_ingress
    before = len(manager.created)

    async def go(http):
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=http)
        with pytest.raises(openai.APIStatusError) as err:
            await client.videos.extend(video=(name, _image_bytes(fmt), mime), prompt="more", seconds="0.5")
        ok = [await client.videos.extend(video=(f"clip.{c}", _video_bytes(tmp_path, c), "video/mp4"),
                                         prompt="more", seconds="0.5") for c in ("mp4", "matroska")]
        return err.value, ok

    err, ok = _asgi(app, go)
    assert err.status_code == 415, err.body
    assert (err.body["code"], err.body["param"], err.body["type"]) == ("unsupported_media_type", "video",
                                                                       "invalid_request_error")
    assert container in err.body["message"] and "MP4/MOV" in err.body["message"], err.body
    assert [v.status for v in ok] == ["queued", "queued"]
    assert len(manager.created) == before + 2  # only the videos


@pytest.mark.parametrize("kw,sent", [
    ({"data": {"prompt": "more", "seconds": "4", "video[id]": "video_src"},
      "files": {"video": ("clip.mp4", "MP4", "video/mp4")}}, "video[id] and a video file"),
    ({"data": {"prompt": "more", "seconds": "4", "video": "video_src"},
      "files": {"video": ("clip.mp4", "MP4", "video/mp4")}}, "video as an id and a video file"),
    ({"data": {"prompt": "more", "seconds": "4", "video": '{"id": "video_src"}', "video[id]": "video_src"}},
     "video as an id and video[id]"),
    ({"json": {"prompt": "more", "seconds": "4", "video": {"id": "video_src"}, "video[id]": "video_other"}},
     "video as an id and video[id]"),
])
def test_an_extension_with_two_videos_is_a_400(typed_ingress, tmp_path, kw, sent):
    """An extension names its source once: ``video`` as an id (JSON ``{"id": ...}`` or text), ``video[id]`` (the
    SDK's multipart encoding) or an uploaded file. Two of them are a 400 ``invalid_value`` on ``video`` that says to
    send one, and queue nothing; the id used to win and the upload was dropped unseen."""
    app, manager = typed_ingress
    before = len(manager.created)
    if "files" in kw:
        kw = {**kw, "files": {"video": ("clip.mp4", _video_bytes(tmp_path, "mp4"), "video/mp4")}}
    r = _asgi(app, lambda http: http.post("/v1/videos/extensions", **kw))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("video", "invalid_value"), err
    assert sent in err["message"] and "send one" in err["message"], err
    assert len(manager.created) == before


@pytest.mark.parametrize("path,kw,param", [
    ("/v1/videos", {"files": [("prompt", (None, "a")), ("prompt", (None, "b")), ("size", (None, "64x64"))]},
     "prompt"),
    ("/v1/videos", {"content": b"prompt=a&prompt=b&size=64x64",
                    "headers": {"content-type": "application/x-www-form-urlencoded"}}, "prompt"),
    ("/v1/videos", {"files": [("prompt", (None, "a")), ("input_reference", ("a.png", "PNG", "image/png")),
                              ("input_reference", ("b.png", "PNG", "image/png"))]}, "input_reference"),
    ("/v1/videos/extensions", {"files": [("prompt", (None, "more")), ("seconds", (None, "4")),
                                         ("seconds", (None, "8")), ("video[id]", (None, "video_src"))]}, "seconds"),
    ("/v1/videos/extensions", {"files": [("prompt", (None, "more")), ("seconds", (None, "4")),
                                         ("video[id]", (None, "video_src")), ("video[id]", (None, "video_src"))]},
     "video[id]"),
    ("/v1/videos/extensions", {"files": [("prompt", (None, "more")), ("seconds", (None, "4")),
                                         ("video", ("a.mp4", "MP4", "video/mp4")),
                                         ("video", ("b.mp4", "MP4", "video/mp4"))]}, "video"),
])
def test_a_form_field_or_file_given_twice_is_a_400(typed_ingress, tmp_path, path, kw, param):
    """A form (multipart or urlencoded) field, or a file, given twice under one name is a 400
    ``duplicate_parameter`` naming it, and queues nothing: ``prompt=a&prompt=b`` used to be queued with ``b``,
    two ``input_reference`` images with the second."""
    from PIL import Image

    app, manager = typed_ingress
    blobs = {"PNG": _png(Image.new("RGB", (8, 8))), "MP4": _video_bytes(tmp_path, "mp4")}
    if "files" in kw:
        kw = {"files": [(k, (v[0], blobs.get(v[1], v[1]), v[2]) if v[0] else v) for k, v in kw["files"]]}
    before = len(manager.created)
    r = _asgi(app, lambda http: http.post(path, **kw))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, "duplicate_parameter", "invalid_request_error"), err
    assert param in err["message"] and err["message"]
    assert len(manager.created) == before


@pytest.mark.parametrize("method,path,param,code", [
    ("get", "/v1/videos?foo=1", "foo", "unknown_parameter"),
    ("get", "/v1/videos?limit=2&limit=3", "limit", "duplicate_parameter"),
    ("get", "/v1/videos/video_src?foo=1", "foo", "unknown_parameter"),
    ("get", "/v1/videos/video_src?limit=1", "limit", "unknown_parameter"),  # another route's parameter
    ("get", "/v1/videos/video_src/content?foo=1", "foo", "unknown_parameter"),
    ("get", "/v1/videos/video_src/content?variant=video&foo=1", "foo", "unknown_parameter"),
    ("get", "/v1/videos/video_src/content?variant=video&variant=thumbnail", "variant", "duplicate_parameter"),
    ("delete", "/v1/videos/video_src?force=1", "force", "unknown_parameter"),
    ("post", "/v1/videos?foo=1", "foo", "unknown_parameter"),
    ("post", "/v1/videos/extensions?seconds=4", "seconds", "unknown_parameter"),  # a body field, not a query one
])
def test_unknown_query_parameters_are_a_400(typed_ingress, method, path, param, code):
    """Every ``/v1/videos`` route refuses a query parameter it does not define (400 ``unknown_parameter`` naming
    it) and one given twice (400 ``duplicate_parameter``), before anything reaches the job manager (they used to
    be ignored: 200). The list's ``limit``, ``after`` and ``order`` and the content's ``variant`` stay."""
    app, manager = typed_ingress
    before = len(manager.created)
    body = {"json": EXTEND_BASE if "extensions" in path else CREATE_BASE} if method == "post" else {}

    async def go(http):
        return await http.request(method.upper(), path, **body), await http.get("/v1/videos?limit=2&order=asc")

    r, listed = _asgi(app, go)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert param in err["message"]
    assert listed.status_code == 200 and listed.json()["data"] == [], listed.text
    assert manager.listed[-1] == (2, None, "asc")  # the list's own parameters reach the manager
    assert len(manager.created) == before


def test_a_json_extension_names_a_field_it_does_not_take_before_its_type(typed_ingress):
    """``fps`` is not an extension's field (it keeps the source's): as JSON text it is still 400
    ``unsupported_parameter``, not a type error; a field the extension takes is type-checked (``seed``)."""
    app, manager = typed_ingress

    async def go(http):
        return [await http.post("/v1/videos/extensions", json={**EXTEND_BASE, **extra})
                for extra in ({"fps": "2"}, {"seed": "5"})]

    unsupported, typed = _asgi(app, go)
    assert [(r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) for r in (unsupported, typed)] == [
        (400, "fps", "unsupported_parameter"), (400, "seed", "invalid_value")]
