"""The one reader of a JSON request body (strict UTF-8, a JSON object, nested at most :data:`MAX_JSON_DEPTH`
levels, no lone surrogates at any depth), used by every JSON endpoint, and of any other JSON text a client sends
(websocket events, JSON in form fields: :func:`parse_json`); ``multipart/form-data`` bodies are read by
:mod:`services.api.multipart`."""

from __future__ import annotations

import json
from typing import Any

from core.validate import has_lone_surrogate

from .errors import APIError


#: The deepest nesting of arrays and objects accepted in any JSON a client sends. An OpenAI request nests ~5 levels
#: (messages[].content[].image_url.url), a json_schema response format a few dozen; deeper JSON gets 400
#: ``invalid_json``, long before Python's parser or a validator could run out of recursion (a 500, or a dropped
#: websocket, otherwise).
MAX_JSON_DEPTH = 128


class JSONTooDeep(ValueError):
    """JSON text nested deeper than :data:`MAX_JSON_DEPTH` levels (a ValueError, like json.JSONDecodeError)."""


class JSONDuplicateKey(ValueError):
    """A JSON object that names one key twice (``key``: which): JSON parsers keep the last value silently."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} is given more than once in one object")
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        raise JSONDuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def parse_json(text: str) -> Any:
    """``json.loads(text)``, refusing nesting deeper than :data:`MAX_JSON_DEPTH` arrays and objects and objects
    that name a key twice.

    Raises json.JSONDecodeError for malformed JSON, :class:`JSONDuplicateKey` for a key given twice in one object
    (RFC 8259 leaves that to the parser; Python's keeps the last value, which would ignore a field silently) and
    :class:`JSONTooDeep` for too deep a nesting (all ValueErrors); the nesting is measured on the parsed value
    without recursion, and text nested so deep that the parser itself runs out of recursion is refused the same
    way."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise JSONTooDeep(f"arrays and objects nested deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise JSONTooDeep(f"arrays and objects nested deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((item, depth + 1) for item in (v.values() if isinstance(v, dict) else v))
    return value


def duplicate_error(name: str, where: str) -> APIError:
    """APIError 400 ``duplicate_parameter`` (``param``: ``name``) for a field, file, key or query parameter given
    more than once ``where`` (e.g. "in the request body", "as two form fields"): the one answer of every reader
    that refuses to keep the last value silently."""
    return APIError(400, f"{name} is given more than once {where}; send it once", param=name,
                    code="duplicate_parameter")


def json_error(err: ValueError, what: str, param: str | None = None) -> APIError:
    """The APIError 400 for :func:`parse_json`'s ``err`` on the JSON text of ``what`` (``param``: its field, None
    for the body): ``duplicate_parameter`` naming the repeated key (``param.key``) for :class:`JSONDuplicateKey`,
    ``invalid_json`` for anything else."""
    if isinstance(err, JSONDuplicateKey):
        return duplicate_error(f"{param}.{err.key}" if param else err.key, f"in {what}")
    return APIError(400, f"{what} is not valid JSON: {err}", param=param, code="invalid_json")


async def json_object(request) -> dict:
    """Read a request body that must be a JSON object (UTF-8 text) and return it.

    Raises APIError 400: ``invalid_json`` for bytes that are not UTF-8, malformed JSON or a non-object body;
    nesting deeper than :data:`MAX_JSON_DEPTH`; ``duplicate_parameter`` (``param``: the key) for a key given twice
    in one object, at any depth; ``invalid_unicode`` (see :func:`reject_invalid_unicode`) for a string, key or
    value at any depth, that holds a lone UTF-16 surrogate (the JSON escape ``"\\ud800"``), which no UTF-8 text
    can carry."""
    raw = await request.body()
    try:
        text = raw.decode("utf-8-sig")  # strict: no invalid bytes, no encoded surrogates; a UTF-8 BOM is skipped
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid JSON: it is not UTF-8 text", code="invalid_json") from None
    try:
        data = parse_json(text or "null")
    except ValueError as err:
        raise json_error(err, "the request body") from None
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
