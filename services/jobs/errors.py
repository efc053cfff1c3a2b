"""The job system's client-facing error (404 unknown id, 409 wrong state, 429 queue full)."""

from __future__ import annotations


class JobError(Exception):
    """An error answered to the client: ``status_code`` 404 unknown id, 409 wrong state, 429 queue full."""

    def __init__(self, status_code: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param

    def __reduce__(self):  # crosses Ray process boundaries intact
        return (type(self), (self.status_code, str(self), self.code, self.param))
