"""Input checks every family shares: the :class:`InputError` base, text that is not valid Unicode, the seed range.

A JSON string may carry a lone UTF-16 surrogate (the escape ``"\\ud800"``); Python decodes it into a ``str``
that no UTF-8 encoder, and so no tokenizer, accepts. The services side walks requests itself, to raise HTTP
errors that name the exact key (``services.api.app.reject_invalid_unicode``, with :func:`has_lone_surrogate`): model
code never imports ``services/``.
"""

from __future__ import annotations

from typing import Any

#: A seed is an integer with ``|seed| < SEED_LIMIT`` (what torch's generators and vLLM's int64 seeds take); the
#: one seed range of chat, speech and video requests and of the speech config's ``seed``.
SEED_LIMIT = 2**63


def _rebuild(cls: type, message: str, param: str | None, code: str | None, status_code: int) -> InputError:
    err = cls.__new__(cls)
    ValueError.__init__(err, message)
    err.param, err.code, err.status_code = param, code, status_code
    return err


class InputError(ValueError):
    """Bad client input: the base of every family's request error (``PromptError``, ``ImageInputError``,
    ``SpeechInputError``, ``RequestError``, ``MediaError``). The service answers it with HTTP ``status_code``
    (400 unless given: 413 too large, 415 unsupported media) and an OpenAI error body naming ``param`` (the request
    field, or None) with the stable ``code`` (or None). Pickles with all three kept, whatever a subclass's
    ``__init__`` takes (it crosses Ray's process boundaries)."""

    status_code: int = 400
    param: str | None = None
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status_code: int | None = None):
        super().__init__(message)
        self.param, self.code = param, code
        if status_code is not None:
            self.status_code = status_code

    def __reduce__(self):
        return (_rebuild, (type(self), str(self), self.param, self.code, self.status_code))


def check_seed(seed: Any, error: type[InputError] = InputError, param: str = "seed") -> int | None:
    """``seed`` itself when it is None or an integer (not a bool) with ``|seed| < 2**63``
    (:data:`SEED_LIMIT`). Raises ``error(message, param, "invalid_value")`` (an :class:`InputError` subclass
    taking ``(message, param, code)``; HTTP 400) otherwise."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise error(f"'{param}' must be an integer", param, "invalid_value")
    if not -SEED_LIMIT < seed < SEED_LIMIT:
        raise error(f"'{param}' must be between -(2**63 - 1) and 2**63 - 1", param, "invalid_value")
    return seed


def check_max_tokens(max_tokens: Any, limit: int, error: type[InputError] = InputError,
                     param: str = "max_tokens") -> int:
    """``max_tokens`` itself when it is an integer (not a bool) from 1 to ``limit``; else raises
    ``error("max_tokens must be an integer from 1 to <limit>", param, "invalid_value")`` (HTTP 400). The one
    check of a chat request's token budget: the chat router and ``VLMEngine.sampling_params`` both call it."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= limit:
        raise error(f"{param} must be an integer from 1 to {limit}", param, "invalid_value")
    return max_tokens


def check_messages(messages: Any, error: type[InputError] = InputError) -> list:
    """``messages`` itself when it is a non-empty list; else raises ``error("messages must be a non-empty list",
    "messages", "empty_messages")`` (HTTP 400). The one check of a chat request's message list: the chat router
    and ``grafting.processor.GraftProcessor`` both call it."""
    if not isinstance(messages, list) or not messages:
        raise error("messages must be a non-empty list", "messages", "empty_messages")
    return messages


def has_lone_surrogate(s: str) -> bool:
    """True when ``s`` cannot be encoded as UTF-8 (it holds a lone surrogate, U+D800-U+DFFF). Pure-ASCII strings
    are answered in O(1); others are encoded once. The one test both sides use."""
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def find_invalid_unicode(value: Any, path: str = "") -> str | None:
    """Path (``text``, ``session.voice``, ``items[2]``) of the first string in ``value`` (a parsed JSON value:
    keys, values, items at any depth) that cannot be encoded as UTF-8, i.e. holds a lone UTF-16 surrogate; for a
    bad key, the path of the object holding it. None when every string is valid Unicode text. Pure-ASCII
    strings are skipped in O(1); others are encoded once."""
    def bad(s: Any) -> bool:
        return isinstance(s, str) and has_lone_surrogate(s)

    if isinstance(value, str):
        return (path or "value") if bad(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        sub = f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else str(k))
        if bad(k):
            return path or "value"
        found = find_invalid_unicode(v, sub)
        if found:
            return found
    return None
