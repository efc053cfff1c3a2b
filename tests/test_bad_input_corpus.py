"""Issue 14: a corpus of hostile and malformed input across chat, video, speech and the speech websocket.

Every case gets its documented 4xx (``/work/shared/api.md``: 400 bad input, 404 unknown id or model, 405 wrong
method, 409 wrong state, 413 too large, 415 unsupported media) in OpenAI's error shape with a stable ``code``;
websocket cases get an ``error`` event with its ``code`` and the socket stays open. After the corpus a normal
request of each family still answers (``test_service_answers_after_the_corpus``, last in this file).
Runs against the session's real service (``serve_url``); no case reaches a model's forward pass except the
final normal requests, so the corpus costs a few seconds.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from websockets.sync.client import connect

from services.api.body import MAX_JSON_DEPTH

JSON = {"content-type": "application/json"}


def _deep(levels: int) -> bytes:
    """A JSON object whose field ``x`` nests ``levels`` arrays (``levels + 1`` levels with the object)."""
    return b'{"model": "x", "x": ' + b"[" * levels + b"]" * levels + b"}"


def _png(size=(8, 8), fmt="PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


def _img_msg(url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def _chat(**kw) -> dict:
    return {"json": {"model": "chimera-vlm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}}


def _raw(body: bytes, ctype: str = "application/json") -> dict:
    return {"content": body, "headers": {"content-type": ctype}}


PNG_URL = "data:image/png;base64," + base64.b64encode(_png()).decode()
NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"definitely not a png file").decode()
TRUNCATED_PNG = "data:image/png;base64," + base64.b64encode(_png((64, 64))[:60]).decode()

# (id, method, path, httpx kwargs, status, code)
HTTP_CASES = [
    # ---- chat ----
    ("chat-malformed-json", "post", "/v1/chat/completions", _raw(b'{"model": "chimera-vlm", "messages": ['), 400,
     "invalid_json"),
    ("chat-not-utf8", "post", "/v1/chat/completions", _raw(b'{"messages": "\xff\xfe"}'), 400, "invalid_json"),
    ("chat-array-body", "post", "/v1/chat/completions", {"json": [1, 2]}, 400, "invalid_json"),
    ("chat-empty-body", "post", "/v1/chat/completions", _raw(b""), 400, "invalid_json"),
    ("chat-form-body", "post", "/v1/chat/completions", _raw(b"model=chimera-vlm", "application/x-www-form-urlencoded"),
     400, "invalid_json"),
    ("chat-no-messages", "post", "/v1/chat/completions", {"json": {"model": "chimera-vlm"}}, 400, "invalid_value"),
    ("chat-empty-messages", "post", "/v1/chat/completions", _chat(messages=[]), 400, "empty_messages"),
    ("chat-messages-string", "post", "/v1/chat/completions", _chat(messages="hi"), 400, "invalid_value"),
    ("chat-bad-role", "post", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "invalid_role"),
    ("chat-role-list", "post", "/v1/chat/completions", _chat(messages=[{"role": [[]], "content": "hi"}]), 400,
     "invalid_role"),
    ("chat-part-type-list", "post", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]), 400, "invalid_messages"),
    ("chat-content-int", "post", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": 42}]), 400,
     "invalid_messages"),
    ("chat-unknown-field", "post", "/v1/chat/completions", _chat(frobnicate=True), 400, "unsupported_parameter"),
    ("chat-n-2", "post", "/v1/chat/completions", _chat(n=2), 400, "invalid_value"),
    ("chat-max-tokens-0", "post", "/v1/chat/completions", _chat(max_tokens=0), 400, "invalid_value"),
    ("chat-max-tokens-string", "post", "/v1/chat/completions", _chat(max_tokens="ten"), 400, "invalid_value"),
    ("chat-max-tokens-huge", "post", "/v1/chat/completions", _chat(max_tokens=10**12), 400, "invalid_value"),
    ("chat-temperature-negative", "post", "/v1/chat/completions", _chat(temperature=-1), 400, "invalid_value"),
    ("chat-temperature-string", "post", "/v1/chat/completions", _chat(temperature="hot"), 400, "invalid_value"),
    ("chat-stop-int", "post", "/v1/chat/completions", _chat(stop=7), 400, "invalid_value"),
    ("chat-stop-empty", "post", "/v1/chat/completions", _chat(stop=""), 400, "invalid_value"),
    ("chat-stop-list-empty-string", "post", "/v1/chat/completions", _chat(stop=["x", ""]), 400, "invalid_value"),
    ("chat-content-empty-list", "post", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": []}]),
     400, "invalid_messages"),
    ("chat-duplicate-key", "post", "/v1/chat/completions",
     _raw(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_tokens": 2}'), 400,
     "duplicate_parameter"),
    ("speech-duplicate-key", "post", "/v1/audio/speech", _raw(b'{"input": "a", "input": "b"}'), 400,
     "duplicate_parameter"),
    ("video-duplicate-key", "post", "/v1/videos", _raw(b'{"prompt": "a", "prompt": "b"}'), 400,
     "duplicate_parameter"),
    ("chat-deep-json", "post", "/v1/chat/completions", _raw(_deep(100_000)), 400, "invalid_json"),
    ("chat-json-too-deep", "post", "/v1/chat/completions", _raw(_deep(MAX_JSON_DEPTH)), 400, "invalid_json"),
    ("chat-response-format-bogus", "post", "/v1/chat/completions", _chat(response_format={"type": "yaml"}), 400,
     "invalid_value"),
    ("chat-unknown-model", "post", "/v1/chat/completions", _chat(model="gpt-9"), 404, "model_not_found"),
    ("chat-other-family-model", "post", "/v1/chat/completions", _chat(model="chimera-tts"), 400,
     "model_not_supported"),
    ("chat-model-int", "post", "/v1/chat/completions", _chat(model=3), 400, "invalid_value"),
    ("chat-lone-surrogate", "post", "/v1/chat/completions",
     _raw(b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 2}'), 400, "invalid_unicode"),
    ("chat-remote-image", "post", "/v1/chat/completions", _chat(messages=[_img_msg("http://127.0.0.1:9/x.png")]), 400,
     "remote_image_not_allowed"),
    ("chat-image-bad-base64", "post", "/v1/chat/completions", _chat(messages=[_img_msg("data:image/png;base64,@@@")]),
     400, "invalid_base64"),
    ("chat-image-not-an-image", "post", "/v1/chat/completions", _chat(messages=[_img_msg(NOT_AN_IMAGE)]), 415,
     "unsupported_image_type"),
    ("chat-image-truncated", "post", "/v1/chat/completions", _chat(messages=[_img_msg(TRUNCATED_PNG)]), 400,
     "invalid_image"),
    ("chat-too-many-images", "post", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}] * 5}]), 400,
     "too_many_images"),
    ("chat-huge-prompt", "post", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": "word " * 5000}]),
     400, "context_length_exceeded"),
    ("chat-get", "get", "/v1/chat/completions", {}, 405, "method_not_allowed"),
    # ---- video ----
    ("video-malformed-json", "post", "/v1/videos", _raw(b'{"prompt": '), 400, "invalid_json"),
    ("video-deep-json", "post", "/v1/videos", _raw(_deep(30_000)), 400, "invalid_json"),
    ("video-extension-deep-json", "post", "/v1/videos/extensions", _raw(_deep(30_000)), 400, "invalid_json"),
    ("video-extension-deep-form-field", "post", "/v1/videos/extensions",
     {"data": {"prompt": "x", "seconds": "4", "video": "[" * 30_000 + "]" * 30_000}}, 400, "invalid_json"),
    ("video-extension-form-field-duplicate-key", "post", "/v1/videos/extensions",
     {"data": {"prompt": "x", "seconds": "4", "video": '{"id": "a", "id": "b"}'}}, 400, "duplicate_parameter"),
    ("video-form-reference-duplicate-key", "post", "/v1/videos",
     {"data": {"prompt": "x", "input_reference": '{"image_url": "a", "image_url": "b"}'}}, 400,
     "duplicate_parameter"),
    ("video-deep-form-reference", "post", "/v1/videos",
     {"data": {"prompt": "x", "input_reference": "[" * 30_000 + "]" * 30_000}}, 400, "invalid_json"),
    ("video-no-prompt", "post", "/v1/videos", {"json": {"size": "64x64"}}, 400, "missing_required_parameter"),
    ("video-text-plain", "post", "/v1/videos", _raw(b"prompt=x", "text/plain"), 415, "unsupported_media_type"),
    ("video-xml", "post", "/v1/videos", _raw(b"<prompt>x</prompt>", "application/xml"), 415, "unsupported_media_type"),
    ("video-size-word", "post", "/v1/videos", {"json": {"prompt": "x", "size": "huge"}}, 400, "invalid_size"),
    ("video-size-too-big", "post", "/v1/videos", {"json": {"prompt": "x", "size": "4096x4096"}}, 400, "invalid_size"),
    ("video-seconds-negative", "post", "/v1/videos", {"json": {"prompt": "x", "seconds": -4}}, 400,
     "invalid_duration"),
    ("video-seconds-word", "post", "/v1/videos", {"json": {"prompt": "x", "seconds": "long"}}, 400,
     "invalid_value"),
    ("video-steps-huge", "post", "/v1/videos", {"json": {"prompt": "x", "num_inference_steps": 10**6}}, 400,
     "invalid_value"),
    ("video-unknown-field", "post", "/v1/videos", {"json": {"prompt": "x", "style": "noir"}}, 400,
     "unsupported_parameter"),
    ("video-unknown-model", "post", "/v1/videos", {"json": {"prompt": "x", "model": "sora-9"}}, 404,
     "model_not_found"),
    ("video-prompt-too-long", "post", "/v1/videos", {"json": {"prompt": "p" * 2001}}, 400, "prompt_too_long"),
    ("video-prompt-surrogate", "post", "/v1/videos", _raw(b'{"prompt": "\\udfff"}'), 400, "invalid_unicode"),
    ("video-reference-not-image", "post", "/v1/videos",
     {"data": {"prompt": "x"}, "files": {"input_reference": ("a.png", b"GIF89a-but-not", "image/png")}}, 415,
     "unsupported_image_type"),
    ("video-not-multipart", "post", "/v1/videos", _raw(b"not multipart at all", "multipart/form-data; boundary=zz"),
     400, "invalid_body"),
    ("video-multipart-no-boundary", "post", "/v1/videos", _raw(b"x", "multipart/form-data"), 400, "invalid_body"),
    ("video-multipart-nameless-part", "post", "/v1/videos",
     _raw(b"--zz\r\nContent-Disposition: form-data\r\n\r\nx\r\n--zz--\r\n", "multipart/form-data; boundary=zz"),
     400, "invalid_body"),
    # a part cut off before its closing boundary is not a field: the request has no prompt
    ("video-multipart-truncated", "post", "/v1/videos",
     _raw(b"--zz\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx", "multipart/form-data; boundary=zz"),
     400, "missing_required_parameter"),
    ("video-get-unknown", "get", "/v1/videos/video_nope", {}, 404, "video_not_found"),
    ("video-content-unknown", "get", "/v1/videos/video_nope/content", {}, 404, "video_not_found"),
    ("video-delete-unknown", "delete", "/v1/videos/video_nope", {}, 404, "video_not_found"),
    ("video-content-bad-variant", "get", "/v1/videos/video_nope/content?variant=gif", {}, 400, "invalid_value"),
    ("video-list-limit-huge", "get", "/v1/videos?limit=1000000", {}, 400, "invalid_value"),
    ("video-list-limit-negative", "get", "/v1/videos?limit=-1", {}, 400, "invalid_value"),
    ("video-extend-no-video", "post", "/v1/videos/extensions", {"json": {"prompt": "x", "seconds": "4"}}, 400,
     "missing_required_parameter"),
    ("video-extend-unknown-id", "post", "/v1/videos/extensions",
     {"json": {"prompt": "x", "seconds": "4", "video": {"id": "video_nope"}}}, 404, "video_not_found"),
    # found by tests/test_fuzz_schema.py: a non-string id reached the job store (500 ProgrammingError)
    ("video-extend-id-object", "post", "/v1/videos/extensions",
     {"json": {"prompt": "x", "seconds": "4", "video": {"id": {"nested": 1}}}}, 400, "invalid_value"),
    ("video-extend-id-number", "post", "/v1/videos/extensions",
     {"json": {"prompt": "x", "seconds": "4", "video": {"id": 7}}}, 400, "invalid_value"),
    ("video-extend-garbage-file", "post", "/v1/videos/extensions",
     {"data": {"prompt": "x", "seconds": "4"}, "files": {"video": ("v.mp4", b"\x00\x00\x00\x18ftypmp42junk",
                                                                    "video/mp4")}}, 415, "unsupported_media_type"),
    ("video-put", "put", "/v1/videos", {"json": {"prompt": "x"}}, 405, "method_not_allowed"),
    # ---- speech ----
    ("speech-malformed-json", "post", "/v1/audio/speech", _raw(b"{'input': 'single quotes'}"), 400, "invalid_json"),
    ("speech-stream-over-http", "get", "/v1/audio/speech/stream", {}, 426, "websocket_required"),
    ("speech-stream-over-http-post", "post", "/v1/audio/speech/stream", {"json": {}}, 426, "websocket_required"),
    ("speech-no-input", "post", "/v1/audio/speech", {"json": {"voice": "tara"}}, 400, "missing_required_parameter"),
    ("speech-input-null", "post", "/v1/audio/speech", {"json": {"input": None}}, 400, "missing_required_parameter"),
    ("speech-input-int", "post", "/v1/audio/speech", {"json": {"input": 5}}, 400, "invalid_type"),
    ("speech-deep-json", "post", "/v1/audio/speech", _raw(_deep(30_000)), 400, "invalid_json"),
    ("speech-json-too-deep", "post", "/v1/audio/speech", _raw(_deep(MAX_JSON_DEPTH)), 400, "invalid_json"),
    ("speech-empty-input", "post", "/v1/audio/speech", {"json": {"input": ""}}, 400, "empty_input"),
    ("speech-tags-only", "post", "/v1/audio/speech", {"json": {"input": "<whisper> <shout>"}}, 400, "empty_input"),
    ("speech-input-too-long", "post", "/v1/audio/speech", {"json": {"input": "a" * 4097}}, 400, "input_too_long"),
    ("speech-input-list", "post", "/v1/audio/speech", {"json": {"input": ["hi"]}}, 400, "invalid_type"),
    ("speech-unknown-voice", "post", "/v1/audio/speech", {"json": {"input": "hi", "voice": "darth"}}, 400,
     "unknown_voice"),
    ("speech-bad-format", "post", "/v1/audio/speech", {"json": {"input": "hi", "response_format": "aac"}}, 400,
     "unsupported_format"),
    ("speech-speed-huge", "post", "/v1/audio/speech", {"json": {"input": "hi", "speed": 100}}, 400, "invalid_speed"),
    ("speech-speed-string", "post", "/v1/audio/speech", {"json": {"input": "hi", "speed": "fast"}}, 400,
     "invalid_speed"),
    ("speech-instructions", "post", "/v1/audio/speech", {"json": {"input": "hi", "instructions": "whisper"}}, 400,
     "unsupported_parameter"),
    ("speech-stream-string", "post", "/v1/audio/speech", {"json": {"input": "hi", "stream": "yes"}}, 400,
     "invalid_type"),
    ("speech-no-stream-sse", "post", "/v1/audio/speech",
     {"json": {"input": "hi", "stream": False, "stream_format": "sse"}}, 400, "invalid_value"),
    ("speech-surrogate", "post", "/v1/audio/speech", _raw(b'{"input": "hello \\ud83d"}'), 400, "invalid_unicode"),
    ("speech-vlm-model", "post", "/v1/audio/speech", {"json": {"input": "hi", "model": "chimera-vlm"}}, 400,
     "model_not_supported"),
    ("speech-seed-string", "post", "/v1/audio/speech", {"json": {"input": "hi", "seed": "x"}}, 400, "invalid_value"),
    # ---- anywhere ----
    ("unknown-route", "get", "/v1/nothing-here", {}, 404, "route_not_found"),
    ("unknown-model-id", "get", "/v1/models/gpt-9", {}, 404, "model_not_found"),
]


@pytest.mark.parametrize("method,path,kw,status,code", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(serve_url, method, path, kw, status, code):
    r = httpx.request(method, f"{serve_url}{path}", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["code"] == code, err


def _ws_url(serve_url: str) -> str:
    return serve_url.replace("http://", "ws://") + "/v1/audio/speech/stream"


# (id, frame sent, code of the error event)
WS_CASES = [
    ("ws-malformed-json", '{"type": "input_text.append", ', "invalid_json"),
    ("ws-deep-json", '{"type": "input_text.append", "text": ' + "[" * 2000 + "]" * 2000 + "}", "invalid_json"),
    ("ws-json-too-deep", '{"type": "input_text.append", "text": ' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}",
     "invalid_json"),
    ("ws-cancel-nothing", '{"type": "response.cancel"}', "response_cancel_not_active"),
    ("ws-duplicate-key", '{"type": "input_text.append", "text": "a", "text": "b"}', "duplicate_parameter"),
    ("ws-array", "[1, 2, 3]", "invalid_event"),
    ("ws-no-type", '{"text": "hi"}', "invalid_event"),
    ("ws-type-int", '{"type": 5}', "invalid_event"),
    ("ws-unknown-type", '{"type": "input_audio.append"}', "unknown_event"),
    ("ws-binary", b"\x00\x01binary", "binary_not_supported"),
    ("ws-append-int", '{"type": "input_text.append", "text": 5}', "invalid_type"),
    ("ws-append-extra-field", '{"type": "input_text.append", "text": "hi", "voice": "tara"}', "unsupported_parameter"),
    ("ws-append-surrogate", '{"type": "input_text.append", "text": "\\udc80"}', "invalid_unicode"),
    ("ws-append-too-long", json.dumps({"type": "input_text.append", "text": "a" * 4097}), "input_too_long"),
    ("ws-session-not-object", '{"type": "session.update", "session": "tara"}', "invalid_value"),
    ("ws-session-bad-voice", '{"type": "session.update", "session": {"voice": "darth"}}', "unknown_voice"),
    ("ws-session-unknown-field", '{"type": "session.update", "session": {"language": "fr"}}',
     "unsupported_parameter"),
    ("ws-commit-nothing", '{"type": "input_text.commit"}', "empty_input"),
]


@pytest.mark.parametrize("frame,code", [c[1:] for c in WS_CASES], ids=[c[0] for c in WS_CASES])
def test_websocket_bad_input(serve_url, frame, code):
    with connect(_ws_url(serve_url), open_timeout=60) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
        ws.send(frame)
        ev = json.loads(ws.recv(timeout=60))
        assert ev["type"] == "error" and ev["error"]["code"] == code and ev["error"]["message"], ev
        ws.send('{"type": "input_text.clear"}')  # the socket stays open after a recoverable error
        ws.send('{"type": "session.update", "session": {}}')
        assert json.loads(ws.recv(timeout=60))["type"] == "session.updated"


def test_wrong_state_download_and_extend_of_an_unfinished_job(serve_url, openai_client):
    """409 while not completed: a job of 8 clips x 50 steps at 128x128 takes minutes on this profile, so it is
    still queued or running when asked for its content or extended milliseconds later."""
    v = openai_client.videos.create(prompt="slow", seconds="32", size="128x128", extra_body={"num_inference_steps": 50})
    try:
        r = httpx.get(f"{serve_url}/v1/videos/{v.id}/content", timeout=60)
        assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready", r.text
        r = httpx.post(f"{serve_url}/v1/videos/extensions", timeout=60,
                       json={"prompt": "x", "seconds": "4", "video": {"id": v.id}})
        assert r.status_code == 409, r.text
    finally:
        openai_client.videos.delete(v.id)
    r = httpx.get(f"{serve_url}/v1/videos/{v.id}", timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"


def test_corpus_size():
    """The issue asks for at least 60 cases across the three families and the websocket."""
    assert len(HTTP_CASES) + len(WS_CASES) + 1 >= 60
    fams = {c[0].split("-")[0] for c in HTTP_CASES + WS_CASES}
    assert {"chat", "video", "speech", "ws"} <= fams


def test_service_answers_after_the_corpus(serve_url, openai_client):
    """Last in the file: after every bad input above, each family answers a normal request."""
    out = openai_client.chat.completions.create(model="chimera-vlm", max_tokens=2,
                                                messages=[{"role": "user", "content": "hello"}])
    assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
    audio = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input="Hi.", response_format="wav")
    assert audio.content[:4] == b"RIFF" and len(audio.content) > 44
    r = httpx.get(f"{serve_url}/v1/videos?limit=1", timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "list"
    with connect(_ws_url(serve_url), open_timeout=60) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
        ws.send('{"type": "input_text.append", "text": "Hi."}')
        ws.send('{"type": "input_text.commit"}')
        kinds = []
        while not kinds or kinds[-1] != "response.audio.done":
            kinds.append(json.loads(ws.recv(timeout=120))["type"])
        assert "response.audio.delta" in kinds
