"""The web playground (``services/api/static/``, served at ``/``) in a real browser: Playwright driving Debian's
Chromium (headless; ``CHIMERA_CHROMIUM``, else Debian's ``/usr/bin/chromium``, else Playwright's own build: ``make
browser``, a step of ``make test``, installs one) against the session's cpu service.

Each test works one panel the way a user would (picker, drop, paste, forms, buttons) and checks what the page
shows against what the API itself answers for the same request. Screenshots of each panel at 1280x800 and 390x844
go to a temporary folder (printed; never committed). Waits are for page state (``wait_for_function``) with one
generous ceiling, ``CEILING_MS``, that only turns a hang into a failure.
"""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time

import httpx
import pytest
from PIL import Image, ImageDraw
from playwright.sync_api import sync_playwright

from tests.conftest import free_port

# None: Playwright's own Chromium build (``python -m playwright install chromium``)
CHROMIUM = os.environ.get("CHIMERA_CHROMIUM") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
CEILING_MS = 240_000  # a hang guard, far above a slow machine (a 1-clip cpu job takes seconds)
WIDTHS = {"desktop": (1280, 800), "phone": (390, 844)}


def red_circle_png() -> bytes:
    """The README's image: one large red circle in the top right of a 224x224 white image (what the cpu graft
    was trained on), as PNG bytes."""
    img = Image.new("RGB", (224, 224), "white")
    ImageDraw.Draw(img).ellipse([124, 12, 220, 108], fill=(215, 40, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--autoplay-policy=no-user-gesture-required"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    d = tmp_path_factory.mktemp("playground-screenshots")
    print(f"playground screenshots: {d}")
    return d


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    p = ctx.new_page()
    p.set_default_timeout(CEILING_MS)
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    yield p
    ctx.close()
    assert errors == [], f"uncaught errors in the page: {errors}"


def created_job(response) -> bool:
    """The page's ``POST /v1/videos`` response (not its ``GET /v1/videos?limit=...`` list requests)."""
    return response.request.method == "POST" and response.url.endswith("/v1/videos")


def open_panel(page, name: str) -> None:
    page.click(f"#tab-{name}")
    page.wait_for_selector(f"#panel-{name}", state="visible")


def screenshot_both_widths(page, shots, name: str) -> None:
    """Screenshot the page at both widths, and check that the phone width needs no sideways scrolling."""
    for label, (w, h) in WIDTHS.items():
        page.set_viewport_size({"width": w, "height": h})
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"{name} at {w}x{h} scrolls sideways by {overflow} px"
        page.screenshot(path=str(shots / f"{name}-{label}-{w}x{h}.png"), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 800})


def test_page_served_next_to_the_api(serve_url):
    """``/`` is the page and ``/playground/*`` its assets; the API, ops endpoints and docs are not shadowed, and an
    unknown path is still the OpenAI-shaped 404."""
    r = httpx.get(f"{serve_url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script src="/playground/app.js"' in r.text and "://" not in r.text  # nothing from another host
    for asset, ctype in (("app.js", "javascript"), ("style.css", "text/css")):
        a = httpx.get(f"{serve_url}/playground/{asset}")
        assert a.status_code == 200 and ctype in a.headers["content-type"] and "://" not in a.text
    assert httpx.get(f"{serve_url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{serve_url}/readyz").status_code == 200
    assert "chimera_" in httpx.get(f"{serve_url}/metrics").text
    assert httpx.get(f"{serve_url}/docs").status_code == 200
    assert [m["id"] for m in httpx.get(f"{serve_url}/v1/models").json()["data"]]
    missing = httpx.get(f"{serve_url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "route_not_found"
    assert httpx.get(f"{serve_url}/playground/missing.js").status_code == 404


def test_keyboard_and_labels(page, serve_url):
    """Every form control has a label; the tabs move with the arrow keys and focus follows."""
    page.goto(serve_url)
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
        .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')).map(el => el.id)""")
    assert unlabelled == []
    page.focus("#tab-chat")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.id") == "tab-video"
    assert page.is_visible("#panel-video") and not page.is_visible("#panel-chat")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.id") == "tab-chat" and page.is_visible("#panel-chat")


def test_chat_image_question_streams_answer(page, serve_url, openai_client, shots):
    """Images attach by picker, drop and paste; a question about the red circle streams an answer, the same text
    and number of content chunks as the SDK's streamed answer to the same messages (greedy: deterministic); the
    JSON-mode toggle sends ``response_format: json_object``."""
    png = red_circle_png()
    page.goto(serve_url)
    page.set_input_files("#chat-files", files=[{"name": "circle.png", "mimeType": "image/png", "buffer": png}])
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 1")
    b64 = base64.b64encode(png).decode()
    for kind in ("drop", "paste"):
        page.evaluate("""([b64, kind]) => {
            const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
            const dt = new DataTransfer();
            dt.items.add(new File([bytes], kind + '.png', {type: 'image/png'}));
            const ev = kind === 'drop'
                ? new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true})
                : new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true});
            document.getElementById(kind === 'drop' ? 'dropzone' : 'chat-input').dispatchEvent(ev);
        }""", [b64, kind])
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 3")
    assert page.eval_on_selector_all("#attachments img", "els => els.map(e => e.alt)") == [
        "circle.png", "drop.png", "paste.png"]
    page.click("[aria-label='Remove paste.png']")
    page.click("[aria-label='Remove drop.png']")
    page.wait_for_function("document.querySelectorAll('#attachments img').length === 1")

    question = "What colour is the shape?"
    page.fill("#chat-input", question)
    page.fill("#chat-max-tokens", "16")
    page.fill("#chat-temperature", "0")
    page.click("#chat-send")
    page.wait_for_function("document.querySelector('#chat-answer-current')?.dataset.done === 'true'",
                           timeout=CEILING_MS)
    assert page.is_hidden("#chat-error")
    shown = page.inner_text("#chat-answer-current .content")
    chunks = int(page.get_attribute("#chat-answer-current", "data-chunks"))

    url = "data:image/png;base64," + b64
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": question}]}]
    sdk = [c.choices[0].delta.content for c in openai_client.chat.completions.create(
        model="chimera-vlm", messages=messages, max_tokens=16, temperature=0, stream=True)
        if c.choices and c.choices[0].delta.content]
    assert shown == "".join(sdk) and "Red" in shown
    assert chunks == len(sdk) >= 1

    page.check("#chat-json")
    page.fill("#chat-input", "Give the colour as JSON.")
    with page.expect_request("**/v1/chat/completions") as req:
        page.click("#chat-send")
    sent = json.loads(req.value.post_data)
    assert sent["response_format"] == {"type": "json_object"} and sent["stream"] is True
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]  # the conversation so far
    page.wait_for_function("document.querySelector('#chat-answer-current')?.dataset.done === 'true'",
                           timeout=CEILING_MS)
    screenshot_both_widths(page, shots, "chat")


def test_video_job_progress_play_and_delete(page, serve_url, openai_client, shots):
    """A 1-clip job from the form: the progress bar reaches 100 with status completed, the <video> element
    loads the MP4 (readyState >= 1, duration = the job's seconds within one frame), the recent-jobs list shows it
    with its 64x64 thumbnail, and Delete removes it (the API then answers 404)."""
    page.goto(serve_url)
    open_panel(page, "video")
    page.fill("#video-prompt", "a lighthouse at dusk")
    page.fill("#video-seconds", "2")
    page.fill("#video-size", "64x64")
    page.fill("#video-steps", "2")
    page.fill("#video-seed", "3")
    with page.expect_response(created_job) as created:
        page.click("#video-submit")
    job_id = created.value.json()["id"]
    page.wait_for_function("document.querySelector('#video-progress').value === 100 && "
                           "document.querySelector('#video-progress').dataset.status === 'completed'",
                           timeout=CEILING_MS)
    assert page.inner_text("#video-progress-text") == f"{job_id}: completed 100%"
    page.wait_for_function("(() => { const v = document.querySelector('#video-player');"
                           " return !v.hidden && v.readyState >= 1 && v.duration > 0; })()", timeout=CEILING_MS)
    duration = page.evaluate("document.querySelector('#video-player').duration")
    job = openai_client.videos.retrieve(job_id)
    assert job.status == "completed" and job.progress == 100
    fps = 2  # the cpu profile's default (configs/cpu.yaml video defaults)
    assert abs(duration - float(job.seconds)) <= 1 / fps, (duration, job.seconds)
    assert page.get_attribute("#video-download", "download") == f"{job_id}.mp4"
    row = f"#video-jobs li[data-video-id='{job_id}']"
    page.wait_for_function(f"document.querySelector(\"{row} img\")?.naturalWidth === 64", timeout=CEILING_MS)
    screenshot_both_widths(page, shots, "video")
    page.click(f"[aria-label='Delete {job_id}']")
    page.wait_for_selector(row, state="detached", timeout=CEILING_MS)
    assert httpx.get(f"{serve_url}/v1/videos/{job_id}").status_code == 404


def test_video_cancel_running_job(page, serve_url):
    """Cancel on a queued or running job (8 chained clips of 50 steps: minutes on the cpu profile, so it is
    still running when clicked) removes it: gone from the list, 404 from the API."""
    page.goto(serve_url)
    open_panel(page, "video")
    page.fill("#video-seconds", "32")
    page.fill("#video-steps", "50")
    with page.expect_response(created_job) as created:
        page.click("#video-submit")
    job_id = created.value.json()["id"]
    page.click(f"[aria-label='Cancel {job_id}']", timeout=CEILING_MS)
    page.wait_for_selector(f"#video-jobs li[data-video-id='{job_id}']", state="detached", timeout=CEILING_MS)
    assert httpx.get(f"{serve_url}/v1/videos/{job_id}").status_code == 404
    assert page.is_hidden("#video-error")


def test_speech_streams_audio_chunks(page, serve_url, shots):
    """A spoken sentence over the websocket: the page counts one chunk per ``response.audio.delta`` the browser
    received, shows the seconds of audio the server reports in ``response.audio.done`` (to the sample: 24 kHz),
    and offers a WAV of exactly those samples (44-byte header + 2 bytes per sample)."""
    page.goto(serve_url)
    open_panel(page, "speech")
    frames: list[dict] = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda f: frames.append(json.loads(f))))
    voices = page.eval_on_selector_all("#speech-voice option", "els => els.map(e => e.value)")
    assert voices == ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
    page.select_option("#speech-voice", "leo")
    page.fill("#speech-text", "Hello there.")
    page.fill("#speech-seed", "7")
    page.click("#speech-speak")
    page.wait_for_function("document.querySelector('#speech-status').textContent.startsWith('done')",
                           timeout=CEILING_MS)
    assert page.is_hidden("#speech-error")
    deltas = [f for f in frames if f["type"] == "response.audio.delta"]
    done = [f for f in frames if f["type"] == "response.audio.done"]
    updated = [f for f in frames if f["type"] == "session.updated"]
    assert updated and updated[0]["session"]["voice"] == "leo" and updated[0]["session"]["seed"] == 7
    assert len(done) == 1 and done[0]["status"] == "completed"
    samples = sum(len(base64.b64decode(d["delta"])) // 2 for d in deltas)
    assert int(page.inner_text("#speech-chunks")) == len(deltas) >= 1
    assert abs(float(page.inner_text("#speech-seconds")) - samples / 24000) <= 0.005  # shown to 2 decimals
    assert abs(done[0]["usage"]["audio_seconds"] - samples / 24000) <= 1e-4  # the server rounds to 4 decimals
    size = page.evaluate("fetch(document.querySelector('#speech-download').href).then(r => r.blob())"
                         ".then(b => b.size)")
    assert size == 44 + 2 * samples
    screenshot_both_widths(page, shots, "speech")


def test_bad_input_shows_the_api_message(page, serve_url):
    """A video size that is not a multiple of 32 and a speech speed out of range: the page shows the status,
    code and message the API itself gives for that input (asked directly over HTTP and the websocket)."""
    form = {"prompt": "a lighthouse at dusk", "seconds": "4", "size": "65x64", "drift_correction": "true"}
    api = httpx.post(f"{serve_url}/v1/videos", files={k: (None, v) for k, v in form.items()})  # what the page sends
    assert api.status_code == 400
    err = api.json()["error"]
    page.goto(serve_url)
    open_panel(page, "video")
    page.fill("#video-size", "65x64")
    page.click("#video-submit")
    page.wait_for_selector("#video-error", state="visible", timeout=CEILING_MS)
    assert page.inner_text("#video-error") == f"400 {err['code']}: {err['message']}"

    from websockets.sync.client import connect

    with connect(serve_url.replace("http", "ws", 1) + "/v1/audio/speech/stream") as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {"speed": 9}}))
        ws_err = json.loads(ws.recv())["error"]
    open_panel(page, "speech")
    page.fill("#speech-speed", "9")
    page.click("#speech-speak")
    page.wait_for_selector("#speech-error", state="visible", timeout=CEILING_MS)
    assert page.inner_text("#speech-error") == f"{ws_err['code']}: {ws_err['message']}"
    assert page.inner_text("#speech-chunks") == "0"  # the text is sent only once the session is configured


