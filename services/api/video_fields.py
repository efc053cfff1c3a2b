"""Field checks of the ``/v1/videos`` bodies that are the ingress's own (types, JSON types of a JSON body,
required fields, which part may be a file, ``input_reference`` as a data URL), of
the routes' query parameters and of the content endpoint's ``Range`` header; the generation fields themselves are
checked against the profile by :func:`video.request.plan_request` in the replica."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterable
from typing import Any

from core.media import ImageInputError, parse_data_url

from .body import JSONDuplicateKey, JSONTooDeep, duplicate_error, json_error, parse_json
from .errors import APIError, to_api_error


def json_type(value: Any) -> str:
    """How a parsed JSON value is named in error messages: ``null``, ``a boolean``, ``a number``, ``a string``,
    ``a list``, or an object with the keys it has."""
    if isinstance(value, dict):
        return f"an object with keys {sorted(map(str, value))}"
    for kind, name in ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
                       (list, "a list")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def require(fields: dict, *names: str) -> None:
    """Raise APIError 400 naming the first of ``names`` absent from ``fields`` (``missing_required_parameter``) or
    null there (``invalid_value``)."""
    for name in names:
        if name not in fields:
            raise APIError(400, f"{name} is required", param=name, code="missing_required_parameter")
        if fields[name] is None:
            raise APIError(400, f"{name} must not be null", param=name, code="invalid_value")


def only_files(files: dict, allowed: str) -> None:
    """Raise APIError 400 ``unexpected_file`` (``param``: its field) for a file part other than ``allowed``: a
    text field (``prompt``, ``seed``, ...) sent as a file, or a field that takes no file."""
    for name in files:
        if name != allowed:
            raise APIError(400, f"{name} was sent as a file; only {allowed} takes a file (the other fields are "
                                "text)", param=name, code="unexpected_file")


def _json_kinds() -> dict[str, str]:
    """Field -> the JSON type it must have in a JSON body, read from the annotations of
    :class:`video.request.VideoParams` (the one home of the fields' types): ``int`` an integer, ``float`` a
    number, ``bool`` true/false. ``seconds`` is left out: OpenAI's contract sends it as text (``"4"``)."""
    from video.request import VideoParams

    names = {bool: "a boolean (true or false)", int: "an integer (a JSON number)", float: "a number (a JSON number)"}
    kinds = {}
    for name, info in VideoParams.model_fields.items():
        types = set(typing.get_args(info.annotation) or (info.annotation,)) - {type(None)}
        if name != "seconds" and len(types) == 1 and (kind := types.pop()) in names:
            kinds[name] = names[kind]
    return kinds


#: The JSON types of the generation fields in a JSON body (:func:`_json_kinds`), beyond what pydantic's lax mode
#: enforces there: it would read the text ``"2"`` as 2 and ``"no"`` as false, which only a form (whose values are
#: all text) needs. Text fields (``prompt``, ``size``, ...) are strict already (pydantic never turns a number into
#: text).
JSON_FIELD_TYPES = _json_kinds()


def check_json_types(fields: dict) -> None:
    """Refuse a generation field of a JSON body whose JSON type is not the field's: text (``"2"``, ``"no"``) or a
    boolean for a number, anything but ``true``/``false`` for ``drift_correction`` (:data:`JSON_FIELD_TYPES`;
    null stays "not given" for the optional numbers). Raises APIError 400 ``invalid_value`` naming the field.
    Form bodies are not checked here: their values are text, converted by :func:`video.request.plan_request`."""
    for name, kind in JSON_FIELD_TYPES.items():
        if name not in fields:
            continue
        v = fields[name]
        if kind.startswith("a boolean"):
            ok = isinstance(v, bool)
        else:
            ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
        if not ok:
            raise APIError(400, f"{name} must be {kind}, not {json_type(v)} (in a JSON body values keep their JSON "
                                "type; only form fields are text)", param=name, code="invalid_value")


def check_query(params: Any, allowed: Iterable[str] = ()) -> None:
    """Refuse query parameters a route does not define (``params``: Starlette's ``request.query_params``;
    ``allowed``: the route's own). Raises APIError 400 ``unknown_parameter`` (``param``: its name) for another
    name, and 400 ``duplicate_parameter`` for a name given twice (nothing is silently ignored)."""
    allowed = tuple(allowed)
    seen: set[str] = set()
    for name, _ in params.multi_items():
        if name not in allowed:
            takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
            raise APIError(400, f"unknown query parameter {name[:100]!r} ({takes})", param=name,
                           code="unknown_parameter")
        if name in seen:
            raise duplicate_error(name, "as a query parameter")
        seen.add(name)


def reference_image(ref: Any) -> bytes:
    """The image bytes of a JSON or form-field ``input_reference``: ``{"image_url": <base64 data URL>}`` (as a
    JSON value, or that object's JSON text in a form field) or the data URL itself. Raises APIError 400
    (``param`` ``input_reference``): ``invalid_value`` for anything else (a list, number, boolean, or an
    object whose ``image_url`` is missing or not a string, or with another key such as ``file_id``: this
    service has no Files API); for a URL that :func:`core.media.parse_data_url` refuses, its error as an APIError:
    400 ``invalid_image_url`` (not a base64 data URL), 400 ``invalid_base64``, 415 ``unsupported_image_type`` (a
    media type other than ``image/*``)."""
    if isinstance(ref, str):
        try:
            ref = parse_json(ref)
        except (JSONTooDeep, JSONDuplicateKey) as err:
            raise json_error(err, "input_reference", "input_reference") from None
        except json.JSONDecodeError:
            ref = {"image_url": ref}
    if not isinstance(ref, dict):
        why = json_type(ref)
    elif set(ref) - {"image_url"}:
        why = f"{json_type(ref)} (only image_url is supported: there is no Files API here)"
    elif not isinstance(ref.get("image_url"), str) or not ref["image_url"]:
        url = ref.get("image_url")
        why = f"an object whose image_url is {'empty' if url == '' else json_type(url)}"
    else:
        try:
            return parse_data_url(ref["image_url"], param="input_reference")
        except ImageInputError as err:
            raise to_api_error(err) from None
    raise APIError(400, f"input_reference must be an image file or {{\"image_url\": <data URL string>}}, not {why}",
                   param="input_reference", code="invalid_value")


def check_range(header: str, size: int) -> None:
    """Check an HTTP ``Range`` header against a file of ``size`` bytes before it is served (RFC 9110: ``bytes=``
    then comma-separated ``first-last``, ``first-`` or ``-suffix``). Raises APIError 416
    ``range_not_satisfiable`` (``Content-Range: bytes */size``) for another unit, a malformed spec, a range
    whose first byte is at or past the end, last < first, or a zero suffix."""
    def bad() -> APIError:
        return APIError(416, f"Range {header[:100]!r} cannot be satisfied by a file of {size} bytes",
                        param="Range", code="range_not_satisfiable", headers={"Content-Range": f"bytes */{size}"})

    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or not spec.strip():
        raise bad()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not dash or not (first.isdigit() or last.isdigit()) or (first and not first.isdigit()) \
                or (last and not last.isdigit()):
            raise bad()
        if not first:
            if int(last) == 0:
                raise bad()
        elif int(first) >= size or (last and int(last) < int(first)):
            raise bad()
