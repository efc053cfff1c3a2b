"""Speech endpoints end to end against the real Ray Serve app of the cpu profile (``openai`` SDK and
``websockets`` clients), plus the loop guard through the router with the scripted looping model."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from websockets.sync.client import connect

TEXT = "Hello there, nice to meet you. How are you today?"


def _read(data: bytes, fmt: str):
    if fmt == "pcm":
        return sf.read(io.BytesIO(data), format="RAW", subtype="PCM_16", samplerate=24000, channels=1)
    return sf.read(io.BytesIO(data))


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
def test_sdk_speech_formats(openai_client, fmt):
    resp = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input="Hello there.",
                                             response_format=fmt, extra_body={"seed": 1})
    data, sr = _read(resp.content, fmt)
    assert sr == 24000 and data.ndim == 1
    frames = 4  # cpu profile: min_frames for a short sentence, 2048 samples each
    if fmt in ("wav", "pcm", "flac"):
        assert len(data) == frames * 2048
        assert np.abs(data).max() > 0
    else:
        assert abs(len(data) - frames * 2048) < 2048  # lossy codecs pad
    if fmt == "wav":
        assert resp.content[4:8] == b"\xff\xff\xff\xff" and resp.content[40:44] == b"\xff\xff\xff\xff"


def test_not_streamed_wav_has_exact_sizes(openai_client, serve_url):
    import wave

    resp = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input="Hello there.",
                                             response_format="wav", extra_body={"seed": 1, "stream": False})
    assert resp.response.headers["content-length"] == str(len(resp.content)) == str(44 + 4 * 2048 * 2)
    with wave.open(io.BytesIO(resp.content)) as w:  # a streamed header would read as 2147483647 frames
        assert (w.getnframes(), w.getframerate(), w.getnchannels(), w.getsampwidth()) == (4 * 2048, 24000, 1, 2)
        frames = w.readframes(w.getnframes())
    streamed = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input="Hello there.",
                                                 response_format="pcm", extra_body={"seed": 1})
    assert frames == streamed.content  # same audio as the streamed response
    for extra, code in [({"stream": "no"}, "invalid_type"), ({"stream": False, "stream_format": "sse"}, "invalid_value")]:
        r = httpx.post(f"{serve_url}/v1/audio/speech", json={"input": "Hi.", "response_format": "wav"} | extra,
                       timeout=30)
        assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == ("stream", code)


@pytest.mark.parametrize("text", ["<foo>", "<foo> </b>. <break time=\"1s\"/>", ".", "...?"])
def test_tag_only_input_is_empty_input(serve_url, openai_client, text):
    for fmt in ("wav", "pcm", "flac", "mp3", "opus"):
        for stream_format in ("audio", "sse"):
            r = httpx.post(f"{serve_url}/v1/audio/speech", timeout=30,
                           json={"input": text, "response_format": fmt, "stream_format": stream_format})
            assert r.status_code == 400, (fmt, stream_format, r.content[:60])
            assert r.json()["error"] == {"message": "'input' has nothing to speak: no word is left once punctuation "
                                                    "and unsupported tags are removed",
                                         "type": "invalid_request_error", "param": "input", "code": "empty_input"}
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.audio.speech.create(model="chimera-tts", voice="tara", input=text)
    assert err.value.body["code"] == "empty_input"


def test_sdk_streaming_response_bytes_before_end(openai_client, ray_cluster):
    from ray import serve

    handle = serve.get_deployment_handle("tts", app_name="chimera")
    text = " ".join(["This sentence is number %d." % i for i in range(6)])
    chunks, total, active_at_first = 0, 0, None
    with openai_client.audio.speech.with_streaming_response.create(
            model="chimera-tts", voice="leo", input=text, response_format="pcm") as resp:
        assert resp.headers["content-type"].startswith("audio/pcm")
        for chunk in resp.iter_bytes():
            if active_at_first is None:  # by state, not by time: the synthesis still runs when audio arrives
                active_at_first = handle.active.remote().result()
            chunks += 1
            total += len(chunk)
    assert active_at_first == 1  # the first bytes came while generation was still going
    assert chunks > 2 and total % 2048 == 0


LONG_TEXT = " ".join(f"Sentence number {i} is here." for i in range(20))  # 20 sentences of about 7 frames each


def _ray_session_dir() -> Path:
    """This Ray session's folder (its ``logs`` inside), from Ray's public runtime context: the node's temp
    directory joined with the session name (Ray's layout, ``/tmp/ray/session_<...>`` by default)."""
    import ray

    ctx = ray.get_runtime_context()
    return Path(ctx.get_temp_dir()) / ctx.get_session_name()


def _frames(handle) -> int:
    """Audio frames the tts deployment has generated so far (its ``stats()["frames"]``: work done)."""
    return handle.stats.remote().result()["frames"]


@pytest.fixture(scope="module")
def long_text_frames(serve_url, ray_cluster) -> int:
    """Frames of an uncancelled synthesis of LONG_TEXT (seed 5): what a cancel that does not reach the synthesis
    lets it make. The deployment's frame counter grows by exactly the usage's frames."""
    from ray import serve

    handle = serve.get_deployment_handle("tts", app_name="chimera")
    assert _wait_idle(handle)
    before = _frames(handle)
    r = httpx.post(f"{serve_url}/v1/audio/speech", timeout=600, json={
        "input": LONG_TEXT, "voice": "tara", "response_format": "pcm", "stream_format": "sse", "seed": 5})
    usage = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")][-1]["usage"]
    assert _wait_idle(handle)
    assert usage["frames"] == _frames(handle) - before >= 20 * 4, usage
    return usage["frames"]


def _wait_idle(handle, limit: float = 600.0) -> bool:
    """True once the tts deployment runs no synthesis (polled every 50 ms); False after ``limit`` seconds on a
    monotonic clock (a ceiling that turns a hang into a failure, not a speed requirement)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if handle.active.remote().result() == 0:
            return True
        time.sleep(0.05)
    return False


def test_http_stream_closed_early_stops_generation(serve_url, ray_cluster, long_text_frames):
    """Closing the response mid-utterance stops the synthesis: by work done, not time. Once the deployment is
    idle it has made fewer frames for this request than the uncancelled synthesis of the same text does (half at
    most; if the cancel did not reach the synthesis, idle comes only after all of them)."""
    from ray import serve

    handle = serve.get_deployment_handle("tts", app_name="chimera")
    body = {"model": "chimera-tts", "voice": "tara", "response_format": "wav", "input": LONG_TEXT, "seed": 5}
    assert _wait_idle(handle)  # nothing of an earlier test still counts
    before = _frames(handle)
    with httpx.stream("POST", f"{serve_url}/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_raw())
        assert handle.active.remote().result() == 1, "expected exactly this synthesis running"
    assert _wait_idle(handle), "generation still running after the client went away"  # closed mid-utterance
    made = _frames(handle) - before
    assert 0 < made <= long_text_frames // 2, (made, long_text_frames)


def test_sse_stream(serve_url):
    body = {"model": "chimera-tts", "input": "Hi there. <chuckle> Bye <b>now</b>!", "voice": "mia",
            "response_format": "wav", "stream_format": "sse"}
    events = []
    with httpx.stream("POST", f"{serve_url}/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["type"] for e in events[:2]] == ["speech.audio.delta"] * 2
    assert events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["sentences"] == 2 and usage["stripped_tags"] == ["<b>", "</b>"]
    wav = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    data, sr = sf.read(io.BytesIO(wav))
    assert sr == 24000 and len(data) == round(usage["audio_seconds"] * 24000)


@pytest.mark.parametrize("kwargs,param,code", [
    (dict(input=""), "input", "empty_input"),
    (dict(input="   "), "input", "empty_input"),
    (dict(input="x" * 4097), "input", "input_too_long"),
    (dict(voice="alloy"), "voice", "unknown_voice"),
    (dict(response_format="ogg"), "response_format", "unsupported_format"),
    (dict(response_format="aac"), "response_format", "unsupported_format"),  # OpenAI's, not implemented here
    (dict(stream_format="ws"), "stream_format", "unsupported_format"),
    (dict(speed=4.5), "speed", "invalid_speed"),
    (dict(speed=0.1), "speed", "invalid_speed"),
])
def test_sdk_bad_input(openai_client, kwargs, param, code):
    args = dict(model="chimera-tts", voice="tara", input="Hello.", response_format="wav") | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.audio.speech.create(**args)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["code"] == code


def test_bad_body_and_model(serve_url):
    r = httpx.post(f"{serve_url}/v1/audio/speech", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{serve_url}/v1/audio/speech", json=["Hello."], timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    for extra, param, code in [({"input": 123}, "input", "invalid_type"), ({"speed": "fast"}, "speed", "invalid_speed"),
                               ({"seed": "x"}, "seed", "invalid_value"), ({"voice": 7}, "voice", "unknown_voice"),
                               ({"seed": 2**70}, "seed", "invalid_value"), ({"seed": 2**63}, "seed", "invalid_value"),
                               ({"seed": -2**63}, "seed", "invalid_value"), ({"seed": True}, "seed", "invalid_value")]:
        r = httpx.post(f"{serve_url}/v1/audio/speech", json={"input": "Hi.", "voice": "tara"} | extra, timeout=30)
        assert r.status_code == 400, extra
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
        if "seed" in extra:
            assert r.json()["error"]["message"] in ("'seed' must be an integer",
                                                    "'seed' must be between -(2**63 - 1) and 2**63 - 1")
    r = httpx.post(f"{serve_url}/v1/audio/speech", timeout=60,
                   json={"input": "Hi.", "voice": "tara", "response_format": "pcm", "seed": 2**63 - 1})
    assert r.status_code == 200 and len(r.content) == 4 * 2048 * 2  # the largest seed is fine
    r = httpx.post(f"{serve_url}/v1/audio/speech", json={"input": "Hi.", "voice": "tara", "model": "nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("title,frames", [("Chapter One", 4), ("The Last Lighthouse", 5)])
def test_short_title_with_seed_9_has_audio(openai_client, title, frames):
    """Issue 10, defect 5: seed 9 gave a 200 with a 44-byte WAV (0 frames) for any short title. Frames: the cpu
    profile's max_frames_for (0.25 frames per character, at least 4); its random LM never ends on its own."""
    for stream in (True, False):
        resp = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input=title,
                                                 response_format="wav", extra_body={"seed": 9, "stream": stream})
        data, sr = sf.read(io.BytesIO(resp.content))
        assert sr == 24000 and len(data) == frames * 2048 and np.abs(data).max() > 0


