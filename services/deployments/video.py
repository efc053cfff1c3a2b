"""The video replica: validation of a generation or extension request against the profile
(:func:`video.request.plan_request`) before anything is queued, and the door to the
:class:`services.jobs.manager.JobManager` actor, which owns job state and the workers that hold the engines.

Bad input never raises out of the replica (Ray Serve would log each as a replica failure with its traceback): it
is returned as an ``error`` event (:func:`services.deployments.events.input_error_event`) and the router raises
the matching APIError.
"""

from __future__ import annotations

import asyncio
import functools
import io
from typing import Any

from ..config.profiles import FamilySection
from ..boundary import unwrap
from .events import input_error_event

_READS = ("ping", "readiness", "get", "list", "content_path", "record", "queue_length", "extension_source", "running",
          "workers_where", "get_config_hash")  # asked again on a re-acquired manager; writes are not


class ManagerUnavailableError(Exception):
    """The job manager actor could not be reached (it died, or Ray is restarting it): answered as HTTP 503
    ``model_unavailable`` with ``Retry-After: 5`` (the attributes :func:`services.api.errors.to_api_error` reads).
    Raised, not returned as an event: it is the service's fault, never the client's."""

    status_code = 503
    code = "model_unavailable"
    param = None
    headers = {"Retry-After": "5"}

    @classmethod
    def of(cls, exc: BaseException) -> "ManagerUnavailableError":
        """The error for the RayActorError ``exc`` (its first 300 characters say why)."""
        return cls(f"the model is not available right now ({str(exc)[:300]})")


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

        from ..jobs.actor import get_manager

        self.section = FamilySection[VideoConfig].model_validate(section)
        self.cfg = self.section.engine
        self.model_dir = model_dir
        self.manager = get_manager(self.cfg.model_dump(mode="json"), model_dir, self.section.model_id)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the job manager. When its handle fails (``RayActorError``: ActorDiedError when the manager was
        killed for good or replaced by a redeploy, ActorUnavailableError while Ray restarts it), the named
        manager is got again (:func:`services.jobs.manager.get_manager` with ``replace=False``, off the event loop:
        whichever manager holds the name now, or a new one when none does) and a read
        (:data:`_READS`) asked once more; a write (create, delete) is not repeated, since it may have been
        applied. A write's failure, or a second one, is :class:`ManagerUnavailableError` (HTTP 503
        ``model_unavailable`` with ``Retry-After``).
        A caller that went away (Serve cancels this request, and with it the actor call) ends as
        ``asyncio.CancelledError``, which Serve logs as CANCELLED, not as a failed request with a traceback; the
        manager's own errors are unwrapped from Ray's wrapper."""
        import ray

        from ..jobs.actor import get_manager

        try:
            return await self._ask(method, *args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            self.manager = await asyncio.to_thread(get_manager, self.cfg.model_dump(mode="json"), self.model_dir,
                                                   self.section.model_id, replace=False)
            if method not in _READS:
                raise ManagerUnavailableError.of(exc) from None
        try:
            return await self._ask(method, *args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            raise ManagerUnavailableError.of(exc) from None

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
        (:meth:`services.jobs.manager.JobManager.readiness`: answered from the manager's state, never waiting on a
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
        (:data:`EXTEND_FIELDS`; any other field is RequestError ``unsupported_parameter``). The Video object's
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
            if name not in EXTEND_FIELDS:
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
EXTEND_FIELDS = ("prompt", "seconds", "seed", "num_inference_steps", "guidance_scale", "negative_prompt",
                  "drift_correction", "sparsity", "quality", "cache")
