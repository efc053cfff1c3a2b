"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Routers raise :class:`APIError`; engines raise ``ValueError`` (400) or exceptions carrying ``status_code``;
FastAPI's 422 validation bodies become 400 in this shape; anything else is a 500 (our bug) and is logged.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..boundary import unwrap

log = logging.getLogger("chimera")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error",
               415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI error body.

    ``headers`` (e.g. ``Retry-After`` on 429) are added to the response."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error body."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Ray's errors for a replica's worker that died under a request (its memory monitor's kill included): the
# engine's fault and passing, so 503 with Retry-After (Serve replaces the replica), not a 500
RAY_WORKER_LOST = ("RayActorError", "WorkerCrashedError", "OutOfMemoryError", "NodeDiedError")


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to an :class:`APIError` (ValueError and ``status_code`` carriers -> 4xx, Ray's
    back-pressure -> 429, unavailable -> 503 (a deployment without replicas, or a replica's worker lost under the
    request: :data:`RAY_WORKER_LOST`, Ray's own classes only), the rest -> 500)."""
    exc = unwrap(exc)
    if isinstance(exc, APIError):
        return exc
    name = type(exc).__name__
    if name == "BackPressureError":  # Ray Serve's max_queued_requests reached
        retry = getattr(exc, "retry_after_s", None) or 2
        return APIError(429, "the model's queue is full; retry later", code="queue_full",
                        headers={"Retry-After": str(max(1, round(retry)))})
    if name in ("DeploymentUnavailableError", "ActorDiedError", "ActorUnavailableError") or (
            name in RAY_WORKER_LOST and type(exc).__module__.startswith("ray.")):
        if name in RAY_WORKER_LOST:
            log.error("model unavailable: %s: %s", name, str(exc)[:300])
        return APIError(503, "the model is not available right now", code="model_unavailable",
                        headers={"Retry-After": "5"})
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:
        if status >= 500:
            log.error("model failure: %s", exc)
        return APIError(status, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None),
                        headers=dict(h) if isinstance(h := getattr(exc, "headers", None), dict) else None)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))
    log.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {name}", type="server_error", code="internal_error")


def error_response(err: APIError) -> JSONResponse:
    """A JSONResponse for an APIError."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error from ``app`` OpenAI-shaped (422 -> 400 included)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}" for e in errs)
        return error_response(APIError(400, msg or "invalid request", param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = None
        if exc.status_code == 404 and msg == "Not Found":
            msg, code = f"no route {request.method} {request.url.path}", "route_not_found"
        if exc.status_code == 405:
            msg, code = f"method {request.method} not allowed on {request.url.path}", "method_not_allowed"
        return error_response(APIError(exc.status_code, msg, code=code, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        return error_response(to_api_error(exc))


def raise_if_error_event(event: dict) -> None:
    """Raise the APIError carried by an ``error`` event of a replica's stream
    (:func:`services.deployments.events.input_error_event`); any other event passes."""
    if event.get("type") == "error":
        raise APIError(event["status"], event["message"], param=event.get("param"), code=event.get("code"))