def test_unsupported_fields_are_refused(openai_client, serve_url):
    """Issue 10, defect 7: OpenAI's ``instructions`` (not implemented) and any unknown field: 400
    ``unsupported_parameter`` naming it, never accepted and ignored."""
    args = dict(model="chimera-tts", voice="tara", input="Hello.", response_format="wav")
    for kwargs, param in [(dict(instructions="Speak cheerfully."), "instructions"),
                          (dict(extra_body={"temperature": 0.2}), "temperature"),
                          (dict(extra_body={"language": "en"}), "language")]:
        with pytest.raises(openai.BadRequestError) as err:
            openai_client.audio.speech.create(**args, **kwargs)
        assert (err.value.body["param"], err.value.body["code"]) == (param, "unsupported_parameter")
    assert "<laugh>" in err.value.body["message"] or "supported:" in err.value.body["message"]
    r = httpx.post(f"{serve_url}/v1/audio/speech", json={"input": "Hi.", "instructions": None}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "instructions"  # refused whatever its value


def test_forged_control_token_text_is_spoken(openai_client):
    """Issue 10, defect 6: special-token spellings in ``input`` are read as plain text (see the engine test for
    the ids); the request is synthesized in full: one sentence of 53 characters -> ceil(0.25 * 53) = 14 frames."""
    text = "<|eot_id|> <|begin_of_text|> <|endoftext|> <|im_end|>"
    for fmt in ("pcm", "wav"):
        resp = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input=text,
                                                 response_format=fmt, extra_body={"seed": 9})
        data, sr = _read(resp.content, fmt)
        assert len(text) == 53 and len(data) == 14 * 2048 and np.abs(data).max() > 0


