"""Video jobs: the job-manager Ray actor, and one Ray task per job.

- :class:`JobManager`: a (detached, named) Ray actor, the one writer of the :class:`services.job_store.JobStore`.
  At start it creates ``jobs.workers`` :class:`services.job_runner.JobWorker` actors (owned by it, so they die
  with it), each asking Ray for ``gpus_per_job`` GPUs (1 in GPU profiles; 0 on the cpu profile) and holding its
  engine on the GPU it was given (why one long-lived actor per GPU: see :mod:`services.job_runner`). Jobs wait
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
- The manager is restarted by Ray when it dies (:func:`get_manager`: ``max_restarts=-1``); the restarted one
  applies the restart recovery below on first contact. :func:`get_manager` replaces a running manager whose
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

from .job_store import ACTIVE, JobStore, request_hash, video_object

log = logging.getLogger("chimera")

#: How many times in a row a slot's worker is started when its engine does not load before the slot is given up
#: (a missing checkpoint fails the same way every time; a transient failure rarely twice).
ENGINE_LOAD_ATTEMPTS = 3


class JobError(Exception):
    """An error answered to the client: ``status_code`` 404 unknown id, 409 wrong state, 429 queue full."""

    def __init__(self, status_code: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param

    def __reduce__(self):  # crosses Ray process boundaries intact
        return (type(self), (self.status_code, str(self), self.code, self.param))


# ---- the manager actor ---------------------------------------------------------------------------------------
class JobManager:
    """Owns the store and the job workers, and runs each job on one (wrap with ``ray.remote``; see
    :func:`get_manager`).

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
            raise JobError(429, f"{self.cfg.jobs.max_queued} video jobs are already queued; retry later",
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

    def _new_worker(self):
        """A fresh JobWorker actor (its engine loads at once, on the GPU Ray gives it)."""
        import ray

        from .job_runner import JobWorker

        jobs = self.cfg.jobs
        return ray.remote(JobWorker).options(num_gpus=jobs.gpus_per_job, num_cpus=jobs.cpus_per_job,
                                             max_restarts=0, max_concurrency=1).remote(
            self.cfg_json, self.model_dir, jobs.gpus_per_job)

    def _start_worker(self, slot: int) -> None:
        """Put a fresh worker in ``slot``; the slot takes jobs once its engine has loaded (:meth:`_load`)."""
        self.workers[slot] = self._new_worker()
        self.starts[slot] += 1
        self.slot_state[slot] = "loading"
        if self._watching_loads:
            self._spawn_load(slot)

    def _watch_loads(self) -> None:
        """Start watching the engine load of every slot's worker (once; first contact, on the event loop)."""
        if not self._watching_loads:
            self._watching_loads = True
            for slot in range(len(self.workers)):
                self._spawn_load(slot)

    def _spawn_load(self, slot: int) -> None:
        task = asyncio.get_running_loop().create_task(self._load(slot, self.workers[slot]))
        self._loading.add(task)
        task.add_done_callback(self._loading.discard)

    async def _load(self, slot: int, worker) -> None:
        """Wait for ``worker``'s engine. Loaded: the slot takes jobs. Not loaded (an error, or the process died
        while loading): the worker is killed and another started, unless ``load_attempts`` in a row failed; then
        the slot is given up, and once every slot is, :attr:`engine_error` is set and the waiting jobs woken."""
        import ray

        try:
            error = (await worker.status.remote())["error"]
        except ray.exceptions.RayActorError as exc:
            error = f"the worker process died while loading the engine: {type(exc).__name__}: {exc}"[:2000]
        if self.workers[slot] is not worker:  # replaced meanwhile (a cancel killed it)
            return
        if error is None:
            self.load_failures[slot] = 0
            self.slot_state[slot] = "ready"
            self.idle.put_nowait(slot)
            return
        self.load_failures[slot] += 1
        self.load_errors[slot] = error
        ray.kill(worker, no_restart=True)
        if self.load_failures[slot] < self.load_attempts:
            self._start_worker(slot)
            return
        self.slot_state[slot] = "failed"
        log.error("video job worker %d: the engine did not load %d times in a row, slot given up: %s", slot,
                  self.load_failures[slot], error)
        if all(st == "failed" for st in self.slot_state):
            self.engine_error = (f"no video job worker could load its engine ({self.load_failures[slot]} "
                                 f"attempts per worker): {error}")
            self.idle.put_nowait(None)  # wakes the waiting jobs: each fails and passes it on

    def _replace_worker(self, slot: int) -> None:
        """Kill the worker in ``slot`` (no restart: its GPU is free at once) and put a fresh one there."""
        import ray

        ray.kill(self.workers[slot], no_restart=True)
        self._start_worker(slot)

    def _launch(self, row: dict) -> None:
        if row["id"] not in self.watchers:
            self.watchers[row["id"]] = asyncio.get_running_loop().create_task(self._watch(row))

    async def _watch(self, row: dict) -> None:
        """Wait for an idle worker, run the job there, record the outcome; the worker's slot is given back."""
        import ray

        job_id, slot, worker = row["id"], None, None
        ttl = self.cfg.jobs.ttl_s
        try:
            from video.request import seconds_label

            slot = await self.idle.get()
            if slot is None:  # every slot was given up: pass the wake-up on to the next waiting job
                self.idle.put_nowait(None)
                from core.llm_client import EngineUnavailableError

                raise EngineUnavailableError(self.engine_error)
            worker = self.workers[slot]
            if not await self._io(self.store.update_if_active, job_id, status="queued"):  # deleted while it waited
                return
            self.busy[job_id] = slot
            result = await worker.run.remote(job_id, str(self.store.job_dir(job_id)), row["params"], self._handle())
            now = self.clock()
            row = await self._io(self.store.get, job_id)
            await self._io(self.store.update_if_active, job_id, status="completed", phase="encoding", progress=100,
                           seconds=seconds_label(result["frames"], result["fps"]),
                           clips_done=row["clips_total"] if row else 0, completed_at=now,
                           expires_at=now + ttl, worker_started_at=result["started"],
                           worker_finished_at=result["finished"])
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
            if self.workers[slot] is worker:  # not already replaced by a cancel
                self._replace_worker(slot)
            now = self.clock()
            await self._io(self.store.update_if_active, job_id, status="failed", error_code="worker_died",
                           error_message=f"the job's worker stopped: {type(exc).__name__}: {exc}"[:2000],
                           completed_at=now, expires_at=now + ttl)
        except Exception as exc:  # noqa: BLE001 - recorded on the job
            from services.errors import unwrap

            cause = unwrap(exc)
            code = getattr(cause, "code", None) or ("invalid_input" if isinstance(cause, ValueError)
                                                    else "generation_failed")
            now = self.clock()
            await self._io(self.store.update_if_active, job_id, status="failed", error_code=str(code),
                           error_message=f"{type(cause).__name__}: {cause}"[:2000], completed_at=now,
                           expires_at=now + ttl)
        finally:
            self.busy.pop(job_id, None)
            self.watchers.pop(job_id, None)
            if slot is not None and self.workers[slot] is worker:  # a replaced worker's slot returns once loaded
                self.idle.put_nowait(slot)

    # -- reports from job tasks
    async def started(self, job_id: str, where: dict) -> None:
        """From the job's worker: where it runs (:meth:`services.job_runner.JobWorker.where`). Stored as
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
        import ray

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
        """:meth:`services.job_runner.JobWorker.where` of each worker, by slot (a busy worker answers when its
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


def get_manager(engine_cfg: dict, model_dir: str, model_id: str, replace: bool = True, ceiling_s: float = 60.0):
    """The named, detached JobManager actor of this profile with this configuration. Blocking (call it off an
    event loop).

    Detached: it outlives the Serve replica that created it (jobs keep running through a replica restart).
    ``max_restarts=-1``: Ray restarts it when it dies, with the same arguments. A running manager whose
    :func:`config_hash` differs from this configuration's (a redeploy with a changed profile) is killed and a
    new one created in its place; its running jobs are then recovered as interrupted (module doc).
    ``replace=False`` (a replica re-acquiring its lost handle): any live manager of that name is returned as it
    is, so a replica of an older deployment never replaces its successor's manager during a rolling update.
    ``ceiling_s``: how long to wait for a killed manager's name to be free (a bound against a hang). Raises
    TimeoutError past it."""
    import ray

    from video.config import VideoConfig

    jobs = VideoConfig.model_validate(engine_cfg).jobs
    want = config_hash(engine_cfg, model_dir, model_id)
    try:
        old = ray.get_actor(jobs.actor_name, namespace=jobs.namespace)
    except ValueError:  # none by that name
        old = None
    if old is not None:
        try:
            same = ray.get(old.get_config_hash.remote()) == want
        except ray.exceptions.RayActorError:  # dying for good: replaced below
            same = None
        if same or (not replace and same is not None):
            return old
        ray.kill(old, no_restart=True)
    actor = ray.remote(JobManager).options(name=jobs.actor_name, namespace=jobs.namespace, get_if_exists=True,
                                           lifetime="detached", num_cpus=0, max_concurrency=64, max_restarts=-1)
    deadline = time.monotonic() + ceiling_s
    while True:
        try:
            handle = actor.remote(engine_cfg, model_dir, model_id)
            if ray.get(handle.get_config_hash.remote()) == want or not replace:
                return handle
        except ray.exceptions.RayActorError:  # the name still held by the killed one, dying
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job manager {jobs.actor_name!r} was not replaced within {ceiling_s} s")
        time.sleep(0.1)
