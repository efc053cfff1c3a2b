"""The one reader of a JSON request body (strict UTF-8, a JSON object, no lone surrogates at any depth), used by
every JSON endpoint; ``multipart/form-data`` bodies are read by :mod:`services.api.multipart`."""

from __future__ import annotations

import json
from typing import Any

from core.validate import has_lone_surrogate

from .errors import APIError


async def json_object(request) -> dict:
    """Read a request body that must be a JSON object (UTF-8 text) and return it.

    Raises APIError 400: ``invalid_json`` for bytes that are not UTF-8, malformed JSON or a non-object body;
    ``invalid_unicode`` (see :func:`reject_invalid_unicode`) for a string, key or value at any depth, that holds
    a lone UTF-16 surrogate (the JSON escape ``"\\ud800"``), which no UTF-8 text can carry."""
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
    bad = has_lone_surrogate

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
