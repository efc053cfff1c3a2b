"""The edge middleware: runs first, in front of everything (also inside Ray Serve's HTTP proxy).

- Strips client-sent ``x-request-timeout-seconds`` / ``x-request-disconnect-disabled``: Ray Serve's proxy would
  let clients lift the server's request timeout and disconnect handling with them.
- Rewrites plain-text error bodies (Ray's own 408/429/500/503) into OpenAI's error shape, adding
  ``Retry-After`` to 429/503.
Ray's proxy loads it through ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=services.edge:proxy_middlewares``.
"""

from __future__ import annotations

import json

from starlette.middleware import Middleware

STRIPPED_HEADERS = {b"x-request-timeout-seconds", b"x-request-disconnect-disabled"}
_RAY_CODES = {408: ("timeout_error", "request_timeout"), 429: ("rate_limit_error", "queue_full"),
              500: ("server_error", "internal_error"), 503: ("service_unavailable", "model_unavailable")}


class EdgeMiddleware:
    """Pure ASGI middleware (HTTP and WebSocket): header stripping + OpenAI-shaped error bodies."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in STRIPPED_HEADERS]
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)

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


def proxy_middlewares() -> list[Middleware]:
    """Callback for Ray Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: the middlewares of its proxy."""
    return [Middleware(EdgeMiddleware)]
