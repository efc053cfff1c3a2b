"""Video generation jobs: ``/v1/videos`` (OpenAI Videos API shape; vLLM-Omni field names accepted).

The router parses JSON or multipart bodies (the ``openai`` SDK sends multipart with ``input_reference`` as a
file, and ``video[id]`` for extensions) and calls the video replica (:mod:`services.deployments.video`), which
validates the request against the profile (:func:`video.request.plan_request`) before anything is queued, then
hands it to the :class:`services.jobs.manager.JobManager` actor. Job state lives in the manager's store, not in this
replica.

Request fields: every field is either implemented or refused with 400 ``unsupported_parameter`` naming it
(:func:`video.request.plan_request`; extensions accept ``prompt``, ``seconds``, ``video``, ``model`` and the
generation fields of :data:`services.deployments.video.EXTEND_FIELDS`, and keep the source's size, fps and clip
length). A value of another type than the field's (a list, number, object or boolean where the contract has none,
null for a required field, in a form text that is not of the field's type) is 400 ``invalid_value`` naming the
field; a text field sent as a file is 400 ``unexpected_file``. In a JSON body a generation field keeps its JSON
type (``"fps": "2"`` or ``"drift_correction": "no"`` is 400 ``invalid_value``:
:func:`services.api.video_fields.check_json_types`); form fields are text and are converted. Text that is not
valid Unicode (a lone UTF-16 surrogate escaped in JSON, bytes that are not UTF-8 in a multipart or urlencoded
field) is 400 ``invalid_unicode``. A form field or file given twice is 400 ``duplicate_parameter``
(:func:`services.api.multipart.read_body`); two inputs for one thing (an ``input_reference`` file and text; an
extension's ``video`` as an id and a file, or as both ``video`` and ``video[id]``) are 400 ``invalid_value``. A
query parameter a route does not define is 400 ``unknown_parameter``
(:func:`services.api.video_fields.check_query`). An uploaded video that FFmpeg reads as an image (PNG, GIF, ...) or
another container than a video's is 415 ``unsupported_media_type``
(:func:`video.media.check_video_container`).

Bad input never raises out of the deployment (Ray Serve would log each as a replica failure with its
traceback): the deployment returns it as an ``error`` event (:func:`services.deployments.events.input_error_event`)
and the router raises the matching APIError. Every 4xx carries a stable ``code``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from ..config.profiles import FamilySection, Profile
from ..deployments.backends import Backend
from ..deployments.video import EXTEND_FIELDS
from . import metrics
from .body import JSONDuplicateKey, JSONTooDeep, json_error, parse_json
from .errors import APIError, raise_if_error_event, to_api_error
from .models import check_model
from .multipart import is_form, read_body
from .video_fields import check_json_types, check_query, check_range, json_type, only_files, reference_image, require

_TERMINAL = ("completed", "failed", "cancelled")
log = logging.getLogger("chimera")


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
        """Create a generation job (text-to-video, or image-to-video with ``input_reference``).

        Raises APIError: 400 ``unknown_parameter`` (any query parameter), :func:`read_body`'s errors (400
        ``duplicate_parameter`` for a form field or file given twice), 400 ``unexpected_file``, 400
        ``missing_required_parameter``, 404/400 from :func:`check_model`, 400 ``invalid_value`` for a JSON field
        of another JSON type (:func:`check_json_types`) or an ``input_reference`` given as both a file and text,
        :func:`reference_image`'s errors, and the replica's (:func:`video.request.plan_request`, 429
        ``queue_full``)."""
        check_query(request.query_params)
        fields, files = await read_body(request, limits.max_image_bytes)
        only_files(files, "input_reference")
        require(fields, "prompt")
        check_model(profile, "video", fields.get("model"))
        if not is_form(request):
            check_json_types(fields)
        image = files.pop("input_reference", None)
        ref = fields.pop("input_reference", None)
        if image is not None and ref is not None:
            raise APIError(400, "input_reference is given twice (a file and a text field)", param="input_reference",
                           code="invalid_value")
        if ref is not None:
            image = reference_image(ref)
        obj = await backend.call("create", fields, image, key_of(request), owner=owner_of(request))
        metrics.VIDEO_JOBS.inc()
        await refresh_queue_quietly()
        return obj

    @router.post("/v1/videos/extensions")
    async def extend_video(request: Request):
        """Continue a completed video (``video: {"id": ...}``) or an uploaded video file from its last frame.

        Raises APIError: 400 ``unknown_parameter`` (any query parameter), :func:`read_body`'s errors (400
        ``duplicate_parameter`` for a form field or file given twice), 400 ``unexpected_file``, 400
        ``missing_required_parameter`` (no prompt, seconds or video), 404/400 from :func:`check_model`, 400
        ``invalid_value`` for a JSON field of another JSON type (:func:`check_json_types`), for a ``video`` that is
        neither ``{"id": <string>}`` nor a file, and for a video given twice (two of: ``video`` as an id or object,
        ``video[id]``, a ``video`` file); 415 ``unsupported_media_type`` for an uploaded file that is an image or
        not a video container (:func:`video.media.check_video_container`); and the replica's (404
        ``video_not_found``, 409 ``video_not_ready``, the upload's 413/415, :func:`video.request.plan_request`, 429
        ``queue_full``)."""
        check_query(request.query_params)
        fields, files = await read_body(request, limits.max_video_bytes)
        only_files(files, "video")
        require(fields, "prompt", "seconds")
        check_model(profile, "video", fields.pop("model", None))
        if not is_form(request):  # a field an extension does not take is the replica's unsupported_parameter
            check_json_types({k: v for k, v in fields.items() if k in EXTEND_FIELDS})
        video_id = fields.pop("video[id]", None)
        v = fields.pop("video", None)
        data = files.pop("video", None)
        sent = [what for what, x in (("video as an id", v), ("video[id]", video_id), ("a video file", data))
                if x is not None]
        if len(sent) > 1:
            raise APIError(400, f"video is given more than once ({' and '.join(sent)}); send one of them: "
                                "{\"id\": <completed video id>} (multipart: video[id]) or a video file",
                           param="video", code="invalid_value")
        if isinstance(v, str):
            try:
                v = parse_json(v)
            except (JSONTooDeep, JSONDuplicateKey) as err:
                raise json_error(err, "video", "video") from None
            except json.JSONDecodeError:
                v = {"id": v}
        if isinstance(v, dict) and not set(v) - {"id"}:
            video_id = v.get("id") or None
        elif v is not None:
            raise APIError(400, f"video must be {{\"id\": <video id>}} or a video file, not {json_type(v)}",
                           param="video", code="invalid_value")
        if video_id is not None and not isinstance(video_id, str):  # e.g. {"id": {...}}: never reaches the store
            raise APIError(400, "video.id must be a string (the id of a completed video)", param="video",
                           code="invalid_value")
        if video_id is None and data is None:
            raise APIError(400, "video is required: {\"id\": <completed video id>} or a video file", param="video",
                           code="missing_required_parameter")
        if data is not None:  # an image is refused here, before anything is queued (the replica probes it again)
            from video.media import MediaError, check_video_container

            try:
                await asyncio.to_thread(check_video_container, data)
            except MediaError as err:
                raise to_api_error(err) from None
        obj = await backend.call("extend", fields, video_id, data, key_of(request), owner=owner_of(request))
        metrics.VIDEO_JOBS.inc()
        await refresh_queue_quietly()
        return obj

    @router.get("/v1/videos")
    async def list_videos(request: Request, limit: int = 20, after: str | None = None, order: str = "desc"):
        """Videos, newest first (``order=asc`` oldest first); ``after`` is the last id of the previous page.

        Raises APIError 400: ``unknown_parameter`` for a query parameter other than ``limit``, ``after`` and
        ``order``, ``duplicate_parameter`` for one given twice, ``invalid_value`` for ``limit`` outside 1-100 or
        another ``order``; 404 ``video_not_found`` for an unknown ``after``."""
        check_query(request.query_params, ("limit", "after", "order"))
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
        """One video job (``openai-poll-after-ms`` tells the SDK's ``poll`` how often to ask).

        Raises APIError: 400 ``unknown_parameter`` (any query parameter), 404 ``video_not_found``."""
        check_query(request.query_params)
        finished = len(seen)
        obj = _observe(await backend.call("get", video_id, owner=owner_of(request)), seen)
        if len(seen) != finished:  # a job just seen finished: the queue is shorter
            await refresh_queue_quietly()
        return JSONResponse(obj, headers={"openai-poll-after-ms": "500"})

    @router.get("/v1/videos/{video_id}/content")
    async def video_content(request: Request, video_id: str, variant: str = "video"):
        """The MP4 (``variant=video``) or PNG thumbnail (``variant=thumbnail``); 409 until completed. Streamed
        from the results directory; a ``Range`` header gets 206 with ``Content-Range`` (several ranges:
        multipart/byteranges), one that the file cannot satisfy 416 ``range_not_satisfiable``.

        Raises APIError: 400 ``unknown_parameter`` for a query parameter other than ``variant`` (400
        ``duplicate_parameter`` given twice), 400 ``invalid_value`` for another variant, 404 ``video_not_found``
        or ``content_missing``, 409 ``video_not_ready``, 416 ``range_not_satisfiable``."""
        check_query(request.query_params, ("variant",))
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
        """Cancel (if queued or running; its GPU is freed) and delete the job and its files.

        Raises APIError: 400 ``unknown_parameter`` (any query parameter), 404 ``video_not_found``."""
        check_query(request.query_params)
        out = await backend.call("delete", video_id, owner=owner_of(request))
        await refresh_queue_quietly()
        return JSONResponse(out)

    return router
