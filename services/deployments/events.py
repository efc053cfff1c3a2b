"""The events a model replica streams to the ingress across the Ray process boundary, and how a replica tells the
client's fault (an input error: answered as a 4xx event) from its own (raised: a 5xx).

An input error is never raised out of a replica (Ray would log it as a replica failure): it is the one
``{"type": "error", ...}`` event of the stream; :func:`services.api.errors.raise_if_error_event` turns it back
into the HTTP error at the ingress.
"""

from __future__ import annotations

from core.llm_client import EngineError


def is_input_error(exc: BaseException) -> bool:
    """True for the errors answered as the client's fault (4xx): ValueErrors carrying a 4xx ``status_code``
    (``PromptError``: a malformed conversation, ``ImageInputError``: a bad image, ``EngineRequestError``: a request
    vLLM refused with a 400, e.g. a schema it cannot compile; ``SpeechInputError``)."""
    status = getattr(exc, "status_code", None)
    return isinstance(exc, ValueError) and isinstance(status, int) and 400 <= status < 500


def engine_fault(exc: ValueError) -> Exception:
    """A ValueError from the engine's side that is not an input error (:func:`is_input_error`) as the engine's
    fault: :class:`core.llm_client.EngineError` (HTTP 500 ``engine_error``), never a 400 blaming the client."""
    return EngineError(f"the engine failed: {type(exc).__name__}: {exc}")


def input_error_event(exc: Exception) -> dict:
    """An input error as a stream event: ``{"type": "error", "status", "message", "param", "code"}`` (``status``
    the exception's ``status_code``, 400 when it has none)."""
    return {"type": "error", "status": getattr(exc, "status_code", 400), "message": str(exc),
            "param": getattr(exc, "param", None), "code": getattr(exc, "code", None)}
