"""The FastAPI ingress, built by a factory so tests can drive it without Ray (``httpx.ASGITransport``).

``build_app(profile, backends)`` mounts the routes of every family in the profile (``services/chat.py``,
``services/videos.py``, ``services/speech.py``), the operational endpoints (``/healthz``, ``/readyz``,
``/metrics``, ``/v1/models``), API-key auth for ``/v1/*``, per-endpoint metrics and OpenAI-shaped errors.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import metrics
from .backends import Backend
from .edge import EdgeMiddleware
from .errors import error_body, install_error_handlers
from .profiles import Profile
from .readiness import ReadyStates

log = logging.getLogger("chimera")

FAMILY_MODULES = {"vlm": "services.chat", "video": "services.videos", "tts": "services.speech"}
OWNERS = {"vlm": "chimera", "video": "chimera", "tts": "chimera"}


def family_module(family: str):
    """The services module of a family (``make_router`` and ``Deployment`` live there)."""
    return importlib.import_module(FAMILY_MODULES[family])


def key_id(key: str) -> str:
    """The id a job owner is stored under: the first 16 hex digits of SHA-256 of the API key (never the key)."""
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()[:16]


class AuthMiddleware:
    """Bearer-token auth on ``/v1/*`` (and ``/metrics`` with ``protect_metrics``), HTTP and WebSocket (browsers'
    websockets may pass ``?api_key=``, which is never logged).

    Every configured key is compared in constant time (``hmac.compare_digest``; all of them, whichever
    matches). An accepted request carries the key's :func:`key_id` in ``scope["state"]["key_id"]`` (the routes'
    ``request.state.key_id``: the owner of the video jobs it creates); with no keys configured it is None
    and everything is open. Health and readiness stay open."""

    def __init__(self, app, keys: list[str], protect_metrics: bool = False):
        self.app = app
        self.keys = [(k.encode(), key_id(k)) for k in keys]
        self.protect_metrics = protect_metrics

    def _match(self, scope) -> str | None:
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if not token and scope["type"] == "websocket":
            from urllib.parse import parse_qs

            token = (parse_qs(scope.get("query_string", b"").decode()).get("api_key") or [""])[0].encode()
        found = None
        for k, kid in self.keys:
            if hmac.compare_digest(token, k) and token:
                found = kid
        return found

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and self.keys:
            kid = self._match(scope)
            if kid is None and self._guarded(scope["path"]):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
                    return
                resp = JSONResponse(error_body("invalid or missing API key (Authorization: Bearer <key>)",
                                               "authentication_error", None, "invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
            scope = dict(scope)
            scope["state"] = {**scope.get("state", {}), "key_id": kid}
        return await self.app(scope, receive, send)


class MetricsMiddleware:
    """Counts requests and records latency per route template (``/v1/videos/{video_id}``), status included.

    The label is the matched route's template, read from ``scope["route"]`` after routing (FastAPI's routes);
    a request the router answered through a plain Starlette route or a mount (``/docs``, ``/openapi.json``,
    ``/playground/{path}``) gets that route's path (``router``: the app's router, matched against the request's
    scope as it came in); requests matching no route are labelled ``unmatched`` so arbitrary paths cannot create
    new series.

    The status is the one sent (``http.response.start``). A request that ends before any response was sent is
    counted as :data:`services.metrics.CLIENT_CLOSED` (``499``, nginx's "client closed request") when the client
    went away (its task was cancelled, as Serve does on a disconnect, or the app saw ``http.disconnect`` and
    returned), else ``500`` (Starlette's ``ServerErrorMiddleware`` outside this one, or the server, answers 500)."""

    def __init__(self, app, router=None):
        self.app = app
        self.router = router

    def _label(self, scope, original) -> str:
        route = scope.get("route")
        if getattr(route, "path", None):
            return route.path
        from starlette.routing import Match, Mount

        for r in getattr(self.router, "routes", ()):
            if r.matches(original)[0] != Match.NONE:
                return f"{r.path}/{{path}}" if isinstance(r, Mount) else r.path
        return "unmatched"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, original = time.perf_counter(), {"code": None, "gone": False}, dict(scope)

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        async def receive_wrapper():
            message = await receive()
            if message["type"] == "http.disconnect":
                status["gone"] = True
            return message

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except asyncio.CancelledError:
            status["gone"] = True
            raise
        finally:
            ep = self._label(scope, original)
            sent = status["code"] or (metrics.CLIENT_CLOSED if status["gone"] else 500)
            metrics.REQUESTS.labels(ep, scope["method"], str(sent)).inc()
            metrics.REQUEST_LATENCY.labels(ep, scope["method"]).observe(time.perf_counter() - t0)


def build_app(profile: Profile, backends: dict[str, Backend]) -> FastAPI:
    """Build the ingress app for ``profile`` with one backend per family present (``vlm``, ``video``, ``tts``).

    Raises KeyError if a family of the profile has no backend."""
    app = FastAPI(title="Chimera", version="0.1.0",
                  description="OpenAI-compatible API for a grafted vision-LLM, video diffusion jobs and speech.")
    app.state.profile = profile
    app.state.backends = backends
    install_error_handlers(app)
    families = profile.families()

    @app.get("/healthz", tags=["ops"])
    async def healthz():
        """Liveness: the ingress answers."""
        return {"status": "ok"}

    ready_states = ReadyStates({f: (lambda f=f: backends[f].call("ready")) for f in families})

    @app.get("/readyz", tags=["ops"])
    async def readyz():
        """200 once every model of the profile is loaded, else 503 listing those that are not; answered within
        about a second even while the deployments start (``services.readiness.ReadyStates``)."""
        states = await ready_states.current()
        not_ready = [families[f].model_id for f, ok in states.items() if not ok]
        body = {"status": "ready" if not not_ready else "loading",
                "models": {families[f].model_id: ("ready" if ok else "loading") for f, ok in states.items()}}
        if not_ready:
            body["error"] = error_body(f"models not loaded yet: {', '.join(not_ready)}", "service_unavailable",
                                       None, "model_not_ready")["error"]
        return JSONResponse(body, status_code=200 if not not_ready else 503)

    @app.get("/metrics", tags=["ops"])
    async def prometheus_metrics():
        """Prometheus text exposition of the ingress metrics (before-scrape hooks refresh gauges first)."""
        await metrics.run_before_scrape()
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", tags=["models"])
    async def list_models():
        """The models this profile serves (OpenAI list shape)."""
        created = int(app.state.started_at)
        return {"object": "list", "data": [
            {"id": s.model_id, "object": "model", "created": created, "owned_by": OWNERS[f]}
            for f, s in families.items()]}

    @app.get("/v1/models/{model_id}", tags=["models"])
    async def get_model(model_id: str):
        """One model by id (404 if unknown)."""
        from .errors import APIError

        for f, s in families.items():
            if s.model_id == model_id:
                return {"id": s.model_id, "object": "model", "created": int(app.state.started_at), "owned_by": OWNERS[f]}
        raise APIError(404, f"model {model_id!r} not found", param="model", code="model_not_found")

    app.state.started_at = time.time()
    for fam, section in families.items():
        app.include_router(family_module(fam).make_router(section, backends[fam], profile))

    mount_playground(app)
    app.add_middleware(MetricsMiddleware, router=app.router)
    app.add_middleware(AuthMiddleware, keys=profile.server.all_api_keys(),
                       protect_metrics=profile.server.metrics_requires_key)
    app.add_middleware(EdgeMiddleware, limits=profile.server.limits.body_limits())
    return app


PLAYGROUND_DIR = Path(__file__).parent / "playground"


def mount_playground(app: FastAPI) -> None:
    """Serve the web playground (``services/playground/``, static files, no build step): ``GET /`` is its page
    and ``/playground/*`` its assets. Only these paths are taken, so ``/v1/*``, ``/healthz``, ``/readyz``,
    ``/metrics`` and ``/docs`` keep their routes, and an unknown path stays an OpenAI-shaped 404."""
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    @app.get("/", include_in_schema=False)
    async def playground_page():
        """The playground's page (``services/playground/index.html``)."""
        return FileResponse(PLAYGROUND_DIR / "index.html", media_type="text/html")

    app.mount("/playground", StaticFiles(directory=PLAYGROUND_DIR), name="playground")


async def json_object(request) -> dict:
    """Read a request body that must be a JSON object (UTF-8 text) and return it.

    Raises APIError 400: ``invalid_json`` for bytes that are not UTF-8, malformed JSON or a non-object body;
    ``invalid_unicode`` (see :func:`reject_invalid_unicode`) for a string, key or value at any depth, that holds
    a lone UTF-16 surrogate (the JSON escape ``"\\ud800"``), which no UTF-8 text can carry."""
    import json

    from .errors import APIError

    raw = await request.body()
    try:
        text = raw.decode("utf-8-sig")  # strict: no invalid bytes, no encoded surrogates; a UTF-8 BOM is skipped
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid JSON: it is not UTF-8 text", code="invalid_json") from None
    try:
        data = json.loads(text or "null")
    except json.JSONDecodeError as err:
        raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    reject_invalid_unicode(data)
    return data


def reject_invalid_unicode(value: Any, path: str = "") -> None:
    """Raise APIError 400 ``invalid_unicode`` if any string in ``value`` (a parsed JSON value: dict keys and values,
    list items, at any depth) cannot be encoded as UTF-8, i.e. holds a lone surrogate code point (U+D800-U+DFFF).

    ``param`` is the field's path, e.g. ``messages[0].content[1].text`` (``path`` prefixes it); a bad key is named
    by its parent's path and the key with the surrogate escaped. Cost: strings that are pure ASCII (base64 images,
    most text) are skipped in O(1); others are scanned once."""
    from core.validate import has_lone_surrogate as bad

    from .errors import APIError

    def fail(where: str, what: str):
        raise APIError(400, f"{where or 'request body'}: {what} holds a lone UTF-16 surrogate, which is not valid "
                            "Unicode text (send UTF-8 text)", param=where or None, code="invalid_unicode")

    stack = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if bad(v):
                fail(where, "the string")
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                if bad(k):
                    safe = k.encode("utf-8", "backslashreplace").decode("utf-8")
                    fail(f"{where}.{safe}" if where else safe, "a key")
                stack.append((item, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            stack.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(v))))


def check_model(profile: Profile, family: str, model: Any, param: str = "model") -> str:
    """Resolve a request's ``model`` for ``family``: None -> the family's model; an unknown id -> 404; another
    family's model -> 400. Returns the model id."""
    from .errors import APIError

    section = getattr(profile, family)
    if model is None:
        return section.model_id
    if not isinstance(model, str):
        raise APIError(400, "model must be a string", param=param, code="invalid_value")
    if model == section.model_id:
        return model
    if model in profile.model_ids():
        raise APIError(400, f"model {model!r} does not serve this endpoint (use {section.model_id!r})", param=param,
                       code="model_not_supported")
    raise APIError(404, f"model {model!r} not found (available: {', '.join(profile.model_ids())})", param=param,
                   code="model_not_found")