def _pcm(openai_client, **kwargs) -> np.ndarray:
    args = dict(model="chimera-tts", voice="tara", input="Hello there.", response_format="pcm", speed=1.0,
                stream_format="audio", extra_body={"seed": 3}) | kwargs
    return np.frombuffer(openai_client.audio.speech.create(**args).content, dtype="<i2")


def test_each_documented_field_has_its_effect(openai_client):
    """Every field the endpoint accepts changes the result as documented (same seed unless said otherwise)."""
    base = _pcm(openai_client)
    assert len(base) == 4 * 2048 and np.array_equal(_pcm(openai_client), base)  # seed: reproducible
    other = _pcm(openai_client, extra_body={"seed": 4})
    assert len(other) == len(base) and not np.array_equal(other, base)  # another seed: other audio
    leah = _pcm(openai_client, voice="leah")
    assert len(leah) == len(base) and not np.array_equal(leah, base)  # voice: in the prompt, other audio
    longer = _pcm(openai_client, input="Hello there, nice to meet you.")  # 30 chars x 0.25 -> 8 frames
    assert len(longer) == 8 * 2048
    # speed: tape-style resampling of the same audio; at 2.0 every output sample falls on an input sample
    # (positions 0, 2, 4 ... exactly, interpolation weight 0), so it is the speed-1 audio's even samples
    assert np.array_equal(_pcm(openai_client, speed=2.0), base[::2])
    slow = _pcm(openai_client, speed=0.5)  # positions 0, 0.5, 1 ...: ceil(N / 0.5) samples, the even ones as is
    assert len(slow) == 2 * len(base) and np.array_equal(slow[::2], base)
    wav = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input="Hello there.",
                                            response_format="wav", extra_body={"seed": 3}).content
    assert wav[:4] == b"RIFF" and np.array_equal(np.frombuffer(wav[44:], dtype="<i2"), base)  # response_format
    sse = openai_client.audio.speech.create(model="chimera-tts", voice="tara", input="Hello there.",
                                            response_format="pcm", stream_format="sse", extra_body={"seed": 3})
    events = [json.loads(x[6:]) for x in sse.content.decode().splitlines() if x.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"  # stream_format: SSE events carrying the same audio
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == base.tobytes()


def test_invalid_unicode_is_400_and_ws_error_without_traceback(serve_url, ray_cluster):
    """Issue 10, defect 4: a lone UTF-16 surrogate (JSON ``"\\ud800"``) in any text is 400 ``invalid_unicode``
    over HTTP and an ``error`` event on the websocket, which stays open; no log of the cluster gets a traceback."""
    logs = _ray_session_dir() / "logs"

    def count(word: str, pattern: str = "*") -> int:
        return sum(f.read_text(errors="ignore").count(word) for f in logs.rglob(pattern)
                   if f.is_file() and f.stat().st_size < 50_000_000)

    tracebacks, calls = count("Traceback"), count("CALL speak OK", "replica_chimera_tts_*.log")
    for body in (b'{"input": "Hi \\ud800 there.", "voice": "tara"}',
                 b'{"input": "\\udc00", "response_format": "wav"}'):
        r = httpx.post(f"{serve_url}/v1/audio/speech", content=body, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.content
        assert r.json()["error"]["param"] == "input"
    with connect(_ws_url(serve_url)) as ws:
        ws.recv(timeout=30)
        for frame, param in [('{"type": "input_text.append", "text": "Hi \\ud800."}', "text"),
                             ('{"type": "session.update", "session": {"voice": "\\ud800"}}', "session.voice"),
                             ('{"type": "session.update", "session": {"seed": 1, "\\ud800": 1}}', "session"),
                             ('{"type": "input_text.commit", "x": ["\\udfff"]}', "x[0]")]:
            ws.send(frame)
            m = json.loads(ws.recv(timeout=30))
            assert m["type"] == "error" and (m["error"]["code"], m["error"]["param"]) == ("invalid_unicode", param)
        _send(ws, type="input_text.append", text="Hi.")
        _send(ws, type="input_text.commit")
        pcm, done = _utterance(ws)  # still open; nothing of the bad events was applied (seed, text)
        assert done["status"] == "completed" and len(pcm) == 4 * 2048 * 2 and done["usage"]["sentences"] == 1
    deadline = time.monotonic() + 120  # a ceiling against a hang
    while count("CALL speak OK", "replica_chimera_tts_*.log") <= calls and time.monotonic() < deadline:
        time.sleep(0.2)  # Ray writes its logs asynchronously; the good utterance's line comes after the bad ones
    assert count("CALL speak OK", "replica_chimera_tts_*.log") > calls
    assert count("Traceback") == tracebacks


# --- websocket ------------------------------------------------------------------------------------------------
def _ws_url(serve_url: str, query: str = "") -> str:
    return serve_url.replace("http://", "ws://") + "/v1/audio/speech/stream" + query


def _send(ws, **event):
    ws.send(json.dumps(event))


def _utterance(ws, rid_seen: list | None = None) -> tuple[bytes, dict]:
    """Collect deltas until response.audio.done; return (pcm, done event)."""
    pcm = bytearray()
    while True:
        m = json.loads(ws.recv(timeout=120))
        if m["type"] == "response.audio.delta":
            pcm += base64.b64decode(m["delta"])
            if rid_seen is not None:
                rid_seen.append(m["response_id"])
        elif m["type"] == "response.audio.done":
            return bytes(pcm), m
        elif m["type"] == "error":
            raise AssertionError(m)


def test_ws_pieces_speak_like_one_piece_and_two_commits(serve_url):
    text = "Well <chuckle> that was funny. Tell me more"
    pieces = ["We", "ll <chu", "ckle> tha", "t was fun", "ny. Tell m", "e more"]
    with connect(_ws_url(serve_url)) as ws:
        created = json.loads(ws.recv(timeout=30))
        assert created["type"] == "session.created" and created["session"]["voice"] == "tara"
        _send(ws, type="session.update", session={"voice": "zoe", "seed": 11})
        assert json.loads(ws.recv(timeout=30))["session"]["voice"] == "zoe"
        _send(ws, type="input_text.append", text=text)
        _send(ws, type="input_text.commit")
        one, done1 = _utterance(ws)
        for p in pieces:
            _send(ws, type="input_text.append", text=p)
        _send(ws, type="input_text.commit")
        split, done2 = _utterance(ws)
    assert done1["status"] == done2["status"] == "completed"
    assert done1["response_id"] != done2["response_id"]
    assert done1["usage"]["sentences"] == done2["usage"]["sentences"] == 2
    assert len(one) > 0 and len(one) == len(split)
    assert one == split
    assert done1["usage"]["audio_seconds"] == pytest.approx(len(one) / 2 / 24000, abs=1e-3)


def test_ws_cancel_stops_deltas_and_socket_stays(serve_url, ray_cluster, long_text_frames):
    """``response.cancel`` mid-utterance: a ``cancelled`` done, no delta of it after that, the synthesis stopped
    (by work done: once idle, half the frames of the uncancelled synthesis at most), and the socket speaks again."""
    from ray import serve

    handle = serve.get_deployment_handle("tts", app_name="chimera")
    with connect(_ws_url(serve_url)) as ws:
        ws.recv(timeout=30)
        _send(ws, type="session.update", session={"seed": 5})
        assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
        assert _wait_idle(handle)  # nothing of an earlier test still counts
        before = _frames(handle)
        _send(ws, type="input_text.append", text=LONG_TEXT)
        _send(ws, type="input_text.commit")
        first = json.loads(ws.recv(timeout=60))
        assert first["type"] == "response.audio.delta"
        rid = first["response_id"]
        _send(ws, type="response.cancel")
        while True:  # deltas already in flight may arrive before the acknowledgement
            m = json.loads(ws.recv(timeout=30))
            if m["type"] == "response.audio.done":
                break
            assert m["type"] == "response.audio.delta"
        assert m["status"] == "cancelled" and m["response_id"] == rid
        assert _wait_idle(handle), "generation still running after the cancel"
        made = _frames(handle) - before
        assert 0 < made <= long_text_frames // 2, (made, long_text_frames)
        _send(ws, type="input_text.append", text="Short one.")
        _send(ws, type="input_text.commit")
        seen: list = []
        pcm, done = _utterance(ws, seen)  # no delta of the cancelled response comes after its done
        assert rid not in seen and done["status"] == "completed" and len(pcm) > 0


def test_ws_fields_checked_and_each_has_its_effect(serve_url, openai_client):
    """Issue 10, defect 7 on the websocket: an unknown event or session field is an ``unsupported_parameter``
    error naming it (nothing applied); voice, speed, seed and model each have their effect, the audio of an
    utterance equals the HTTP endpoint's for the same text, voice and seed."""
    base = _pcm(openai_client)
    with connect(_ws_url(serve_url)) as ws:
        created = json.loads(ws.recv(timeout=30))
        for event, param in [({"type": "session.update", "session": {"seed": 3, "instructions": "calm"}},
                               "session.instructions"),
                              ({"type": "session.update", "session": {"response_format": "wav"}},
                               "session.response_format"),
                              ({"type": "input_text.append", "text": "Lost.", "event_id": "e1"}, "event_id"),
                              ({"type": "input_text.commit", "response": {}}, "response"),
                              ({"type": "response.cancel", "id": "x"}, "id")]:
            _send(ws, **event)
            m = json.loads(ws.recv(timeout=30))
            assert m["type"] == "error" and (m["error"]["code"], m["error"]["param"]) == ("unsupported_parameter",
                                                                                          param), m
        _send(ws, type="session.update", session={})
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.updated", "session": created["session"]}

        def utterance(**session) -> np.ndarray:
            _send(ws, type="session.update", session=session)
            assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
            _send(ws, type="input_text.append", text="Hello there.")
            _send(ws, type="input_text.commit")
            pcm, done = _utterance(ws)
            assert done["status"] == "completed" and done["usage"]["sentences"] == 1  # "Lost." was never added
            return np.frombuffer(pcm, dtype="<i2")

        assert np.array_equal(utterance(seed=3, model="chimera-tts"), base)  # seed (and model) as over HTTP
        assert np.array_equal(utterance(speed=2.0), base[::2])  # speed: see test_each_documented_field_...
        leah = utterance(speed=1.0, voice="leah")
        assert np.array_equal(leah, _pcm(openai_client, voice="leah")) and not np.array_equal(leah, base)


def _gauge(serve_url: str) -> float:
    text = httpx.get(f"{serve_url}/metrics", timeout=30).text
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("chimera_tts_websocket_sessions_active{")]
    return sum(vals)


def test_ws_disconnect_frees_session_and_stops_generation(serve_url, ray_cluster, long_text_frames):
    """A socket closed mid-utterance frees its session (the gauge returns to 0) and stops the synthesis (by work
    done: once idle, half the frames of the uncancelled synthesis at most); the api_key query parameter is in no
    log of the cluster."""
    from ray import serve

    handle = serve.get_deployment_handle("tts", app_name="chimera")
    secret = "sk-never-in-logs-93f1c2"
    with connect(_ws_url(serve_url, f"?api_key={secret}")) as ws:
        ws.recv(timeout=30)
        assert _gauge(serve_url) >= 1
        _send(ws, type="session.update", session={"seed": 5})
        assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
        assert _wait_idle(handle)  # nothing of an earlier test still counts
        before = _frames(handle)
        _send(ws, type="input_text.append", text=LONG_TEXT)
        _send(ws, type="input_text.commit")
        assert json.loads(ws.recv(timeout=60))["type"] == "response.audio.delta"
        assert handle.active.remote().result() == 1, "expected exactly this synthesis running"
        ws.close()  # mid-utterance
    assert _wait_idle(handle), "generation still running after the socket closed"
    made = _frames(handle) - before
    assert 0 < made <= long_text_frames // 2, (made, long_text_frames)
    deadline = time.monotonic() + 120  # a ceiling against a hang
    while _gauge(serve_url) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gauge(serve_url) == 0
    session_dir = _ray_session_dir()
    route_logged = False
    for f in session_dir.rglob("*"):
        if f.is_file() and f.stat().st_size < 50_000_000 and f.suffix in (".log", ".out", ".err", ".txt", ""):
            text = f.read_text(errors="ignore")
            assert secret not in text, f  # the api_key query parameter is never logged
            route_logged |= "/v1/audio/speech/stream" in text
    assert route_logged  # the access logs were among the files searched


def test_ws_bad_input_keeps_socket_open(serve_url):
    with connect(_ws_url(serve_url)) as ws:
        created = json.loads(ws.recv(timeout=30))
        cases = [("{not json", "invalid_json"), (json.dumps([1, 2]), "invalid_event"),
                 (json.dumps({"type": "bogus.event"}), "unknown_event"), (b"\x00\x01binary", "binary_not_supported"),
                 (json.dumps({"type": "session.update", "session": {"voice": "alloy"}}), "unknown_voice"),
                 (json.dumps({"type": "session.update", "session": {"speed": 9}}), "invalid_speed"),
                 (json.dumps({"type": "session.update", "session": 5}), "invalid_value"),
                 (json.dumps({"type": "session.update", "session": {"seed": "x"}}), "invalid_value"),
                 (json.dumps({"type": "session.update", "session": {"model": "nope"}}), "model_not_found"),
                 (json.dumps({"type": "input_text.append", "text": 5}), "invalid_type"),
                 (json.dumps({"type": "input_text.append", "text": "x" * 4097}), "input_too_long"),
                 (json.dumps({"type": "input_text.commit"}), "empty_input"),
                 (json.dumps({"type": "session.update", "session": {"seed": 2**70}}), "invalid_value"),
                 (json.dumps({"type": "session.update", "session": {"seed": True}}), "invalid_value")]
        for msg, code in cases:
            ws.send(msg)
            m = json.loads(ws.recv(timeout=30))
            assert m["type"] == "error" and m["error"]["code"] == code, (msg, m)
        _send(ws, type="session.update", session={})
        assert json.loads(ws.recv(timeout=30))["session"]["seed"] == created["session"]["seed"]  # unchanged
        # only unsupported tags: an error, no response.audio.done, also when a tag-only sentence was already queued
        for pieces in (["<foo>"], ["<foo> </b>. ", "<break time=\"1s\"/>"]):
            for p in pieces:
                _send(ws, type="input_text.append", text=p)
            _send(ws, type="input_text.commit")
            m = json.loads(ws.recv(timeout=30))
            assert m["type"] == "error" and (m["error"]["code"], m["error"]["param"]) == ("empty_input", "text"), m
        _send(ws, type="session.update", session={"seed": 2})
        assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
        _send(ws, type="input_text.append", text="Still <laugh> here.")
        _send(ws, type="input_text.clear")
        _send(ws, type="input_text.append", text="Still here.")
        _send(ws, type="input_text.commit")
        pcm, done = _utterance(ws)  # the first done is this utterance's (the tag-only ones sent none)
        assert done["status"] == "completed" and done["usage"]["sentences"] == 1 and len(pcm) == 4 * 2048 * 2
        assert done["usage"]["stripped_tags"] == []  # nothing of the dropped tag-only utterance


def test_input_errors_are_answers_not_replica_failures(serve_url, ray_cluster):
    """A bad request that reaches the replica comes back as an error event; the replica logs no traceback."""
    from ray import serve

    log_dir = _ray_session_dir() / "logs" / "serve"

    def replica_log() -> str:
        return "".join(f.read_text(errors="ignore") for f in sorted(log_dir.glob("replica_chimera_tts_*.log")))

    before = replica_log().count("CALL speak OK")
    handle = serve.get_deployment_handle("tts", app_name="chimera").options(stream=True)
    cases = [((["Hi."], None, 1.0, 2**70, 0), "seed", "invalid_value"),
             ((["Hi."], "alloy", 1.0, None, 0), "voice", "unknown_voice"),
             ((["Hi."], None, 9.0, None, 0), "speed", "invalid_speed")]
    for args, param, code in cases:
        events = list(handle.speak.remote(*args))
        assert len(events) == 1 and events[0]["type"] == "error", events
        assert (events[0]["status"], events[0]["param"], events[0]["code"]) == (400, param, code)
    deadline = time.monotonic() + 120  # a ceiling against a hang
    while replica_log().count("CALL speak OK") < before + 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # Ray writes its access lines asynchronously
    text = replica_log()
    assert text.count("CALL speak OK") >= before + 3
    assert "Request failed" not in text and "Traceback" not in text and "CALL speak ERROR" not in text


def test_speech_metrics_recorded(serve_url, openai_client):
    openai_client.audio.speech.create(model="chimera-tts", voice="dan", input="Metrics please.", response_format="pcm")
    text = httpx.get(f"{serve_url}/metrics", timeout=30).text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("chimera_tts_time_to_first_audio_seconds_count",
                                  "chimera_tts_real_time_factor_count"))}
    assert counts["chimera_tts_time_to_first_audio_seconds_count"] >= 1
    assert counts["chimera_tts_real_time_factor_count"] >= 1


