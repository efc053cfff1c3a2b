"""API-key auth for the ingress: bearer tokens on ``/v1/*`` (and ``/metrics`` when the profile protects it), over
HTTP and websockets, and the owner id of a key (the owner of the video jobs it creates)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi.responses import JSONResponse

from .errors import error_body


def key_id(key: str) -> str:
    """The id a job owner is stored under: the first 16 hex digits of SHA-256 of the API key (never the key)."""
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
