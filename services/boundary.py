"""What crosses Ray's process boundary: a user-level exception raised in a Ray actor or Serve replica comes back
wrapped (``RayTaskError``, with the original as its ``cause``); :func:`unwrap` gets it back, wherever it is caught
(the ingress, the video replica, the job manager)."""

from __future__ import annotations


def unwrap(exc: BaseException) -> BaseException:
    """The user-level exception inside a Ray error (``RayTaskError.cause``), else ``exc`` itself."""
    seen = 0
    while getattr(exc, "cause", None) is not None and seen < 5:
        exc = exc.cause
        seen += 1
    return exc