# --- loop guard through the router (scripted looping model; no Ray) -------------------------------------------
@pytest.fixture(scope="module")
def looping_app(profile, model_dir):
    """The speech router over a Deployment whose LM is the scripted LoopingLM (no Ray): ``(app, deployment)``."""
    import torch

    from services.api.app import build_app
    from services.deployments.backends import LocalBackend
    from services.deployments.speech import Deployment
    from tests.test_audio_engine import LoopingLM
    from audio.engine import TTSEngine
    from audio.local_client import TransformersSpeechClient

    before = torch.get_num_threads()
    section = profile.tts.model_dump(mode="json")
    section["engine"]["backend"] = "transformers"  # the scripted LM replaces the LM: no vLLM server to start
    dep = Deployment(section, str(model_dir))  # sets 1 torch thread, as in Ray
    e = dep.engine
    cfg = e.cfg.model_copy(update={"min_frames": 40, "max_frames": 40})
    lm = LoopingLM(e.layout, e.tokenizer, e.client.model.config.vocab_size)
    dep.engine = TTSEngine(cfg, TransformersSpeechClient(lm, e.layout), e.tokenizer, e.snac)
    yield build_app(profile.model_copy(update={"vlm": None, "video": None}), {"tts": LocalBackend(dep)}), dep
    torch.set_num_threads(before)


