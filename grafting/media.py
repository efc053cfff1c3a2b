"""Decoding images from OpenAI ``image_url`` parts (base64 data URLs, optionally allowed remote hosts).

Accepted: PNG, JPEG, WebP, GIF (first frame). The pixel count is checked from the header before any pixel is
decoded, so decompression bombs are refused cheaply.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from urllib.parse import urlparse

from PIL import Image, UnidentifiedImageError

ACCEPTED_FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,(?P<data>.*)$",
                       re.DOTALL)


class ImageInputError(ValueError):
    """A bad image input. ``status_code``: 400 (malformed, refused URL), 413 (too large), 415 (not an
    accepted image type); ``param`` names the offending request field; ``code`` is a stable error code."""

    def __init__(self, message: str, status_code: int = 400, code: str = "invalid_image", param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param


def decode_image_bytes(data: bytes, max_pixels: int, param: str | None = None) -> Image.Image:
    """Decode encoded image bytes into an RGB ``PIL.Image`` (GIF: first frame).

    Raises ImageInputError: 415 if not PNG/JPEG/WebP/GIF, 413 if width*height > ``max_pixels`` (checked from
    the header, before decoding), 400 if the file is truncated or corrupt.
    """
    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError):
        raise ImageInputError("the data is not a recognised image (PNG, JPEG, WebP or GIF)", 415,
                              "unsupported_image_type", param) from None
    except Image.DecompressionBombError:
        raise ImageInputError("image is too large to decode", 413, "image_too_large", param) from None
    if img.format not in ACCEPTED_FORMATS:
        raise ImageInputError(f"image format {img.format} is not accepted (PNG, JPEG, WebP, GIF)", 415,
                              "unsupported_image_type", param)
    w, h = img.size
    if w * h > max_pixels:
        raise ImageInputError(f"image is {w}x{h} = {w * h} pixels, over the limit of {max_pixels}", 413,
                              "image_too_large", param)
    if w == 0 or h == 0:
        raise ImageInputError("image has zero width or height", 400, "invalid_image", param)
    try:
        img.seek(0)
        img.load()
        return img.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ImageInputError(f"image could not be decoded (truncated or corrupt): {err}", 400,
                              "invalid_image", param) from None


def load_image_url(url: str, max_bytes: int, max_pixels: int, allowed_hosts: list[str] | tuple = (),
                   param: str | None = None, timeout_s: float = 10.0) -> Image.Image:
    """Turn an ``image_url.url`` into an RGB image.

    ``data:`` URLs must be base64. ``http(s)://`` URLs are fetched only if their host is in ``allowed_hosts``.
    Raises ImageInputError (400 malformed or refused, 413 over ``max_bytes``/``max_pixels``, 415 not an image;
    a fetch that fails, whether refused, timed out, unresolvable or answered other than 200, is 400
    ``image_fetch_failed``).
    """
    if not isinstance(url, str) or not url:
        raise ImageInputError("image_url.url must be a non-empty string", 400, "invalid_image_url", param)
    if url.startswith("data:"):
        m = _DATA_URL.match(url)
        if not m or not m.group("b64"):
            raise ImageInputError("image data URL must look like data:image/png;base64,<data>", 400,
                                  "invalid_image_url", param)
        mime = (m.group("mime") or "").lower()
        if mime and not mime.startswith("image/"):
            raise ImageInputError(f"data URL media type {mime} is not an image", 415, "unsupported_image_type", param)
        payload = m.group("data")
        if len(payload) * 3 // 4 > max_bytes + 3:
            raise ImageInputError(f"image is larger than the limit of {max_bytes} bytes", 413, "image_too_large", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageInputError("image data URL is not valid base64", 400, "invalid_base64", param) from None
        return decode_image_bytes(data, max_pixels, param)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        if parsed.hostname not in set(allowed_hosts):
            raise ImageInputError("remote image URLs are not allowed here; send the image as a base64 data URL", 400,
                                  "remote_image_not_allowed", param)
        import httpx

        try:
            with httpx.stream("GET", url, timeout=timeout_s, follow_redirects=False) as resp:
                if resp.status_code != 200:
                    raise ImageInputError(f"fetching the image failed with HTTP {resp.status_code}", 400,
                                          "image_fetch_failed", param)
                chunks, total = [], 0
                for chunk in resp.iter_bytes():
                    total += len(chunk)
                    if total > max_bytes:
                        raise ImageInputError(f"image is larger than the limit of {max_bytes} bytes", 413,
                                              "image_too_large", param)
                    chunks.append(chunk)
        except httpx.TimeoutException:
            raise ImageInputError(f"fetching the image timed out after {timeout_s:g} s", 400, "image_fetch_failed",
                                  param) from None
        except httpx.HTTPError as err:  # refused, DNS failure, TLS error, broken connection
            raise ImageInputError(f"fetching the image failed: {type(err).__name__}", 400, "image_fetch_failed",
                                  param) from None
        return decode_image_bytes(b"".join(chunks), max_pixels, param)
    raise ImageInputError("image_url.url must be a base64 data URL (data:image/...;base64,...)", 400,
                          "invalid_image_url", param)