@pytest.fixture(scope="module")
def keyed_url(profile, serve_url):
    """The ingress app with API keys on (``["sk-right"]``), served in this process by uvicorn on a free port, its
    backends the handles of the running Serve deployments (no second stack)."""
    import uvicorn
    from ray import serve

    from services.api.app import build_app
    from services.deployments.backends import RayBackend
    from services.serve_app import APP_NAME

    prof = profile.model_copy(update={"server": profile.server.model_copy(update={"api_keys": ["sk-right"]})})
    backends = {fam: RayBackend(serve.get_deployment_handle(fam, app_name=APP_NAME)) for fam in prof.families()}
    server = uvicorn.Server(uvicorn.Config(build_app(prof, backends), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(30)


def test_wrong_key_shows_401_and_right_key_works(page, keyed_url):
    """With keys on: no key and a wrong key show the API's 401 message (HTTP, and the speech websocket whose
    refused handshake the page explains by asking the HTTP API); the right key, kept in sessionStorage across a
    reload, lists the models."""
    msg = httpx.get(f"{keyed_url}/v1/models", headers={"Authorization": "Bearer sk-wrong"}).json()["error"]
    expected = f"401 {msg['code']}: {msg['message']}"
    page.goto(keyed_url)
    page.wait_for_selector("#global-error", state="visible", timeout=CEILING_MS)
    assert page.inner_text("#global-error") == expected  # no key yet
    page.fill("#api-key", "sk-wrong")
    page.click("#key-save")
    page.wait_for_function("document.querySelector('#global-error').textContent.startsWith('401')")
    assert page.inner_text("#global-error") == expected
    open_panel(page, "speech")
    page.fill("#speech-text", "Hello there.")
    page.click("#speech-speak")
    page.wait_for_selector("#speech-error", state="visible", timeout=CEILING_MS)
    assert page.inner_text("#speech-error") == expected

    page.fill("#api-key", "sk-right")
    page.click("#key-save")
    page.wait_for_function("document.querySelector('#models').textContent.startsWith('Models:')")
    assert page.is_hidden("#global-error")
    page.reload()
    page.wait_for_function("document.querySelector('#models').textContent.startsWith('Models:')")
    assert page.evaluate("sessionStorage.getItem('chimera.apiKey')") == "sk-right"
    assert page.input_value("#api-key") == "sk-right"
