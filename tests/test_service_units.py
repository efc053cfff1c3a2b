"""The ingress without Ray: profiles, auth, edge middleware, error shapes (httpx.ASGITransport)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import yaml

from services.api.app import build_app
from services.deployments.backends import LocalBackend
from services.api.edge import EdgeMiddleware
from services.config.profiles import CONFIG_DIR, ProfileError, load_profile, parse_profile


def test_cpu_profile_is_valid_and_fractional(profile):
    assert profile.name == "cpu" and profile.vlm.model_id == "chimera-vlm"
    total = profile.server.ingress.num_cpus + sum(s.deployment.num_cpus for s in profile.families().values())
    assert total <= (profile.ray.num_cpus or 2)


def test_profile_errors_name_the_key_and_reason():
    data = yaml.safe_load((CONFIG_DIR / "cpu.yaml").read_text())
    bad = dict(data, vlm=dict(data["vlm"], engine=dict(data["vlm"]["engine"], dtyp="float32")))
    with pytest.raises(ProfileError) as ei:
        parse_profile(bad)
    assert "vlm.engine.dtyp" in str(ei.value) and "Extra inputs are not permitted" in str(ei.value)
    bad = dict(data, vlm=dict(data["vlm"], engine=dict(data["vlm"]["engine"], dtype="float8")))
    with pytest.raises(ProfileError) as ei:
        parse_profile(bad)
    assert "vlm.engine.dtype" in str(ei.value) and "pattern" in str(ei.value)
    bad = dict(data, server=dict(data["server"], port=70000))
    with pytest.raises(ProfileError) as ei:
        parse_profile(bad)
    assert "server.port" in str(ei.value)
    with pytest.raises(ProfileError, match="not found"):
        load_profile("no-such-profile")


class EchoDeployment:
    """A trivial stand-in deployment for auth/edge tests (no model involved)."""

    async def ready(self):
        return True


def _vlm_only(profile, **server):
    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    data["server"].update(server)
    return parse_profile(data)


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_auth_required_on_v1_but_not_on_health(profile):
    prof = _vlm_only(profile, api_keys=["sk-test-1"])
    app = build_app(prof, {"vlm": LocalBackend(EchoDeployment())})

    async def go():
        async with _client(app) as c:
            r = await c.get("/v1/models")
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = await c.get("/v1/models", headers={"Authorization": "Bearer sk-test-1"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "chimera-vlm"
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200
            assert (await c.get("/readyz")).status_code == 200

    asyncio.run(go())


def test_readyz_of_a_profile_without_model_families_is_200(profile):
    """An ingress-only profile (``chimera serve --address`` onto a cluster, as tests/test_cluster_config.py does)
    is ready at once: no family to probe (before, /readyz raised: asyncio.wait of no task)."""
    data = profile.model_dump(mode="json")
    data["vlm"] = data["video"] = data["tts"] = None
    app = build_app(parse_profile(data), {})

    async def go():
        async with _client(app) as c:
            r = await c.get("/readyz")
            assert r.status_code == 200 and r.json() == {"status": "ready", "models": {}}

    asyncio.run(go())


def test_readyz_503_while_a_model_loads(profile):
    class Loading:
        async def ready(self):
            raise RuntimeError("replica still starting")

    app = build_app(_vlm_only(profile), {"vlm": LocalBackend(Loading())})

    async def go():
        async with _client(app) as c:
            r = await c.get("/readyz")
            assert r.status_code == 503
            assert r.json()["models"] == {"chimera-vlm": "loading"}
            assert r.json()["error"]["code"] == "model_not_ready"
            r = await c.get("/v1/models/nope")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    asyncio.run(go())


def test_readyz_answers_at_once_while_a_deployment_is_slow_and_probes_it_once(profile):
    """Issue 24: /readyz awaited every deployment's ready() (up to 5 s each) per request, so early calls hung past
    the clients' timeouts. Now a slow deployment is probed once in the background: each /readyz answers 503
    "loading" without waiting for it (ceiling: the 5 s probe timeout, which the old code waited out), reuses
    the probe in flight instead of starting another, and is 200 once that probe returns True."""
    from services.api.readiness import PROBE_TIMEOUT_S, READY_WAIT_S

    class Slow:  # a replica still loading: its ready() answers only when the test lets it
        def __init__(self):
            self.calls, self.release = 0, asyncio.Event()

        async def ready(self):
            self.calls += 1
            await self.release.wait()
            return True

    dep = Slow()
    app = build_app(_vlm_only(profile), {"vlm": LocalBackend(dep)})

    async def go():
        async with _client(app) as c:
            for _ in range(3):
                r = await asyncio.wait_for(c.get("/readyz"), PROBE_TIMEOUT_S - READY_WAIT_S)
                assert r.status_code == 503 and r.json()["models"] == {"chimera-vlm": "loading"}
            assert dep.calls == 1  # one probe in flight, not one per request
            dep.release.set()
            r = await c.get("/readyz")
            assert r.status_code == 200 and r.json()["status"] == "ready"
            assert dep.calls == 1

    asyncio.run(go())


def _requests_count(endpoint: str, status: str, method: str = "GET") -> float:
    from services.api import metrics

    return metrics.REQUESTS.labels(endpoint, method, status)._value.get()


def test_metrics_count_an_abandoned_request_as_client_closed_not_500():
    """A request whose client goes away before any response (Serve cancels its task) was counted as a 500 though
    no 500 was sent; it is counted as 499 (``metrics.CLIENT_CLOSED``). A raise before any response is a 500 (what
    Starlette then sends), and a started response keeps its status."""
    from services.api.metrics import MetricsMiddleware

    entered = asyncio.Event()

    async def hangs(scope, receive, send):
        entered.set()
        await asyncio.Event().wait()

    async def raises(scope, receive, send):
        raise RuntimeError("bug")

    async def streams_then_cancelled(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise asyncio.CancelledError

    async def send(message):
        pass

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    def scope(path):
        return {"type": "http", "method": "GET", "path": path, "headers": []}

    async def go():
        task = asyncio.create_task(MetricsMiddleware(hangs)(scope("/hang"), receive, send))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(RuntimeError):
            await MetricsMiddleware(raises)(scope("/raise"), receive, send)
        with pytest.raises(asyncio.CancelledError):
            await MetricsMiddleware(streams_then_cancelled)(scope("/stream"), receive, send)

    before = {s: _requests_count("unmatched", s) for s in ("200", "499", "500")}
    asyncio.run(go())
    after = {s: _requests_count("unmatched", s) for s in ("200", "499", "500")}
    assert {s: after[s] - before[s] for s in after} == {"200": 1, "499": 1, "500": 1}


def test_metrics_label_playground_and_docs_by_their_routes(profile):
    """``/``, ``/playground/*``, ``/docs`` and ``/openapi.json`` were labelled ``unmatched``: each gets its route's
    path (the mount as ``/playground/{path}``), a path under no route stays ``unmatched``."""
    app = build_app(_vlm_only(profile), {"vlm": LocalBackend(EchoDeployment())})
    labels = {"/": "/", "/playground/app.js": "/playground/{path}", "/docs": "/docs",
              "/openapi.json": "/openapi.json", "/no/such/page": "unmatched"}
    before = {p: _requests_count(ep, "404" if ep == "unmatched" else "200") for p, ep in labels.items()}

    async def go():
        async with _client(app) as c:
            for path, ep in labels.items():
                assert (await c.get(path)).status_code == (404 if ep == "unmatched" else 200), path

    asyncio.run(go())
    grown = {p: _requests_count(ep, "404" if ep == "unmatched" else "200") - before[p] for p, ep in labels.items()}
    assert grown == {p: 1 for p in labels}


def test_edge_strips_override_headers_and_shapes_ray_errors():
    seen = {}

    async def inner(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        status = int(scope["path"].strip("/") or 200)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure"})

    app = EdgeMiddleware(inner)

    async def go():
        async with _client(app) as c:
            r = await c.get("/200", headers={"x-request-timeout-seconds": "0.01", "x-request-disconnect-disabled": "?1",
                                             "x-other": "kept"})
            assert r.status_code == 200 and r.text == "Request dropped due to backpressure"
            assert b"x-request-timeout-seconds" not in seen["headers"]
            assert b"x-request-disconnect-disabled" not in seen["headers"]
            assert seen["headers"][b"x-other"] == b"kept"
            for status, etype in ((429, "rate_limit_error"), (503, "service_unavailable"), (408, "timeout_error")):
                r = await c.get(f"/{status}")
                assert r.status_code == status
                err = r.json()["error"]
                assert err["type"] == etype and "backpressure" in err["message"]
                if status in (429, 503):
                    assert r.headers["retry-after"]

    asyncio.run(go())


def test_ray_back_pressure_and_unavailable_become_429_and_503():
    import ray.exceptions
    import torch
    from ray.serve.exceptions import BackPressureError

    from services.api.errors import to_api_error

    err = to_api_error(BackPressureError(num_queued_requests=32, max_queued_requests=32))
    assert err.status == 429 and err.code == "queue_full" and int(err.headers["Retry-After"]) >= 1
    assert err.body()["error"]["type"] == "rate_limit_error"
    err = to_api_error(BackPressureError(num_queued_requests=3, max_queued_requests=3, retry_after_s=7.2))
    assert err.headers["Retry-After"] == "7"
    assert to_api_error(ValueError("bad")).status == 400
    # a replica's worker lost under the request (Ray's memory monitor kills it near the node's limit): 503, retry
    for exc in (ray.exceptions.ActorDiedError(), ray.exceptions.RayActorError(), ray.exceptions.WorkerCrashedError(),
                ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")):
        err = to_api_error(exc)
        assert (err.status, err.code, err.headers) == (503, "model_unavailable", {"Retry-After": "5"}), exc
    assert to_api_error(torch.OutOfMemoryError("CUDA out of memory")).status == 500  # not Ray's: a model fault
    bug = to_api_error(KeyError("oops"))
    assert bug.status == 500 and bug.body()["error"]["type"] == "server_error"


def test_metrics_label_by_route_template_not_raw_path(profile):
    from services.api import metrics

    app = build_app(_vlm_only(profile), {"vlm": LocalBackend(EchoDeployment())})

    async def go():
        async with _client(app) as c:
            for name in ("abc", "def", "ghi"):
                assert (await c.get(f"/v1/models/{name}")).status_code == 404
            assert (await c.get("/v1/random/junk/path")).status_code == 404

    asyncio.run(go())
    from prometheus_client import generate_latest

    text = generate_latest(metrics.REGISTRY).decode()
    assert 'endpoint="/v1/models/{model_id}",method="GET",status="404"' in text
    assert "abc" not in text and "junk" not in text
    assert 'endpoint="unmatched",method="GET",status="404"' in text


@pytest.fixture(scope="module")
def vlm_deployment(profile, model_dir):
    """The real VLM deployment class, in this process (no Ray), on the transformers backend (whose batcher and
    in-process LLM these tests exercise; the vllm backend's are in tests/test_vlm_vllm.py)."""
    from services.deployments.vlm import Deployment

    section = profile.vlm.model_dump(mode="json")
    section["engine"]["backend"] = "transformers"
    dep = Deployment(section, str(model_dir))
    yield dep
    dep.engine.close()


def test_closing_a_chat_stream_drops_the_request_from_the_batch(vlm_deployment):
    async def go():
        agen = vlm_deployment.chat_stream({"messages": [{"role": "user", "content": "Write a long essay."}],
                                           "max_tokens": 400, "temperature": 1.0, "seed": 0})
        events = [await agen.__anext__() for _ in range(4)]
        assert events[0]["type"] == "start" and all(e["type"] == "delta" for e in events[1:])
        assert (await vlm_deployment.stats())["active"] == 1
        await agen.aclose()
        deadline = time.monotonic() + 120  # a ceiling against a hang, not a speed requirement
        while time.monotonic() < deadline:
            if (await vlm_deployment.stats())["active"] == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the abandoned request is still being decoded")

    asyncio.run(go())


def test_chat_model_failure_mid_stream_is_an_sse_error_event_and_a_500_when_not_streamed(profile, vlm_deployment):
    """The real VLM deployment in-process, its LLM made to emit NaN logits after the first token on purpose."""
    import json

    import torch

    dep = vlm_deployment
    lm_head = dep.engine.model.llm.lm_head
    hook = lm_head.register_forward_hook(
        lambda m, a, out: torch.full_like(out, float("nan")) if out.shape[1] == 1 else out)
    app = build_app(_vlm_only(profile), {"vlm": LocalBackend(dep)})
    body = {"model": "chimera-vlm", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
            "temperature": 0}

    async def go():
        async with _client(app) as c:
            r = await c.post("/v1/chat/completions", json=dict(body, stream=True))
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
            payloads = [json.loads(e) for e in events if e != "[DONE]"]
            assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
            assert payloads[-1]["error"]["code"] == "non_finite_output"
            assert payloads[-1]["error"]["type"] == "server_error"
            assert "[DONE]" not in events
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["code"] == "non_finite_output"
            r = await c.post("/v1/chat/completions", json=body)  # the batcher survives a failed request
            assert r.status_code == 500

    try:
        asyncio.run(go())
    finally:
        hook.remove()


def test_prepare_is_idempotent(model_dir):
    """`chimera prepare` on a prepared model dir writes nothing (every family reports up to date)."""
    import os

    from typer.testing import CliRunner

    from services.cli import app as cli

    before = {p: p.stat().st_mtime_ns for p in model_dir.rglob("*.safetensors")}
    env = {"CHIMERA_MODEL_DIR": str(model_dir)}
    result = CliRunner().invoke(cli, ["prepare", "--profile", os.environ.get("CHIMERA_TEST_PROFILE", "cpu")], env=env)
    assert result.exit_code == 0, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert lines and all("up to date" in l for l in lines), result.output
    assert {p: p.stat().st_mtime_ns for p in model_dir.rglob("*.safetensors")} == before
    bad = CliRunner().invoke(cli, ["prepare", "--profile", "no-such-profile"])
    assert bad.exit_code == 2 and "not found" in bad.output


class _Body:
    """The one method of a Starlette request that ``json_object`` uses."""

    def __init__(self, raw: bytes):
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


@pytest.mark.parametrize("raw,param", [
    (rb'{"input": "\ud800"}', "input"),                                                    # lone high surrogate
    (rb'{"input": "ok \udfff end"}', "input"),                                             # lone low surrogate
    (rb'{"input": "\ude00\ud83d"}', "input"),                                              # a pair in the wrong order
    (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udc80"}]}]}',
     "messages[0].content[0].text"),
    (rb'{"a": {"b": [1, 2, ["fine", "\ud800"]]}}', "a.b[2][1]"),
    (rb'{"session": {"k\ud800": 1}}', "session.k\\ud800"),                                  # a key
])
def test_json_object_refuses_strings_that_are_not_unicode(raw, param):
    from services.api.body import json_object
    from services.api.errors import APIError

    with pytest.raises(APIError) as ei:
        asyncio.run(json_object(_Body(raw)))
    err = ei.value
    assert (err.status, err.code, err.param) == (400, "invalid_unicode", param)
    err.body()["error"]["message"].encode("utf-8")  # the answer itself is valid UTF-8


def test_parse_json_bounds_the_nesting_without_recursion():
    """Defect: 100,000 nested arrays in a body were a 500 (RecursionError) on every JSON endpoint and dropped the
    speech websocket. Nesting up to MAX_JSON_DEPTH parses; one level more, or nesting so deep that Python's parser
    recurses out, is JSONTooDeep (a ValueError); malformed JSON is still json.JSONDecodeError; a key given twice
    in one object is JSONDuplicateKey (a 400 ``duplicate_parameter`` naming it in a body), not last-wins."""
    import json

    from services.api.body import MAX_JSON_DEPTH, JSONDuplicateKey, JSONTooDeep, parse_json

    n = MAX_JSON_DEPTH
    assert parse_json("[" * n + "]" * n) == json.loads("[" * n + "]" * n)
    assert parse_json('{"a": ' * (n - 1) + "[]" + "}" * (n - 1)) is not None  # objects count as levels too
    for text in ("[" * (n + 1) + "]" * (n + 1), '{"a": ' * n + "[]" + "}" * n, "[" * 100_000 + "]" * 100_000,
                 '{"x": ' + "[" * 100_000):
        with pytest.raises(JSONTooDeep):
            parse_json(text)
    with pytest.raises(json.JSONDecodeError):
        parse_json("{not json")
    assert parse_json('{"messages": [{"content": [{"image_url": {"url": "u"}}]}]}')["messages"][0]
    for text in ('{"prompt": "a", "prompt": "b"}', '{"m": [{"role": "user", "role": "system"}]}'):
        with pytest.raises(JSONDuplicateKey):
            parse_json(text)
    from services.api.body import json_object
    from services.api.errors import APIError

    with pytest.raises(APIError) as ei:
        asyncio.run(json_object(_Body(b'{"model": "x", "max_tokens": 1, "max_tokens": 2}')))
    assert (ei.value.status, ei.value.code, ei.value.param) == (400, "duplicate_parameter", "max_tokens")


def test_json_object_keeps_valid_unicode_and_its_other_errors():
    from services.api.body import json_object
    from services.api.errors import APIError

    ok = asyncio.run(json_object(_Body('{"t": "caf\\u00e9 \\ud83d\\ude00 \u00e9\u4e2d", "k\u00e9": ["\\n"]}'.encode())))
    assert ok == {"t": "caf\u00e9 \U0001F600 \u00e9\u4e2d", "k\u00e9": ["\n"]}
    assert asyncio.run(json_object(_Body(b'\xef\xbb\xbf{"a": 1}'))) == {"a": 1}  # UTF-8 BOM
    for raw in (b"{not json", b"[1]", b"", b'{"a": "caf\xe9"}', b'{"a": "\xed\xa0\x80"}', b'{\x00"\x00x'):
        with pytest.raises(APIError) as ei:  # not UTF-8 (latin-1, an encoded surrogate, UTF-16) or not an object
            asyncio.run(json_object(_Body(raw)))
        assert (ei.value.status, ei.value.code) == (400, "invalid_json"), raw


def test_chat_lone_surrogate_is_a_400_without_a_traceback(profile, caplog):
    """Defect: ``"\\ud800"`` in a chat message was a 500 with a traceback. Every text field of the body is checked
    before the model sees it; nothing is logged at error level."""
    app = build_app(_vlm_only(profile), {"vlm": LocalBackend(EchoDeployment())})
    bodies = {
        "messages[0].content": rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}',
        "messages[1].content[0].text": rb'{"messages": [{"role": "system", "content": "s"}, {"role": "user", '
                                       rb'"content": [{"type": "text", "text": "\udbff"}]}]}',
        "stop[0]": rb'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}',
        "model": rb'{"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}',
    }

    async def go():
        async with _client(app) as c:
            for param, raw in bodies.items():
                r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["code"] == "invalid_unicode" and r.json()["error"]["param"] == param

    with caplog.at_level("WARNING"):
        asyncio.run(go())
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info], caplog.text


def test_video_call_cancelled_by_serve_ends_as_cancelled_not_as_a_failure():
    """A client that drops a request (a readiness poll that times out while the service loads) makes Serve cancel
    the video replica's actor call: Ray raises TaskCancelledError there. It must end as asyncio.CancelledError
    (Serve logs CANCELLED) and not as a failed request with a traceback, which a fresh-clone run caught in the
    shutdown test's log. The stand-in manager raises what Ray raises; the manager's own errors still unwrap."""
    import ray

    from services.jobs.errors import JobError
    from services.deployments.video import Deployment

    class _Method:
        def __init__(self, exc):
            self.exc = exc

        def remote(self, *args, **kwargs):
            async def fail():
                raise self.exc
            return fail()

    class _Manager:
        readiness = _Method(ray.exceptions.TaskCancelledError())
        get = _Method(JobError(404, "no such video", code="video_not_found", param="video_id"))

    dep = object.__new__(Deployment)
    dep.manager = _Manager()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(dep.ready())
    with pytest.raises(JobError) as ei:
        asyncio.run(dep._call("get", "video_x"))
    assert ei.value.status_code == 404


def _deployments(profile, hold_until_ready: bool = False) -> dict:
    """``{name: Serve's deployment}`` of ``build_application(profile)`` as ``serve.run`` deploys them."""
    from ray.serve._private.build_app import build_app as serve_build

    from services.serve_app import build_application

    app = build_application(profile, hold_until_ready=hold_until_ready)
    return {d.name: d for d in serve_build(app, name="chimera").deployments}


def test_a_changed_vlm_section_gives_new_versions_to_the_vlm_and_the_ingress_only():
    """Serve replaces the replicas of a deployment whose version changed: a new speculative head changes the
    VLM's and the ingress's (which holds the whole profile); speech and video keep theirs, so a reload leaves
    them running; so does ``hold_until_ready`` (a reload's). Every deployment gets its ``max_surge_percent`` (100
    without GPUs) and drain time."""
    cpu = load_profile("cpu")
    data = cpu.model_dump(mode="json")
    data["vlm"]["engine"]["vllm"]["speculative"] = {"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    old, again, new = _deployments(cpu), _deployments(cpu, hold_until_ready=True), _deployments(parse_profile(data))
    assert {n: d._version for n, d in old.items()} == {n: d._version for n, d in again.items()}
    # a reload's replicas of the engine deployments wait for their engines in the constructor; not a new version
    assert {n: d._replica_config.init_kwargs.get("hold_until_ready") for n, d in again.items()} == {
        "vlm": True, "tts": True, "video": None, "ingress": None}
    assert all("hold_until_ready" not in d._replica_config.init_kwargs for d in old.values())
    assert {n for n in old if old[n]._version != new[n]._version} == {"vlm", "ingress"}
    assert all(len(d._version) == 16 for d in old.values())
    assert {n: (d._deployment_config.max_surge_percent, d._deployment_config.graceful_shutdown_timeout_s)
            for n, d in old.items()} == {n: (100, 20.0) for n in ("vlm", "video", "tts", "ingress")}
    assert "max_surge_percent" in old["vlm"]._deployment_config.user_configured_option_names
    data = cpu.model_dump(mode="json")  # a deployment option alone: Ray applies it in place, same version
    data["vlm"]["deployment"]["num_replicas"] = 2
    assert {n: d._version for n, d in _deployments(parse_profile(data)).items() if n != "ingress"} == {
        n: d._version for n, d in old.items() if n != "ingress"}


def test_reload_refuses_a_broken_or_restart_only_profile_and_keeps_the_old_one(tmp_path, capsys, monkeypatch):
    """SIGHUP's reload (``services.cli._reload``) with an unchanged file does nothing; with a changed port, an
    invalid file or an EAGLE-3 head folder that does not exist it says why on stderr, deploys nothing and keeps
    serving the profile it had."""
    from services import cli

    deployed = []
    monkeypatch.setattr("services.serve_app.redeploy", deployed.append)
    cpu = load_profile("cpu")
    path = tmp_path / "p.yaml"
    data = cpu.model_dump(mode="json")
    path.write_text(yaml.safe_dump(data))
    assert cli._reload(str(path), None, cpu, "http://127.0.0.1:1") is cpu
    assert "unchanged; nothing to do" in capsys.readouterr().out
    data["server"]["port"] = 8001
    path.write_text(yaml.safe_dump(data))
    assert cli._reload(str(path), None, cpu, "http://127.0.0.1:1") is cpu
    assert "take a restart of chimera serve: server.port: 8000 -> 8001" in capsys.readouterr().err
    data["server"]["port"] = 8000
    data["vlm"]["deployment"]["max_surge_percent"] = 101
    path.write_text(yaml.safe_dump(data))
    assert cli._reload(str(path), None, cpu, "http://127.0.0.1:1") is cpu
    assert "vlm.deployment.max_surge_percent: Input should be less than or equal to 100" in capsys.readouterr().err
    data["vlm"]["deployment"]["max_surge_percent"] = None
    data["vlm"]["engine"]["vllm"]["speculative"] = {"method": "eagle3", "model": str(tmp_path / "no-head"),
                                                    "num_speculative_tokens": 3}
    path.write_text(yaml.safe_dump(data))
    assert cli._reload(str(path), None, cpu, "http://127.0.0.1:1") is cpu
    err = capsys.readouterr().err
    assert "reload refused, still serving the old profile: vlm.engine.vllm.speculative:" in err, err
    assert deployed == []
    assert cli.profile_changes(cpu, load_profile(path)) == [
        "vlm.engine.vllm.speculative.method: None -> 'eagle3'",
        f"vlm.engine.vllm.speculative.model: None -> '{tmp_path / 'no-head'}'",
        "vlm.engine.vllm.speculative.num_speculative_tokens: None -> 3"]


def test_a_reload_replica_whose_server_gives_up_fails_its_constructor_and_leaves_no_process():
    """``EngineDeployment._hold_until_ready`` (a reload's replica): returns at once without an engine process;
    when the vLLM server gives up (state ``failed``) it closes the engine, stops the server and raises, so Serve
    counts a failed start (and retries it) while the old replica keeps serving. Stand-ins for the server and the
    engine (their own behaviour is tests/test_engine_process.py's)."""
    from services.deployments.base import EngineDeployment

    class Server:
        state, last_error, stops = "failed", "exit code 1", 0

        def wait_ready(self, timeout):
            assert timeout is None  # as long as it takes (a vLLM start)
            return False

        def stop(self):
            self.stops += 1

    class Engine:
        closes = 0

        def close(self):
            self.closes += 1

    rep = EngineDeployment()
    rep.engine = Engine()
    rep._hold_until_ready()  # no server: an in-process engine is ready once constructed
    rep.server = Server()
    with pytest.raises(RuntimeError, match=r"^the vLLM server did not start \(failed\): exit code 1$"):
        rep._hold_until_ready()
    assert (rep.server.stops, rep.engine.closes) == (1, 1)