def test_loop_guard_reported_in_usage(looping_app):
    from starlette.testclient import TestClient

    app, dep = looping_app
    with TestClient(app) as client:
        r = client.post("/v1/audio/speech", json={"input": "One is fine. Now loop forever. Three is fine.",
                                                  "voice": "tara", "response_format": "pcm", "stream_format": "sse"})
    assert r.status_code == 200
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    usage = events[-1]["usage"]
    assert usage["loops"] == [{"sentence": 1, "retries": 1, "cut_short": True}]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) == 2 * 6 * 2048 * 2  # sentences 0 and 2 in full (6 frames each); the loop dropped
    assert dep.running == 0


def test_no_audio_is_a_clear_error_never_an_empty_200(looping_app):
    """Issue 10, defect 5: when nothing at all is left to play (every sentence a loop cut back to nothing),
    every response shape answers 500 ``no_audio`` before any byte (the status line is not sent until the first
    event), and the websocket sends an ``error`` event, a ``failed`` done, and stays open."""
    from starlette.testclient import TestClient

    app, dep = looping_app
    with TestClient(app) as client:
        for extra in ({"response_format": "wav"}, {"response_format": "pcm", "stream_format": "sse"},
                      {"response_format": "wav", "stream": False}, {"response_format": "mp3"}):
            r = client.post("/v1/audio/speech", json={"input": "Loop forever. Loop again", "seed": 9} | extra)
            assert r.status_code == 500, (extra, r.status_code, r.content[:60])
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("no_audio", "server_error") and "no audio" in err["message"]
        with client.websocket_connect("/v1/audio/speech/stream") as ws:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_json({"type": "input_text.append", "text": "Loop forever."})
            ws.send_json({"type": "input_text.commit"})
            m = ws.receive_json()
            assert m["type"] == "error" and m["error"]["code"] == "no_audio", m
            done = ws.receive_json()
            assert done["type"] == "response.audio.done" and done["status"] == "failed"
            assert done["usage"]["audio_seconds"] == 0.0
            ws.send_json({"type": "input_text.append", "text": "Fine now."})
            ws.send_json({"type": "input_text.commit"})
            pcm = bytearray()
            while (m := ws.receive_json())["type"] == "response.audio.delta":
                pcm += base64.b64decode(m["delta"])
            assert m["type"] == "response.audio.done" and m["status"] == "completed" and len(pcm) == 6 * 2048 * 2
    assert dep.running == 0


