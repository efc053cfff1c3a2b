"""Reading a body that may be a form: ``multipart/form-data`` (the ``openai`` SDK sends files that way),
``application/x-www-form-urlencoded`` or JSON (:func:`services.api.body.json_object`), with strict UTF-8 text
fields, per-file size caps counted as the parts stream in, and no field or file given twice."""

from __future__ import annotations

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartParser

from .body import duplicate_error, json_object
from .errors import APIError


class _NotUtf8(Exception):
    """A text field of a form body whose bytes are not UTF-8 (``field``: its name)."""

    def __init__(self, field: str):
        super().__init__(field)
        self.field = field


class _FileTooLarge(Exception):
    """A file part of a form body passed its cap while it streamed in (``field``: its name)."""

    def __init__(self, field: str, cap: int):
        super().__init__(field)
        self.field, self.cap = field, cap


class _Utf8MultiPartParser(MultiPartParser):
    """Starlette's multipart parser, except that a text field whose bytes are not UTF-8 raises :class:`_NotUtf8`
    (Starlette decodes such a field as latin-1 and passes the mojibake on), and that a file part is counted as it
    streams in: past ``max_file_size`` bytes (a file of exactly ``max_file_size`` bytes passes) it raises
    :class:`_FileTooLarge` at once (nothing more is spooled)."""

    max_file_size = 0  # set per request by read_body

    def on_part_begin(self) -> None:
        super().on_part_begin()
        self._file_bytes = 0  # our own count: UploadFile.size grows only as Starlette writes the spooled chunks

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._current_part
        if part.file is not None:
            self._file_bytes += end - start
            if self._file_bytes > self.max_file_size:
                raise _FileTooLarge(part.field_name, self.max_file_size)
        super().on_part_data(data, start, end)

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode("utf-8")
            except UnicodeDecodeError:
                raise _NotUtf8(part.field_name) from None
        super().on_part_end()


def _unicode_error(field: str) -> APIError:
    return APIError(400, f"{field} is not valid Unicode text (a lone UTF-16 surrogate, or bytes that are not UTF-8)",
                    param=field, code="invalid_unicode")


def content_type(request: Request) -> str:
    """The request's media type, lower case, without parameters (``""`` when there is no ``Content-Type``)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def is_form(request: Request) -> bool:
    """Whether :func:`read_body` reads ``request`` as a form (multipart or urlencoded), whose values are all text
    (or files), rather than as JSON, whose values have JSON types."""
    return content_type(request) in ("multipart/form-data", "application/x-www-form-urlencoded")


async def read_body(request: Request, max_bytes: int) -> tuple[dict, dict]:
    """JSON or multipart/urlencoded body -> (fields, files). Each file streams in counted: past ``max_bytes``
    it is APIError 413 ``too_large`` at once (the edge middleware already bounds the whole body).
    Raises APIError: 400 ``invalid_unicode`` for text that is not valid Unicode; 400 ``duplicate_parameter``
    (``param``: its name) for a form field given twice, or two files under one name (nothing is silently
    dropped: one text field and one file of the same name are both returned, for the route to judge); 400
    ``invalid_body`` for a malformed multipart body; 415 ``unsupported_media_type`` for another content type;
    and :func:`services.api.body.json_object`'s errors for a JSON body."""
    ctype = content_type(request)
    if ctype == "application/x-www-form-urlencoded":
        from urllib.parse import parse_qsl

        raw = await request.body()
        if len(raw) > max_bytes:
            raise APIError(413, f"form body over {max_bytes} bytes", code="too_large")
        try:
            pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            raise APIError(400, "form body is not UTF-8 text (raw or %-encoded)", code="invalid_unicode") from None
        fields = {}
        for key, value in pairs:
            if key in fields:
                raise duplicate_error(key, "as two form fields")
            fields[key] = value
        return fields, {}
    if ctype == "multipart/form-data":
        parser = _Utf8MultiPartParser(request.headers, request.stream(), max_part_size=max_bytes, max_files=8,
                                      max_fields=64)
        parser.max_file_size = max_bytes
        try:
            form = await parser.parse()
        except _NotUtf8 as err:
            raise _unicode_error(err.field) from None
        except _FileTooLarge as err:
            raise APIError(413, f"{err.field}: upload over {err.cap} bytes", param=err.field,
                           code="too_large") from None
        except Exception as exc:  # noqa: BLE001 - malformed multipart
            raise APIError(400, f"could not parse the form body: {getattr(exc, 'message', exc)}",
                           code="invalid_body") from None
        fields, files = {}, {}
        try:
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if key in files:
                        raise duplicate_error(key, "as two files")
                    files[key] = await value.read()
                else:
                    if key in fields:
                        raise duplicate_error(key, "as two form fields")
                    fields[key] = value
        finally:
            await form.close()
        return fields, files
    if ctype in ("application/json", ""):
        return await json_object(request), {}
    raise APIError(415, f"unsupported content type {ctype!r} (use application/json or multipart/form-data)",
                   code="unsupported_media_type")
