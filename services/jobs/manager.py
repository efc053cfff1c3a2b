"""Video jobs: the job-manager Ray actor, and one Ray task per job.

- :class:`JobManager`: a (detached, named) Ray actor, the one writer of the :class:`services.jobs.store.JobStore`.
  At start it creates ``jobs.workers`` :class:`services.jobs.runner.JobWorker` actors (owned by it, so they die
  with it), each asking Ray for ``gpus_per_job`` GPUs (1 in GPU profiles; 0 on the cpu profile) and holding its
  engine on the GPU it was given (why one long-lived actor per GPU: see :mod:`services.jobs.runner`). Jobs wait
  in the manager, first in first out, for an idle worker; a worker runs one job at a time, so one job owns one
  GPU. Cancel kills the job's worker (its GPU is free at once) and a fresh worker takes its slot; a worker that
  dies mid-job fails the job (``worker_died``) and is replaced the same way.
- Engine loading: a worker's slot takes jobs only once its engine has loaded (:meth:`JobManager.readiness`, the
  video deployment's ``ready``, says so). A worker whose engine does not load (a missing or broken checkpoint)
  is started again at most ``load_attempts`` times in a row (:data:`ENGINE_LOAD_ATTEMPTS`), then its slot is
  given up; once every slot is given up, readiness reports the cause and every waiting or new job fails with
  ``engine_unavailable`` naming it (no new worker per job).
- Expiry: a finished job (completed or failed) expires ``jobs.ttl_s`` after it finished (``expires_at``); from
  then on it is gone, exactly like a deleted one (404 ``video_not_found``), and its record and files are removed:
  on access, and by a sweep of every expired job on each create, list and manager start.
- The manager is restarted by Ray when it dies (:func:`services.jobs.actor.get_manager`: ``max_restarts=-1``); the restarted one
  applies the restart recovery below on first contact. :func:`services.jobs.actor.get_manager` replaces a running manager whose
  configuration differs (a redeploy with a changed profile) instead of reusing it.
- Restart recovery (documented behaviour): when a manager starts on an existing store, jobs that were
  ``in_progress`` become ``failed`` with error code ``interrupted`` (their partial work is lost; the client
  may resubmit); ``queued`` jobs, which never started, are launched again. Completed jobs and their files stay.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from .errors import JobError
from .slots import WorkerSlots
from .store import ACTIVE, JobStore, request_hash, video_object

log = logging.getLogger("chimera")

#: How many times in a row a slot's worker is started when its engine does not load before the slot is given up
#: (a missing checkpoint fails the same way every time; a transient failure rarely twice).
ENGINE_LOAD_ATTEMPTS = 3


class JobManager(WorkerSlots):
    """Owns the store and the job workers, and runs each job on one (wrap with ``ray.remote``; see
    :func:`services.jobs.actor.get_manager`).

    ``engine_cfg``: the video engine config (dict); ``model_dir``: the profile's model dir; ``model_id``: the
    public model id; ``load_attempts``: worker starts per slot in a row whose engine does not load before the slot
    is given up; ``clock``: seconds since the epoch (``time.time``; tests inject one to cross ``expires_at``
    without waiting). All methods return plain dicts (Video objects) or raise :class:`JobError`.
    """

    def __init__(self, engine_cfg: dict, model_dir: str, model_id: str, load_attempts: int = ENGINE_LOAD_ATTEMPTS,
                 clock: Callable[[], float] = time.time):
        from video.config import VideoConfig

        self.cfg = VideoConfig.model_validate(engine_cfg)
        self.cfg_json = self.cfg.model_dump_json()
        self.model_dir = model_dir
        self.model_id = model_id
        jobs = self.cfg.jobs
        url = jobs.store_url
        if url.startswith("sqlite:///") and not url.startswith("sqlite:////") and url != "sqlite:///:memory:":
            url = "sqlite:///" + str(Path(model_dir) / url[len("sqlite:///"):])
        res = Path(jobs.results_dir)
        self.store = JobStore(url, res if res.is_absolute() else Path(model_dir) / res)
        self.config_hash = config_hash(engine_cfg, model_dir, model_id)
        self.clock = clock
        self.load_attempts = load_attempts
        self.watchers: dict[str, asyncio.Task] = {}  # job id -> its task (waiting for a worker, or running)
        self.busy: dict[str, int] = {}  # job id -> the slot of the worker running it
        # slots of idle workers with a loaded engine (waiting jobs are served FIFO); None once every slot is given up
        self.idle: asyncio.Queue[int | None] = asyncio.Queue()
        self.slot_state = ["loading"] * jobs.workers  # loading | ready | failed (given up)
        self.starts = [0] * jobs.workers  # workers started per slot
        self.load_failures = [0] * jobs.workers  # engine loads failed in a row per slot
        self.load_errors: list[str | None] = [None] * jobs.workers  # the last one's cause
        self.engine_error: str | None = None  # set once every slot is given up
        self._loading: set[asyncio.Task] = set()
        self._watching_loads = False  # the load watches start on first contact (they need the event loop)
        self.workers = [None] * jobs.workers
        for slot in range(jobs.workers):
            self._start_worker(slot)
        self._recovered = False
        self._recover_lock = asyncio.Lock()  # one recovery at a time; the others wait for its outcome
        self._last_created = self.store.latest_created_at()
        self._create_lock = asyncio.Lock()  # idempotency check + queue check + insert, as one step

    @staticmethod
    async def _io(fn, *args: Any, **kwargs: Any) -> Any:
        """Run blocking store or file work (SQLite, the results directory) in a worker thread, off the actor's
        event loop, which keeps answering other calls meanwhile."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    @staticmethod
    def scoped_key(idempotency_key: str, owner: str | None) -> str:
        """The stored form of an ``Idempotency-Key``: as sent without an owner; with one (an API key id),
        ``<owner>:<sha256 of the key>``, so two keys never share an idempotency key."""
        import hashlib

        return idempotency_key if owner is None else f"{owner}:{hashlib.sha256(idempotency_key.encode()).hexdigest()}"

    def _created_at(self) -> float:
        """Now (wall clock, s), but strictly after every job already stored: creation order is list order."""
        now = max(self.clock(), self._last_created + 1e-3)
        self._last_created = now
        return now

    # -- lifecycle
    def _handle(self):
        import ray

        return ray.get_runtime_context().current_actor

    async def recover(self) -> dict:
        """Apply the restart policy once (see module doc), purge expired jobs and start watching the workers'
        engine loads. Returns counts (zeros once done). Concurrent first calls wait for one recovery; one that
        fails half-way raises and is tried again in full by the next call (the store updates it made are not
        repeated: those jobs are no longer ``in_progress``)."""
        zeros = {"interrupted": 0, "requeued": 0, "expired": 0}
        if self._recovered:
            return zeros
        async with self._recover_lock:
            if self._recovered:
                return zeros
            self._watch_loads()
            now = self.clock()
            interrupted = await self._io(self.store.with_status, "in_progress")
            for row in interrupted:
                await self._io(self.store.update, row["id"], status="failed", phase=row["phase"],
                               error_code="interrupted",
                               error_message="the service stopped while this job was running; submit it again",
                               completed_at=now, expires_at=now + self.cfg.jobs.ttl_s)
            queued = await self._io(self.store.with_status, "queued")
            expired = await self._sweep()
            await self._io(self.store.remove_tombstones)
            for row in queued:  # last: nothing after a launch can fail, so a retry never launches a job twice
                self._launch(row)
            self._recovered = True
            return {"interrupted": len(interrupted), "requeued": len(queued), "expired": expired}

    async def _sweep(self) -> int:
        """Remove every expired job (record and files); returns how many."""
        ids = await self._io(self.store.expired, self.clock())
        for job_id in ids:
            await self._io(self.store.delete, job_id)
        return len(ids)

    async def ping(self) -> bool:
        """Liveness (and the first-contact restart recovery)."""
        await self.recover()
        return True

    async def readiness(self) -> dict:
        """Whether a job can run now, answered from the manager's state at once (never waits on a load; applies
        the first-contact recovery): ``{"ready": bool (a worker holds its loaded engine), "workers": int,
        "loaded": int (slots whose engine loaded), "starts": [int] (workers started per slot), "error": str |
        None (set once every slot is given up: the cause; jobs then fail ``engine_unavailable``)}``."""
        await self.recover()
        loaded = self.slot_state.count("ready")
        return {"ready": loaded > 0, "workers": len(self.workers), "loaded": loaded, "starts": list(self.starts),
                "error": self.engine_error}

    # -- submit
    async def create(self, request: dict, image_png: bytes | None = None, extend_from: dict | None = None,
                     upload: dict | None = None, idempotency_key: str | None = None,
                     seconds_label: str | None = None, owner: str | None = None) -> dict:
        """Queue a validated job (``request``: a VideoRequest dict; ``image_png``: image-to-video input).

        Extensions pass ``extend_from`` (from :meth:`extension_source`) or ``upload`` (an uploaded source video:
        ``{"video": mp4 bytes, "last_frame": float32 (3, H, W) array, "reference": ColorStats dict}``).
        An ``idempotency_key`` seen before with the same canonical request (:func:`request_hash`) returns that
        job; with a different request it raises JobError(409, ``idempotency_key_reused``). Raises JobError(429)
        when ``max_queued`` jobs are unfinished. ``owner``: the creating API key's id (None without keys); the
        job is visible to that owner only, and idempotency keys are scoped to it (:meth:`scoped_key`)."""
        await self.recover()
        await self._sweep()
        async with self._create_lock:
            return await self._create(request, image_png, extend_from, upload, idempotency_key, seconds_label,
                                      owner)

    async def _create(self, request: dict, image_png: bytes | None, extend_from: dict | None, upload: dict | None,
                      idempotency_key: str | None, seconds_label: str | None, owner: str | None) -> dict:
        digest = await self._io(request_hash, request, image_png, extend_from, upload, seconds_label)
        if idempotency_key:
            idempotency_key = self.scoped_key(idempotency_key, owner)
            prev = await self._io(self.store.by_key, idempotency_key)
            if prev is not None:
                if prev.get("request_hash") not in (None, digest):
                    raise JobError(409, "this Idempotency-Key was already used with a different request; use a "
                                        "new key for a new request", "idempotency_key_reused", "Idempotency-Key")
                return video_object(prev)
        if await self._io(self.store.count_active) >= self.cfg.jobs.max_queued:
            raise JobError(429, f"{self.cfg.jobs.max_queued} video jobs are already queued or running; retry later",
                           "queue_full")
        job_id = "video_" + uuid.uuid4().hex
        jd = self.store.job_dir(job_id)

        def write_inputs() -> None:
            jd.mkdir(parents=True, exist_ok=True)
            if image_png is not None:
                (jd / "input.png").write_bytes(image_png)
            if upload is not None:
                import numpy as np

                (jd / "source.mp4").write_bytes(upload["video"])
                np.save(jd / "source_last_frame.npy", np.asarray(upload["last_frame"], dtype=np.float32))

        await self._io(write_inputs)
        if upload is not None:
            extend_from = {"id": None, "video": str(jd / "source.mp4"), "reference": upload["reference"],
                           "last_frame": str(jd / "source_last_frame.npy")}
        if seconds_label is None:
            from video.request import VideoRequest, seconds_label as label

            planned = VideoRequest.from_dict(request)
            seconds_label = label(planned.total_frames, planned.fps)
        params = {"request": request, "image": image_png is not None, "extend": extend_from,
                  "gpus_per_job": self.cfg.jobs.gpus_per_job}
        row = await self._io(self.store.insert, dict(
            id=job_id, created_at=self._created_at(), model=self.model_id, status="queued", phase="queued",
            progress=0, clips_total=request["num_clips"], clips_done=0, prompt=request["prompt"],
            seconds=seconds_label,            size=f"{request['width']}x{request['height']}", params=params, idempotency_key=idempotency_key,
            request_hash=digest if idempotency_key else None,
            remixed_from=(extend_from or {}).get("id"), owner=owner))
        self._launch(row)
        return video_object(row)

    # -- reports from job tasks
    async def started(self, job_id: str, where: dict) -> None:
        """From the job's worker: where it runs (:meth:`services.jobs.runner.JobWorker.where`). Stored as
        ``device`` (the worker's ``CUDA_VISIBLE_DEVICES``, or ``cpu`` without one), ``engine_device`` (the torch
        device of the engine's weights) and ``worker_pid``."""
        await self._io(self.store.update_if_active, job_id, status="in_progress", phase="denoising",
                       started_at=self.clock(), device=str(where["cuda_visible_devices"] or "cpu"),
                       engine_device=str(where["engine_device"]), worker_pid=int(where["pid"]))

    async def progress(self, job_id: str, phase: str, percent: int, clips_done: int) -> None:
        """From the job task: phase and integer percent (capped at 99 until the result is stored)."""
        await self._io(self.store.update_if_active, job_id, status="in_progress", phase=phase,
                       progress=min(99, int(percent)), clips_done=int(clips_done))

    # -- queries
    async def _row(self, job_id: str, param: str = "video_id", owner: str | None = None) -> dict:
        """The store row of ``job_id``. Raises JobError(404) when there is none, when it has expired (it is
        removed then, record and files), or when ``owner`` is given and the job belongs to someone else (another
        key's job, like an expired one, looks exactly like a missing one)."""
        row = await self._io(self.store.get, job_id)
        if row is not None and row["expires_at"] is not None and row["expires_at"] <= self.clock() \
                and row["status"] not in ACTIVE:
            await self._io(self.store.delete, job_id)
            row = None
        if row is None or (owner is not None and row.get("owner") != owner):
            raise JobError(404, f"no video with id {job_id!r}", "video_not_found", param)
        return row

    async def get(self, job_id: str, owner: str | None = None) -> dict:
        """The Video object. Raises JobError(404) (also for another owner's job)."""
        await self.recover()
        return video_object(await self._row(job_id, owner=owner))

    async def record(self, job_id: str, owner: str | None = None) -> dict:
        """The raw store row (params and device included): for the service and tests."""
        return await self._row(job_id, owner=owner)

    async def list(self, limit: int = 20, after: str | None = None, order: str = "desc",
                   owner: str | None = None) -> dict:
        """A page of Video objects: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``; with
        ``owner``, only that owner's jobs. Expired jobs are swept first, so none is listed."""
        await self.recover()
        await self._sweep()
        try:
            rows = await self._io(self.store.list, limit + 1, after, order, owner)
        except LookupError:
            raise JobError(404, f"no video {after!r} (after)", "video_not_found", "after") from None
        data = [video_object(r) for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    async def content_path(self, job_id: str, variant: str = "video", owner: str | None = None) -> dict:
        """Where the MP4 or PNG of a completed job is: ``{"path": absolute path, "size": bytes}``; the ingress
        streams it from the (shared) results directory, so no file passes through this actor. Raises JobError
        404 (unknown, another owner's, or the file is gone: ``content_missing``) / 409 (not completed)."""
        row = await self._row(job_id, owner=owner)
        if row["status"] != "completed":
            raise JobError(409, f"video {job_id} is {row['status']}, not completed", "video_not_ready")
        name = {"video": "video.mp4", "thumbnail": "thumbnail.png"}[variant]
        path = (self.store.job_dir(job_id) / name).resolve()
        try:
            size = (await self._io(path.stat)).st_size
        except FileNotFoundError:
            raise JobError(404, f"the {variant} of {job_id} is no longer stored", "content_missing") from None
        return {"path": str(path), "size": int(size)}

    async def extension_source(self, job_id: str, owner: str | None = None) -> dict:
        """What an extension of a completed job needs: paths of its MP4 and float last frame, its drift
        reference, size and fps. Raises JobError 404 / 409 (``param`` ``video``: the request field naming it)."""
        row = await self._row(job_id, "video", owner)
        if row["status"] != "completed":
            raise JobError(409, f"video {job_id} is {row['status']}; only completed videos can be extended",
                           "video_not_ready", "video")
        jd = self.store.job_dir(job_id)
        meta = json.loads(await self._io((jd / "meta.json").read_text))
        return {"id": job_id, "video": str(jd / "video.mp4"), "last_frame": str(jd / "last_frame.npy"),
                "reference": meta["reference"], "width": meta["width"], "height": meta["height"],
                "fps": meta["fps"], "frames": meta["frames"], "seconds": row["seconds"],
                "params": row["params"]["request"]}

    async def delete(self, job_id: str, owner: str | None = None) -> dict:
        """Cancel a queued/running job (its worker is killed: the GPU is free at once) and delete its record
        and files. Raises JobError(404) for unknown (or already deleted, or another owner's) ids."""
        await self._row(job_id, owner=owner)
        await self._io(self.store.update_if_active, job_id, status="cancelled", error_code=None)
        slot = self.busy.pop(job_id, None)
        if slot is not None:
            self._replace_worker(slot)
        w = self.watchers.pop(job_id, None)
        if w is not None:
            w.cancel()
        await self._io(self.store.delete, job_id)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    async def queue_length(self) -> int:
        """Jobs queued or running, as the store has them (the ``chimera_video_queue_length`` gauge)."""
        return await self._io(self.store.count_active)

    async def running(self) -> list[str]:
        """Ids of jobs waiting for a worker or running on one."""
        return list(self.watchers)

    async def workers_where(self) -> list[dict]:
        """:meth:`services.jobs.runner.JobWorker.where` of each worker, by slot (a busy worker answers when its
        job ends)."""
        return list(await asyncio.gather(*(w.where.remote() for w in self.workers)))

    async def get_config_hash(self) -> str:
        """The :func:`config_hash` this manager was started with."""
        return self.config_hash


def config_hash(engine_cfg: dict, model_dir: str, model_id: str) -> str:
    """sha256 (hex) of a manager's configuration: the video engine config, model dir and model id."""
    import hashlib

    canon = json.dumps({"engine": engine_cfg, "model_dir": str(model_dir), "model_id": model_id}, sort_keys=True,
                       default=str)
    return hashlib.sha256(canon.encode()).hexdigest()
