"""The edge middleware: runs first, in front of everything (also inside Ray Serve's HTTP proxy).

- Strips client-sent ``x-request-timeout-seconds`` / ``x-request-disconnect-disabled``: Ray Serve's proxy would
  let clients lift the server's request timeout and disconnect handling with them.
- Body size limits per route, before the body reaches the app (in the proxy: before it reaches any replica):
  a ``Content-Length`` over the route's limit is answered 413 ``request_too_large`` without passing anything on;
  a body without one (chunked) is read here up to the limit, then handed on whole, or refused the same way the
  moment it passes the limit. Limits come from the profile (``server.limits``, :class:`services.config.profiles.EdgeLimits`);
  in Ray's proxy process from the ``CHIMERA_EDGE_LIMITS`` environment variable, which
  :func:`services.serve_app.init_ray` sets from the profile.
- Rewrites plain-text error bodies (Ray's own 408/429/500/503) into OpenAI's error shape, adding
  ``Retry-After`` to 429/503.
Ray's proxy loads it through ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=services.api.edge:proxy_middlewares``.
"""

from __future__ import annotations

import asyncio
import json
import os

from starlette.middleware import Middleware

STRIPPED_HEADERS = {b"x-request-timeout-seconds", b"x-request-disconnect-disabled"}
_RAY_CODES = {408: ("timeout_error", "request_timeout"), 429: ("rate_limit_error", "queue_full"),
              500: ("server_error", "internal_error"), 503: ("service_unavailable", "model_unavailable")}
#: Environment variable holding the limits as JSON ``{"routes": {path: bytes}, "default": bytes}``.
LIMITS_ENV = "CHIMERA_EDGE_LIMITS"
#: Limits when neither the app nor the environment gives any (the defaults of ``server.limits``).
DEFAULT_LIMITS = {"routes": {"/v1/chat/completions": 20 << 20, "/v1/audio/speech": 1 << 20,
                             "/v1/videos": 24 << 20, "/v1/videos/extensions": 272 << 20}, "default": 1 << 20}
#: A refused body up to this many bytes is read and dropped before the 413 is sent, so that a client still
#: writing it (most HTTP clients read no response before their request is written) receives the 413 instead of
#: a connection reset. Larger ones, and clients that sent ``Expect: 100-continue``, get the 413 at once and the
#: connection is closed; so does a client still sending after :data:`DRAIN_MAX_S` seconds.
DRAIN_MAX_BYTES = 64 << 20
DRAIN_MAX_S = 5.0


def limits_from_env() -> dict:
    """The limits in :data:`LIMITS_ENV` (JSON), or :data:`DEFAULT_LIMITS` when it is unset.

    Raises ValueError if it is set but not a JSON object with ``routes`` (path -> bytes) and ``default``."""
    raw = os.environ.get(LIMITS_ENV)
    if not raw:
        return DEFAULT_LIMITS
    data = json.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("routes"), dict) or not isinstance(data.get("default"), int):
        raise ValueError(f"{LIMITS_ENV} must be a JSON object {{\"routes\": {{path: bytes}}, \"default\": bytes}}")
    return data


def _error(status: int, message: str, etype: str, code: str, extra: list | None = None) -> tuple[dict, dict]:
    body = json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())] + (extra or [])
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body})


class EdgeMiddleware:
    """Pure ASGI middleware (HTTP and WebSocket): header stripping, body size limits, OpenAI-shaped error bodies.

    ``limits``: ``{"routes": {path: max body bytes}, "default": max body bytes}`` (exact paths; every other
    request gets ``default``); None reads :func:`limits_from_env`."""

    def __init__(self, app, limits: dict | None = None):
        self.app = app
        limits = limits_from_env() if limits is None else limits
        self.routes = {str(k): int(v) for k, v in limits["routes"].items()}
        self.default = int(limits["default"])

    def limit_for(self, path: str) -> int:
        """The body limit in bytes of a request to ``path``."""
        return self.routes.get(path.rstrip("/") or "/", self.default)

    async def _refuse(self, send, receive, limit: int, drain: bool) -> None:
        """Send 413 ``request_too_large``; with ``drain``, first read (and drop) the rest of the body."""
        if drain:
            seen = 0
            try:
                async with asyncio.timeout(DRAIN_MAX_S):
                    while seen <= DRAIN_MAX_BYTES:
                        msg = await receive()
                        if msg["type"] != "http.request":
                            return  # the client is gone
                        seen += len(msg.get("body", b""))
                        if not msg.get("more_body"):
                            break
            except TimeoutError:
                drain = False  # a slow sender: answer now and close
        start, body = _error(413, f"request body is over this endpoint's limit of {limit} bytes",
                             "invalid_request_error", "request_too_large",
                             [] if drain else [(b"connection", b"close")])
        await send(start)
        await send(body)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in STRIPPED_HEADERS]
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)

        headers = {k.lower(): v for k, v in scope["headers"]}
        limit = self.limit_for(scope["path"])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                start, body = _error(400, "Content-Length is not a number", "invalid_request_error",
                                     "invalid_content_length", [(b"connection", b"close")])
                await send(start)
                return await send(body)
            if int(length) > limit:
                drain = int(length) <= DRAIN_MAX_BYTES and headers.get(b"expect", b"").lower() != b"100-continue"
                return await self._refuse(send, receive, limit, drain)
        elif b"transfer-encoding" in headers:
            parts, total = [], 0
            while True:
                msg = await receive()
                if msg["type"] != "http.request":
                    return  # the client went away before its body was complete
                total += len(msg.get("body", b""))
                if total > limit:
                    return await self._refuse(send, receive, limit, msg.get("more_body", False))
                parts.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    break
            receive = _replay(b"".join(parts), receive)

        state = {"rewrite": None, "chunks": []}

        async def wrapped_send(message):
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict((k.lower(), v) for k, v in message.get("headers", []))
                ctype = headers.get(b"content-type", b"")
                if status in _RAY_CODES and not ctype.startswith(b"application/json") \
                        and not ctype.startswith(b"text/event-stream"):
                    state["rewrite"] = message
                    return
                return await send(message)
            if message["type"] == "http.response.body" and state["rewrite"] is not None:
                state["chunks"].append(message.get("body", b""))
                if message.get("more_body"):
                    return
                start = state["rewrite"]
                status = start["status"]
                text = b"".join(state["chunks"]).decode("utf-8", "replace").strip() or "error"
                etype, code = _RAY_CODES[status]
                body = json.dumps({"error": {"message": text, "type": etype, "param": None, "code": code}}).encode()
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() not in (b"content-type", b"content-length")]
                headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                if status in (429, 503) and not any(k.lower() == b"retry-after" for k, _ in headers):
                    headers.append((b"retry-after", b"2"))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                return await send({"type": "http.response.body", "body": body})
            return await send(message)

        return await self.app(scope, receive, wrapped_send)


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that returns ``body`` as one message, then defers to ``receive`` (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


def proxy_middlewares() -> list[Middleware]:
    """Callback for Ray Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: the middlewares of its proxy
    (limits from :data:`LIMITS_ENV`)."""
    return [Middleware(EdgeMiddleware)]
