"""Decoding client images: the one decoder (:func:`decode_image`), the one data-URL parser
(:func:`parse_data_url`) and OpenAI ``image_url`` parts (:func:`load_image_url`: data URLs, optionally allowed
remote hosts). Used by chat (``grafting.processor``) and by video's ``input_reference`` alike.

One format policy: PNG, JPEG, WebP, GIF (first frame); the pixel count is checked from the header before any
pixel is decoded, so decompression bombs are refused cheaply. One error-code set (:class:`ImageInputError`):
415 ``unsupported_image_type`` (not one of those formats, or a data URL whose media type is not ``image/*``),
413 ``image_too_large`` (over the byte or pixel limit, or a decompression bomb), 400 ``invalid_image``
(truncated or corrupt, zero width or height), 400 ``invalid_image_url`` (not a base64 data URL), 400
``invalid_base64``, 400 ``remote_image_not_allowed`` and ``image_fetch_failed`` (remote URLs).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

from .validate import InputError

ACCEPTED_FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,(?P<data>.*)$",
                       re.DOTALL)


class ImageInputError(InputError):
    """A bad image input. ``status_code``: 400 (malformed, refused URL), 413 (too large), 415 (not an
    accepted image type); ``param`` names the offending request field; ``code`` is one of the module's codes."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_image", status_code: int = 400):
        super().__init__(message, param, code, status_code)


def decode_image(data: bytes, max_pixels: int, param: str | None = None, max_bytes: int | None = None) -> Image.Image:
    """Decode encoded image bytes into an RGB ``PIL.Image`` (GIF: first frame).

    Raises ImageInputError: 413 ``image_too_large`` if ``len(data) > max_bytes`` (when given) or width*height >
    ``max_pixels`` (checked from the header, before decoding), 415 ``unsupported_image_type`` if not
    PNG/JPEG/WebP/GIF, 400 ``invalid_image`` if the file is truncated or corrupt or has no pixels.
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise ImageInputError(f"image is {len(data)} bytes, over the limit of {max_bytes}", param, "image_too_large",
                              413)
    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError):
        raise ImageInputError("the data is not a recognised image (PNG, JPEG, WebP or GIF)", param,
                              "unsupported_image_type", 415) from None
    except Image.DecompressionBombError:
        raise ImageInputError("image is too large to decode", param, "image_too_large", 413) from None
    if img.format not in ACCEPTED_FORMATS:
        raise ImageInputError(f"image format {img.format} is not accepted (PNG, JPEG, WebP, GIF)", param,
                              "unsupported_image_type", 415)
    w, h = img.size
    if w * h > max_pixels:
        raise ImageInputError(f"image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels}", param,
                              "image_too_large", 413)
    if w == 0 or h == 0:
        raise ImageInputError("image has zero width or height", param, "invalid_image", 400)
    try:
        img.seek(0)
        img.load()
        return img.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ImageInputError(f"image could not be decoded (truncated or corrupt): {err}", param,
                              "invalid_image", 400) from None


def parse_data_url(url: str, max_bytes: int | None = None, param: str | None = None) -> bytes:
    """The bytes of a base64 ``data:`` URL (``data:image/png;base64,<data>``; the media type may be left out, and
    ``;key=value`` parameters may precede ``;base64``).

    Raises ImageInputError: 400 ``invalid_image_url`` (not a data URL, or not base64), 415
    ``unsupported_image_type`` (a media type other than ``image/*``), 413 ``image_too_large`` (the payload
    decodes to more than ``max_bytes``, judged from its length before decoding), 400 ``invalid_base64``.
    """
    m = _DATA_URL.match(url) if isinstance(url, str) else None
    if not m or not m.group("b64"):
        raise ImageInputError("image data URL must look like data:image/png;base64,<data>", param,
                              "invalid_image_url", 400)
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise ImageInputError(f"data URL media type {mime} is not an image", param, "unsupported_image_type", 415)
    payload = m.group("data")
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes + 3:
        raise ImageInputError(f"image is larger than the limit of {max_bytes} bytes", param, "image_too_large", 413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("image data URL is not valid base64", param, "invalid_base64", 400) from None


def load_image_url(url: str, max_bytes: int, max_pixels: int, allowed_hosts: list[str] | tuple = (),
                   param: str | None = None, timeout_s: float = 10.0) -> Image.Image:
    """Turn an ``image_url.url`` into an RGB image.

    ``data:`` URLs must be base64 (:func:`parse_data_url`). ``http(s)://`` URLs are fetched only if their host is
    in ``allowed_hosts``. Raises ImageInputError (400 malformed or refused, 413 over ``max_bytes``/``max_pixels``,
    415 not an image; a fetch that fails, whether refused, timed out, unresolvable or answered other than 200, is
    400 ``image_fetch_failed``).
    """
    if not isinstance(url, str) or not url:
        raise ImageInputError("image_url.url must be a non-empty string", param, "invalid_image_url", 400)
    if url.startswith("data:"):
        return decode_image(parse_data_url(url, max_bytes, param), max_pixels, param)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        if parsed.hostname not in set(allowed_hosts):
            raise ImageInputError("remote image URLs are not allowed here; send the image as a base64 data URL",
                                  param, "remote_image_not_allowed", 400)
        import httpx

        try:
            with httpx.stream("GET", url, timeout=timeout_s, follow_redirects=False) as resp:
                if resp.status_code != 200:
                    raise ImageInputError(f"fetching the image failed with HTTP {resp.status_code}", param,
                                          "image_fetch_failed", 400)
                chunks, total = [], 0
                for chunk in resp.iter_bytes():
                    total += len(chunk)
                    if total > max_bytes:
                        raise ImageInputError(f"image is larger than the limit of {max_bytes} bytes", param,
                                              "image_too_large", 413)
                    chunks.append(chunk)
        except httpx.TimeoutException:
            raise ImageInputError(f"fetching the image timed out after {timeout_s:g} s", param,
                                  "image_fetch_failed", 400) from None
        except httpx.HTTPError as err:  # refused, DNS failure, TLS error, broken connection
            raise ImageInputError(f"fetching the image failed: {type(err).__name__}", param, "image_fetch_failed",
                                  400) from None
        return decode_image(b"".join(chunks), max_pixels, param)
    raise ImageInputError("image_url.url must be a base64 data URL (data:image/...;base64,...)", param,
                          "invalid_image_url", 400)