def test_eight_ws_sessions_cancelling_four_frees_their_slots(serve_url, ray_cluster):
    """8 websocket sessions speak at once, each its own synthesis in the tts deployment (``active`` counts the
    syntheses running). 4 of them ask for 40 sentences and are cancelled mid-utterance; the other 4 ask for 3 and
    complete, with the same audio (same text and seed: concurrency changes nothing). The cancelled syntheses stop
    (their slots are free: ``active`` is 0 while 40 sentences could not yet have been spoken), each cancelled socket
    stays usable, and once the sockets close the session gauge returns to 0. Time limits are ceilings against a
    hang, never speed requirements. ``max_queue=None``: the client buffers every frame, so a socket this test is not
    reading at the moment never stops answering the server's keepalive pings."""
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    handle = serve.get_deployment_handle("tts", app_name="chimera")
    long_text = " ".join(f"Sentence number {i} is here." for i in range(40))
    short_text = "One small step. Two small steps. Three small steps."
    socks = [connect(_ws_url(serve_url), max_queue=None) for _ in range(8)]
    try:
        for ws in socks:
            assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        assert _gauge(serve_url) == 8
        for i, ws in enumerate(socks):
            _send(ws, type="session.update", session={"seed": 5})
            assert json.loads(ws.recv(timeout=30))["type"] == "session.updated"
            _send(ws, type="input_text.append", text=long_text if i < 4 else short_text)
            _send(ws, type="input_text.commit")
        firsts = [json.loads(ws.recv(timeout=120)) for ws in socks]  # every session is speaking
        assert [m["type"] for m in firsts] == ["response.audio.delta"] * 8
        for ws in socks[:4]:
            _send(ws, type="response.cancel")
        for ws, first in zip(socks[:4], firsts):
            while (m := json.loads(ws.recv(timeout=60)))["type"] == "response.audio.delta":
                pass  # deltas already in flight before the acknowledgement
            assert m == {"type": "response.audio.done", "response_id": first["response_id"], "status": "cancelled",
                         "usage": None}

        def finish(i: int) -> tuple[bytes, dict]:
            pcm, done = _utterance(socks[i])
            return base64.b64decode(firsts[i]["delta"]) + pcm, done

        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(finish, range(4, 8)))
        assert all(d["status"] == "completed" and d["usage"]["sentences"] == 3 for _, d in done), done
        assert len(done[0][0]) > 0 and all(pcm == done[0][0] for pcm, _ in done)
        for ws in socks[:4]:  # a cancelled session speaks again
            _send(ws, type="input_text.append", text="Short one.")
            _send(ws, type="input_text.commit")
            pcm, d = _utterance(ws)
            assert d["status"] == "completed" and len(pcm) > 0
        # Progress, not time, is the yardstick: since the cancels every stream has spoken about 4 more sentences,
        # so uncancelled 40-sentence syntheses would still be running (active 4). The 1 s of polling only covers a
        # finished synthesis's thread, which ends just after its done event is sent (microseconds).
        assert _wait_idle(handle, 1.0), handle.active.remote().result()
    finally:
        for ws in socks:
            ws.close()
    assert _wait_idle(handle, 120)
    deadline = time.monotonic() + 120
    while _gauge(serve_url) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gauge(serve_url) == 0


