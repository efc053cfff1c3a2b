"""Video generation jobs: ``/v1/videos`` (OpenAI Videos API shape; vLLM-Omni field names accepted).

The router parses JSON or multipart bodies (the ``openai`` SDK sends multipart with ``input_reference`` as a
file, and ``video[id]`` for extensions) and calls the ``Deployment``, which validates the request against
the profile (:func:`video.request.plan_request`) before anything is queued, then hands it to the
:class:`services.job_manager.JobManager` actor. Job state lives in the manager's store, not in this replica.

Request fields: every field is either implemented or refused with 400 ``unsupported_parameter`` naming it
(:func:`video.request.plan_request`; extensions accept ``prompt``, ``seconds``, ``video``, ``model`` and the
generation fields of :data:`_EXTEND_FIELDS`, and keep the source's size, fps and clip length). A value of another
type than the field's (a list, number, object or boolean where the contract has none, null for a required field,
in a form text that is not of the field's type) is 400 ``invalid_value`` naming the field; a text field sent as a
file is 400 ``unexpected_file``. Text that is not
valid Unicode (a lone UTF-16 surrogate escaped in JSON, bytes that are not UTF-8 in a multipart or urlencoded
field) is 400 ``invalid_unicode``.

Bad input never raises out of the deployment (Ray Serve would log each as a replica failure with its
traceback): the deployment returns it as an ``error`` event (:func:`services.chat.input_error_event`) and the
router raises the matching APIError. Every 4xx carries a stable ``code``.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartParser

from core.media import ImageInputError, parse_data_url

from . import metrics
from .app import check_model, reject_invalid_unicode
from .backends import Backend
from .chat import input_error_event, raise_if_error_event
from .errors import APIError, to_api_error, unwrap
from .profiles import FamilySection, Profile

_TERMINAL = ("completed", "failed", "cancelled")
_READS = ("ping", "readiness", "get", "list", "content_path", "record", "queue_length", "extension_source", "running",
          "workers_where", "get_config_hash")  # asked again on a re-acquired manager; writes are not
log = logging.getLogger("chimera")


def _input_errors_as_events(method):
    """Deployment-method decorator: input errors (ValueError, or any exception whose ``status_code`` is 4xx)
    are returned as an ``error`` event dict instead of raised; other exceptions propagate (500, logged)."""

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - sorted below
            exc = unwrap(exc)
            status = getattr(exc, "status_code", None)
            if isinstance(exc, ValueError) or (isinstance(status, int) and 400 <= status < 500):
                return input_error_event(exc)
            raise

    return wrapper


class Deployment:
    """Ray Serve deployment of the video family: validation and the door to the job-manager actor.

    It loads no model itself (each job's Ray task loads the engine, on its own GPU in GPU profiles).
    Errors: RequestError/MediaError (400/413/415) on bad input and JobError (404/409/429) from the manager are
    *returned* as ``{"type": "error", "status", "message", "param", "code"}`` events, not raised.
    """

    def __init__(self, section: dict, model_dir: str):
        from video.config import VideoConfig

        from .job_manager import get_manager

        self.section = FamilySection[VideoConfig].model_validate(section)
        self.cfg = self.section.engine
        self.model_dir = model_dir
        self.manager = get_manager(self.cfg.model_dump(mode="json"), model_dir, self.section.model_id)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the job manager. When its handle fails (``RayActorError``: ActorDiedError when the manager was
        killed for good or replaced by a redeploy, ActorUnavailableError while Ray restarts it), the named
        manager is got again (:func:`services.job_manager.get_manager` with ``replace=False``, off the event loop:
        whichever manager holds the name now, or a new one when none does) and a read
        (:data:`_READS`) asked once more; a write (create, delete) is not repeated, since it may have been
        applied. A write's failure, or a second one, is APIError 503 ``model_unavailable`` (``Retry-After``).
        A caller that went away (Serve cancels this request, and with it the actor call) ends as
        ``asyncio.CancelledError``, which Serve logs as CANCELLED, not as a failed request with a traceback; the
        manager's own errors are unwrapped from Ray's wrapper."""
        import ray

        from .job_manager import get_manager

        try:
            return await self._ask(method, *args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            self.manager = await asyncio.to_thread(get_manager, self.cfg.model_dump(mode="json"), self.model_dir,
                                                   self.section.model_id, replace=False)
            if method not in _READS:
                raise to_api_error(exc) from None
        try:
            return await self._ask(method, *args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            raise to_api_error(exc) from None

    async def _ask(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call of the job manager (see :meth:`_call`); RayActorError passes through as it is."""
        import ray

        try:
            return await getattr(self.manager, method).remote(*args, **kwargs)
        except ray.exceptions.RayActorError:
            raise
        except ray.exceptions.TaskCancelledError:
            raise asyncio.CancelledError() from None
        except Exception as exc:  # noqa: BLE001 - the manager's JobError, unwrapped from Ray's wrapper
            raise unwrap(exc) from None

    async def ready(self) -> bool:
        """True once a job worker holds its loaded engine, False while the workers load
        (:meth:`services.job_manager.JobManager.readiness`: answered from the manager's state, never waiting on a
        load; the manager recovers interrupted jobs on this first contact). Raises EngineUnavailableError (503
        ``engine_unavailable``) naming the cause once every worker has failed to load its engine (after a bounded
        number of restarts; jobs then fail with that code too)."""
        from core.llm_client import EngineUnavailableError

        state = await self._call("readiness")
        if state["error"]:
            raise EngineUnavailableError(state["error"])
        return bool(state["ready"])

    @_input_errors_as_events
    async def create(self, fields: dict, image: bytes | None = None, idempotency_key: str | None = None,
                     owner: str | None = None) -> dict:
        """Validate and queue a generation job. ``image``: uploaded ``input_reference`` bytes (PNG, JPEG, WebP
        or GIF, decoded by :func:`core.media.decode_image`: ImageInputError 413/415/400 otherwise; stored as PNG).
        ``owner``: the creating API key's id (None: no keys configured). Returns
        the Video object (status ``queued``)."""
        from core.media import decode_image
        from video.request import plan_request, seconds_label

        req = plan_request(self.cfg, fields, has_image=image is not None)
        png = None
        if image is not None:
            lim = self.cfg.limits

            def to_png() -> bytes:  # decode + encode: in a worker thread, off the replica's event loop
                buf = io.BytesIO()
                decode_image(image, lim.max_image_pixels, "input_reference", lim.max_image_bytes).save(buf, format="PNG")
                return buf.getvalue()

            png = await asyncio.to_thread(to_png)
        return await self._call("create", req.to_dict(), image_png=png, idempotency_key=idempotency_key,
                                seconds_label=seconds_label(req.total_frames, req.fps), owner=owner)

    @_input_errors_as_events
    async def extend(self, fields: dict, video_id: str | None = None, video: bytes | None = None,
                     idempotency_key: str | None = None, owner: str | None = None) -> dict:
        """Queue an extension of a completed video (``video_id``) or of an uploaded video file (``video``):
        its first clip starts from the source's last frame; the result is the source with the extension
        appended. ``fields``: ``prompt``, ``seconds`` (the added length) and optional generation fields
        (:data:`_EXTEND_FIELDS`; any other field is RequestError ``unsupported_parameter``). The Video object's
        ``seconds`` is the whole joined video's duration (source frames + added frames) / fps. ``owner``: the
        API key's id; a source video of another owner is 404.

        Generation fields an extension of a stored video leaves out (:func:`video.request.plan_request`,
        ``inherit``): ``quality`` is the source's (extending a ``fast`` video stays ``fast``), and so are its
        ``negative_prompt`` and, under the source's quality, its ``num_inference_steps`` and ``guidance_scale``;
        an extension that asks for another ``quality`` gets that quality's defaults (``fast``: the fast
        profile's steps and guidance; ``full``: the profile's). Fields given always win. An uploaded video has
        no stored request: ``quality`` and the rest default as for a new video."""
        from video.drift import color_stats
        from video.media import MediaError, decode_video, probe_video
        from video.request import RequestError, plan_request, seconds_label

        for name in fields:
            if name not in _EXTEND_FIELDS:
                kept = " (an extension keeps the source video's size, fps and clip length)" if name in \
                    ("size", "width", "height", "fps", "num_frames", "input_reference") else ""
                raise RequestError(f"{name} is not supported on a video extension{kept}", str(name),
                                   "unsupported_parameter")
        if video_id is not None:
            src = await self._call("extension_source", video_id, owner=owner)
            base = {"width": src["width"], "height": src["height"], "fps": src["fps"],
                    "num_frames": src["params"]["frames_per_clip"]}
            req = plan_request(self.cfg, {**base, **fields}, continuation=True, inherit=src["params"])
            total = int(src["frames"]) + req.total_frames
            return await self._call("create", req.to_dict(), extend_from=src, idempotency_key=idempotency_key,
                                    seconds_label=seconds_label(total, req.fps), owner=owner)
        if video is None:
            raise RequestError("video is required: {\"id\": <completed video id>} or a video file", "video",
                               "missing_required_parameter")
        lim = self.cfg.limits
        if len(video) > lim.max_video_bytes:
            raise MediaError(f"video is {len(video)} bytes, the limit is {lim.max_video_bytes}", 413, "video")
        max_frames = lim.max_clips * lim.max_frames_per_clip

        def prepare():  # header probe (before any decode), then decode: in a worker thread, off the event loop
            import numpy as np
            import torch

            probe_video(video, max_frames, lim.max_width, lim.max_height, lim.max_pixels)
            frames, fps = decode_video(video, max_frames=max_frames)
            h, w = frames.shape[1:3]
            req = plan_request(self.cfg, {"fps": max(1, round(fps)) if fps else None, **fields, "width": w,
                                          "height": h}, continuation=True)
            floats = torch.from_numpy(frames[: req.frames_per_clip]).permute(0, 3, 1, 2).float() / 255
            last = torch.from_numpy(frames[-1]).permute(2, 0, 1).float().numpy() / 255
            return req, len(frames), {"video": video, "last_frame": np.asarray(last, dtype=np.float32),
                                      "reference": color_stats(floats).to_dict()}

        req, n_frames, upload = await asyncio.to_thread(prepare)
        total = n_frames + req.total_frames
        return await self._call("create", req.to_dict(), upload=upload, idempotency_key=idempotency_key,
                                seconds_label=seconds_label(total, req.fps), owner=owner)

    @_input_errors_as_events
    async def get(self, video_id: str, owner: str | None = None) -> dict:
        """The Video object (404 if unknown, or another owner's)."""
        return await self._call("get", video_id, owner=owner)

    @_input_errors_as_events
    async def list(self, limit: int = 20, after: str | None = None, order: str = "desc",
                   owner: str | None = None) -> dict:
        """Videos newest first (cursor ``after``); with ``owner``, only that key's."""
        return await self._call("list", limit, after, order, owner=owner)

    @_input_errors_as_events
    async def content(self, video_id: str, variant: str = "video", owner: str | None = None) -> dict:
        """Where the MP4 or PNG is: ``{"path": str, "size": int}`` in the shared results directory (the ingress
        streams the file itself; no bytes pass through Ray). An error event: 404 unknown or another owner's,
        409 unless completed."""
        return await self._call("content_path", video_id, variant, owner=owner)

    @_input_errors_as_events
    async def delete(self, video_id: str, owner: str | None = None) -> dict:
        """Cancel (freeing its worker) and delete a job and its files (404 if unknown, already deleted or
        another owner's)."""
        return await self._call("delete", video_id, owner=owner)

    @_input_errors_as_events
    async def record(self, video_id: str) -> dict:
        """The raw job record (params, device): operations and tests."""
        return await self._call("record", video_id)

    async def queue_length(self) -> int:
        """Jobs queued or running, counted in the job store (the ``chimera_video_queue_length`` gauge)."""
        return int(await self._call("queue_length"))


#: The fields of an extension request that reach the deployment (``video`` and ``model`` are taken by the router).
_EXTEND_FIELDS = ("prompt", "seconds", "seed", "num_inference_steps", "guidance_scale", "negative_prompt",
                  "drift_correction", "sparsity", "quality", "cache")


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

    max_file_size = 0  # set per request by _read_body

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


async def _read_body(request: Request, max_bytes: int) -> tuple[dict, dict]:
    """JSON or multipart/urlencoded body -> (fields, files). Each file streams in counted: past ``max_bytes``
    it is APIError 413 ``too_large`` at once (the edge middleware already bounds the whole body).
    Text that is not valid Unicode is APIError 400 ``invalid_unicode``."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/x-www-form-urlencoded":
        from urllib.parse import parse_qsl

        raw = await request.body()
        if len(raw) > max_bytes:
            raise APIError(413, f"form body over {max_bytes} bytes", code="too_large")
        try:
            pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            raise APIError(400, "form body is not UTF-8 text (raw or %-encoded)", code="invalid_unicode") from None
        return dict(pairs), {}
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
                    files[key] = await value.read()
                else:
                    fields[key] = value
        finally:
            await form.close()
        return fields, files
    if ctype in ("application/json", ""):
        try:
            body = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError as exc:
            raise APIError(400, f"body is not valid JSON: {exc.msg}", code="invalid_json") from None
        except UnicodeDecodeError:  # json.loads guesses UTF-8/16/32 from the first bytes, then fails to decode
            raise APIError(400, "body is not valid JSON: it is not UTF-8 text", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "body must be a JSON object", code="invalid_json")
        reject_invalid_unicode(body)
        return body, {}
    raise APIError(415, f"unsupported content type {ctype!r} (use application/json or multipart/form-data)",
                   code="unsupported_media_type")


def _json_type(value: Any) -> str:
    """How a parsed JSON value is named in error messages: ``null``, ``a boolean``, ``a number``, ``a string``,
    ``a list``, or an object with the keys it has."""
    if isinstance(value, dict):
        return f"an object with keys {sorted(map(str, value))}"
    for kind, name in ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
                       (list, "a list")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _required(fields: dict, *names: str) -> None:
    """Raise APIError 400 naming the first of ``names`` absent from ``fields`` (``missing_required_parameter``) or
    null there (``invalid_value``)."""
    for name in names:
        if name not in fields:
            raise APIError(400, f"{name} is required", param=name, code="missing_required_parameter")
        if fields[name] is None:
            raise APIError(400, f"{name} must not be null", param=name, code="invalid_value")


def _only_files(files: dict, allowed: str) -> None:
    """Raise APIError 400 ``unexpected_file`` (``param``: its field) for a file part other than ``allowed``: a
    text field (``prompt``, ``seed``, ...) sent as a file, or a field that takes no file."""
    for name in files:
        if name != allowed:
            raise APIError(400, f"{name} was sent as a file; only {allowed} takes a file (the other fields are "
                                "text)", param=name, code="unexpected_file")


def _reference_image(ref: Any) -> bytes:
    """The image bytes of a JSON or form-field ``input_reference``: ``{"image_url": <base64 data URL>}`` (as a
    JSON value, or that object's JSON text in a form field) or the data URL itself. Raises APIError 400
    (``param`` ``input_reference``): ``invalid_value`` for anything else (a list, number, boolean, or an
    object whose ``image_url`` is missing or not a string, or with another key such as ``file_id``: this
    service has no Files API); for a URL that :func:`core.media.parse_data_url` refuses, its error as an APIError:
    400 ``invalid_image_url`` (not a base64 data URL), 400 ``invalid_base64``, 415 ``unsupported_image_type`` (a
    media type other than ``image/*``)."""
    if isinstance(ref, str):
        try:
            ref = json.loads(ref)
        except json.JSONDecodeError:
            ref = {"image_url": ref}
    if not isinstance(ref, dict):
        why = _json_type(ref)
    elif set(ref) - {"image_url"}:
        why = f"{_json_type(ref)} (only image_url is supported: there is no Files API here)"
    elif not isinstance(ref.get("image_url"), str) or not ref["image_url"]:
        url = ref.get("image_url")
        why = f"an object whose image_url is {'empty' if url == '' else _json_type(url)}"
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


def _observe(obj: dict, seen: set) -> dict:
    if obj.get("status") in _TERMINAL and obj["id"] not in seen and obj.get("completed_at"):
        seen.add(obj["id"])
        if len(seen) > 10000:
            seen.clear()
        metrics.VIDEO_JOB_SECONDS.labels(obj["status"]).observe(max(0, obj["completed_at"] - obj["created_at"]))
    return obj


def make_router(section: FamilySection, raw_backend: Backend, profile: Profile) -> APIRouter:
    """The ``/v1/videos`` endpoints of the video family (see the HTTP contract)."""
    router = APIRouter(tags=["videos"])
    limits = section.engine.limits
    seen: set[str] = set()

    class _Backend:
        """The backend, with every error (raised, or returned as an ``error`` event) turned into an APIError
        here (4xx answered by the APIError handler)."""

        async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
            try:
                out = await raw_backend.call(method, *args, **kwargs)
                if isinstance(out, dict):
                    raise_if_error_event(out)
                return out
            except Exception as exc:  # noqa: BLE001 - mapped to its status (500 only for our bugs)
                err = to_api_error(exc)
                if err.status == 429:
                    err.headers.setdefault("Retry-After", "5")
                raise err from None

    backend = _Backend()

    def key_of(request: Request) -> str | None:
        k = request.headers.get("idempotency-key")
        if k is not None and not (0 < len(k) <= 256):
            raise APIError(400, "Idempotency-Key must be 1-256 characters", param="Idempotency-Key",
                           code="invalid_idempotency_key")
        return k

    def owner_of(request: Request) -> str | None:
        """The API key id of the request (None when no keys are configured): the owner of its jobs."""
        return getattr(request.state, "key_id", None)

    async def refresh_queue() -> None:
        """Set the queue-length gauge from the job store's count (run before every /metrics scrape)."""
        metrics.VIDEO_QUEUE.set(await backend.call("queue_length"))

    async def refresh_queue_quietly() -> None:
        """:func:`refresh_queue` after a video request; its failure never fails the request."""
        try:
            await refresh_queue()
        except Exception as exc:  # noqa: BLE001 - the next scrape refreshes it again
            log.warning("could not refresh the video queue length: %s", exc)

    metrics.before_scrape("video_queue_length", refresh_queue)

    @router.post("/v1/videos")
    async def create_video(request: Request):
        """Create a generation job (text-to-video, or image-to-video with ``input_reference``)."""
        fields, files = await _read_body(request, limits.max_image_bytes)
        _only_files(files, "input_reference")
        _required(fields, "prompt")
        check_model(profile, "video", fields.get("model"))
        image = files.pop("input_reference", None)
        ref = fields.pop("input_reference", None)
        if image is not None and ref is not None:
            raise APIError(400, "input_reference is given twice (a file and a text field)", param="input_reference",
                           code="invalid_value")
        if ref is not None:
            image = _reference_image(ref)
        obj = await backend.call("create", fields, image, key_of(request), owner=owner_of(request))
        metrics.VIDEO_JOBS.inc()
        await refresh_queue_quietly()
        return obj

    @router.post("/v1/videos/extensions")
    async def extend_video(request: Request):
        """Continue a completed video (``video: {"id": ...}``) or an uploaded video file from its last frame."""
        fields, files = await _read_body(request, limits.max_video_bytes)
        _only_files(files, "video")
        _required(fields, "prompt", "seconds")
        check_model(profile, "video", fields.pop("model", None))
        video_id = fields.pop("video[id]", None)
        v = fields.pop("video", None)
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                v = {"id": v}
        if isinstance(v, dict) and not set(v) - {"id"}:
            video_id = v.get("id") or video_id
        elif v is not None:
            raise APIError(400, f"video must be {{\"id\": <video id>}} or a video file, not {_json_type(v)}",
                           param="video", code="invalid_value")
        if video_id is not None and not isinstance(video_id, str):  # e.g. {"id": {...}}: never reaches the store
            raise APIError(400, "video.id must be a string (the id of a completed video)", param="video",
                           code="invalid_value")
        data = files.pop("video", None)
        if video_id is None and data is None:
            raise APIError(400, "video is required: {\"id\": <completed video id>} or a video file", param="video",
                           code="missing_required_parameter")
        obj = await backend.call("extend", fields, video_id, data if video_id is None else None, key_of(request),
                                 owner=owner_of(request))
        metrics.VIDEO_JOBS.inc()
        await refresh_queue_quietly()
        return obj

    @router.get("/v1/videos")
    async def list_videos(request: Request, limit: int = 20, after: str | None = None, order: str = "desc"):
        """Videos, newest first (``order=asc`` oldest first); ``after`` is the last id of the previous page."""
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be between 1 and 100", param="limit", code="invalid_value")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order", code="invalid_value")
        page = await backend.call("list", limit, after, order, owner=owner_of(request))
        for v in page["data"]:
            _observe(v, seen)
        return page

    @router.get("/v1/videos/{video_id}")
    async def get_video(request: Request, video_id: str):
        """One video job (``openai-poll-after-ms`` tells the SDK's ``poll`` how often to ask)."""
        finished = len(seen)
        obj = _observe(await backend.call("get", video_id, owner=owner_of(request)), seen)
        if len(seen) != finished:  # a job just seen finished: the queue is shorter
            await refresh_queue_quietly()
        return JSONResponse(obj, headers={"openai-poll-after-ms": "500"})

    @router.get("/v1/videos/{video_id}/content")
    async def video_content(request: Request, video_id: str, variant: str = "video"):
        """The MP4 (``variant=video``) or PNG thumbnail (``variant=thumbnail``); 409 until completed. Streamed
        from the results directory; a ``Range`` header gets 206 with ``Content-Range`` (several ranges:
        multipart/byteranges), one that the file cannot satisfy 416 ``range_not_satisfiable``."""
        if variant not in ("video", "thumbnail"):
            raise APIError(400, f"variant {variant!r} is not supported (video | thumbnail)", param="variant",
                           code="invalid_value")
        where = await backend.call("content", video_id, variant, owner=owner_of(request))
        path = where["path"]
        try:
            size = (await asyncio.to_thread(os.stat, path)).st_size
        except FileNotFoundError:  # deleted between the manager's answer and now
            raise APIError(404, f"the {variant} of {video_id} is no longer stored", param="video_id",
                           code="content_missing") from None
        if request.headers.get("range") is not None:
            check_range(request.headers["range"], size)
        media = "video/mp4" if variant == "video" else "image/png"
        ext = "mp4" if variant == "video" else "png"
        return FileResponse(path, media_type=media, filename=f"{video_id}.{ext}",
                            content_disposition_type="attachment")

    @router.delete("/v1/videos/{video_id}")
    async def delete_video(request: Request, video_id: str):
        """Cancel (if queued or running; its GPU is freed) and delete the job and its files."""
        out = await backend.call("delete", video_id, owner=owner_of(request))
        await refresh_queue_quietly()
        return JSONResponse(out)

    return router
