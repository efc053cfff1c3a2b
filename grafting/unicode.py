"""The model side's one check for text that is not valid Unicode (used by ``audio/`` and ``video/`` too).

A JSON string may carry a lone UTF-16 surrogate (the escape ``"\\ud800"``); Python decodes it into a ``str``
that no UTF-8 encoder, and so no tokenizer, accepts. The services side walks requests itself, to raise HTTP
errors that name the exact key (``services.app.reject_invalid_unicode``, with :func:`has_lone_surrogate`): model
code never imports ``services/``.
"""

from __future__ import annotations

from typing import Any


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