# --- the router over the real cpu speech engine, no Ray -----------------------------------------------------------
@pytest.fixture(scope="module")
def local_app(profile, model_dir):
    """The speech router over a Deployment of the cpu profile's engine (backend transformers, no Ray):
    ``(app, deployment)``."""
    import torch

    from services.api.app import build_app
    from services.deployments.backends import LocalBackend
    from services.deployments.speech import Deployment

    before = torch.get_num_threads()
    section = profile.tts.model_dump(mode="json")
    section["engine"]["backend"] = "transformers"
    dep = Deployment(section, str(model_dir))  # sets 1 torch thread, as in Ray
    yield build_app(profile.model_copy(update={"vlm": None, "video": None}), {"tts": LocalBackend(dep)}), dep
    torch.set_num_threads(before)


def test_ws_cancel_stops_only_the_utterance_in_progress(local_app):
    """Issue 24 (3): commit A, commit B, ``response.cancel`` while A speaks: A ends ``cancelled`` at once, B
    still plays and ends ``completed`` with audio, and every commit gets exactly one ``response.audio.done``.
    (The cancel once dropped every queued utterance: B never got a done and a client waiting for it hung.) C,
    committed after the cancel, is the sentinel that ends the reading; an ``empty_input`` commit after it is
    answered next, so no stray done is left behind. Work, not time: A (40 sentences, 7 frames each) is stopped,
    so the frames generated during the whole session stay below A's 280."""
    from starlette.testclient import TestClient

    app, dep = local_app
    long_text = " ".join(f"Sentence number {i} is here." for i in range(40))
    frames0 = dep.engine.frames_generated
    with TestClient(app) as client, client.websocket_connect("/v1/audio/speech/stream") as ws:
        assert ws.receive_json()["type"] == "session.created"
        ws.send_json({"type": "input_text.append", "text": long_text})
        ws.send_json({"type": "input_text.commit"})
        ws.send_json({"type": "input_text.append", "text": "Short one."})  # B: 1 sentence
        ws.send_json({"type": "input_text.commit"})
        first = ws.receive_json()
        assert first["type"] == "response.audio.delta"  # A is speaking
        a = first["response_id"]
        ws.send_json({"type": "response.cancel"})
        ws.send_json({"type": "input_text.append", "text": "Third one. And the end."})  # C: 2 sentences
        ws.send_json({"type": "input_text.commit"})
        dones, pcm, order = [], {}, []
        while True:
            m = ws.receive_json()
            assert m["type"] in ("response.audio.delta", "response.audio.done"), m
            rid = m["response_id"]
            if m["type"] == "response.audio.delta":
                assert rid not in [d["response_id"] for d in dones], "a delta after its response's done"
                pcm[rid] = pcm.get(rid, b"") + base64.b64decode(m["delta"])
                continue
            dones.append(m)
            if m["status"] == "completed" and m["usage"]["sentences"] == 2:
                break  # C, the last commit
        ws.send_json({"type": "input_text.commit"})
        m = ws.receive_json()
        assert m["type"] == "error" and m["error"]["code"] == "empty_input", m
    assert [(d["response_id"] == a, d["status"]) for d in dones] == [(True, "cancelled"), (False, "completed"),
                                                                      (False, "completed")], dones
    b, c = dones[1], dones[2]
    assert len({a, b["response_id"], c["response_id"]}) == 3
    assert b["usage"]["sentences"] == 1 and len(pcm[b["response_id"]]) == 4 * 2048 * 2  # "Short one.": 4 frames
    assert b["usage"]["audio_seconds"] == pytest.approx(4 * 2048 / 24000, abs=1e-3)
    assert dep.running == 0
    assert dep.engine.frames_generated - frames0 < 40 * 7, dep.engine.frames_generated - frames0
