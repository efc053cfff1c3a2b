"""Video jobs: a durable store, a job-manager Ray actor, and one Ray task per job.

- :class:`JobStore`: one SQLAlchemy table (SQLite by default; any SQLAlchemy URL) plus a results directory
  with one folder per job (``input.png``, ``video.mp4``, ``thumbnail.png``, ``last_frame.npy``, ``meta.json``).
- :class:`JobManager`: a (detached, named) Ray actor. Ray tasks started from a Serve replica die with it, so
  jobs are launched from here: each job is its own Ray task (:func:`run_video_job`) asking for
  ``gpus_per_job`` GPUs (1 in GPU profiles: Ray sets the task's ``CUDA_VISIBLE_DEVICES``; 0 on the cpu
  profile), so one job owns one GPU and Ray's scheduler queues the rest. Cancel = ``ray.cancel(force=True)``:
  the worker process is killed and its GPU is free at once.
- Restart recovery (documented behaviour): when a manager starts on an existing store, jobs that were
  ``in_progress`` become ``failed`` with error code ``interrupted`` (their partial work is lost; the client
  may resubmit); ``queued`` jobs, which never started, are launched again. Completed jobs and their files stay.
- Order: ``created_at`` is strictly increasing in creation order (the manager, the store's one writer, never
  hands out the same instant twice, also across a restart), and lists break any tie by id, so a list's order
  never depends on how fast jobs were submitted.
- ``seconds`` of a Video object: the planned duration while queued or running, then the duration of the MP4
  written (its frames / fps; :func:`video.request.seconds_label`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ACTIVE = ("queued", "in_progress")


class JobError(Exception):
    """An error answered to the client: ``status_code`` 404 unknown id, 409 wrong state, 429 queue full."""

    def __init__(self, status_code: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param

    def __reduce__(self):  # crosses Ray process boundaries intact
        return (type(self), (self.status_code, str(self), self.code, self.param))


class JobStore:
    """Durable job records (SQLAlchemy Core) and the results directory.

    ``url``: SQLAlchemy URL (``sqlite:///path`` by default). ``results_dir``: one sub-folder per job id.
    Records are plain dicts with the columns of :attr:`table`; ``params`` is JSON.
    """

    def __init__(self, url: str, results_dir: str | Path):
        self.engine = sa.create_engine(url, future=True)
        if url.startswith("sqlite"):
            @sa.event.listens_for(self.engine, "connect")
            def _pragmas(conn, _):  # WAL: readers never block the writer; survives a kill -9
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA busy_timeout=5000")
        self.meta = sa.MetaData()
        self.table = sa.Table(
            "video_jobs", self.meta,
            sa.Column("id", sa.String(64), primary_key=True),
            sa.Column("created_at", sa.Float, nullable=False, index=True),
            sa.Column("model", sa.String(200), nullable=False),
            sa.Column("status", sa.String(16), nullable=False, index=True),
            sa.Column("phase", sa.String(16), nullable=False),
            sa.Column("progress", sa.Integer, nullable=False, default=0),
            sa.Column("clips_total", sa.Integer, nullable=False),
            sa.Column("clips_done", sa.Integer, nullable=False, default=0),
            sa.Column("prompt", sa.Text, nullable=False),
            sa.Column("seconds", sa.String(32), nullable=False),
            sa.Column("size", sa.String(32), nullable=False),
            sa.Column("params", sa.JSON, nullable=False),
            sa.Column("idempotency_key", sa.String(256), unique=True, nullable=True),
            sa.Column("request_hash", sa.String(64), nullable=True),  # sha256 of the canonical request
            sa.Column("started_at", sa.Float, nullable=True),
            sa.Column("completed_at", sa.Float, nullable=True),
            sa.Column("expires_at", sa.Float, nullable=True),
            sa.Column("error_code", sa.String(64), nullable=True),
            sa.Column("error_message", sa.Text, nullable=True),
            sa.Column("device", sa.String(64), nullable=True),
            sa.Column("worker_pid", sa.Integer, nullable=True),
            sa.Column("worker_started_at", sa.Float, nullable=True),
            sa.Column("worker_finished_at", sa.Float, nullable=True),
            sa.Column("remixed_from", sa.String(64), nullable=True),
        )
        self.meta.create_all(self.engine)
        self._add_missing_columns()
        self.results_dir = Path(results_dir)
        self.results_dir.mkdir(parents=True, exist_ok=True)

    def _add_missing_columns(self) -> None:
        """Forward-migrate a store written by an older version: add its missing (nullable) columns."""
        have = {c["name"] for c in sa.inspect(self.engine).get_columns(self.table.name)}
        for col in self.table.columns:
            if col.name not in have and col.nullable:
                with self.engine.begin() as c:
                    c.execute(sa.text(f"ALTER TABLE {self.table.name} ADD COLUMN {col.name} "
                                      f"{col.type.compile(self.engine.dialect)}"))

    def job_dir(self, job_id: str) -> Path:
        """Folder of a job's files (not created)."""
        return self.results_dir / job_id

    def insert(self, row: dict) -> dict:
        """Insert a job record; returns it as stored. Raises sqlalchemy IntegrityError on a duplicate id/key."""
        with self.engine.begin() as c:
            c.execute(self.table.insert().values(**row))
        return self.get(row["id"])

    def get(self, job_id: str) -> dict | None:
        """The record of ``job_id``, or None."""
        with self.engine.connect() as c:
            r = c.execute(self.table.select().where(self.table.c.id == job_id)).mappings().first()
        return dict(r) if r else None

    def by_key(self, key: str) -> dict | None:
        """The job created with this ``Idempotency-Key``, or None."""
        with self.engine.connect() as c:
            r = c.execute(self.table.select().where(self.table.c.idempotency_key == key)).mappings().first()
        return dict(r) if r else None

    def update(self, job_id: str, **fields: Any) -> None:
        """Set columns of one job unconditionally."""
        with self.engine.begin() as c:
            c.execute(self.table.update().where(self.table.c.id == job_id).values(**fields))

    def update_if_active(self, job_id: str, **fields: Any) -> bool:
        """Update only while the job is queued or running (a late progress report never revives a
        cancelled/failed job). True if a row changed."""
        t = self.table
        with self.engine.begin() as c:
            n = c.execute(t.update().where(t.c.id == job_id, t.c.status.in_(ACTIVE)).values(**fields)).rowcount
        return n > 0

    def delete(self, job_id: str) -> None:
        """Remove the record and the job's results folder."""
        with self.engine.begin() as c:
            c.execute(self.table.delete().where(self.table.c.id == job_id))
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)

    def list(self, limit: int = 20, after: str | None = None, order: str = "desc") -> list[dict]:
        """Jobs newest first (``order="asc"``: oldest first), starting after the job ``after``."""
        t = self.table
        q = t.select()
        desc = order != "asc"
        if after is not None:
            ref = self.get(after)
            if ref is None:
                raise JobError(404, f"no video {after!r} (after)", "video_not_found", "after")
            c, i = ref["created_at"], ref["id"]
            q = q.where(sa.or_(t.c.created_at < c, sa.and_(t.c.created_at == c, t.c.id < i)) if desc
                        else sa.or_(t.c.created_at > c, sa.and_(t.c.created_at == c, t.c.id > i)))
        q = q.order_by(*( (t.c.created_at.desc(), t.c.id.desc()) if desc else (t.c.created_at, t.c.id))).limit(limit)
        with self.engine.connect() as c:
            return [dict(r) for r in c.execute(q).mappings()]

    def count_active(self) -> int:
        """Jobs queued or running."""
        with self.engine.connect() as c:
            return c.execute(sa.select(sa.func.count()).select_from(self.table)
                             .where(self.table.c.status.in_(ACTIVE))).scalar_one()

    def with_status(self, *statuses: str) -> list[dict]:
        """Records in any of ``statuses``, oldest first (ties by id)."""
        t = self.table
        with self.engine.connect() as c:
            q = t.select().where(t.c.status.in_(statuses)).order_by(t.c.created_at, t.c.id)
            return [dict(r) for r in c.execute(q).mappings()]

    def latest_created_at(self) -> float:
        """The largest ``created_at`` in the store (0.0 when empty)."""
        with self.engine.connect() as c:
            return float(c.execute(sa.select(sa.func.max(self.table.c.created_at))).scalar() or 0.0)


def video_object(row: dict) -> dict:
    """The API's Video object for a store row.

    ``phase`` is the job's current phase (``queued`` | ``denoising`` | ``decoding`` | ``encoding``) while it is
    queued or running, and None once it is completed, failed or cancelled (the store keeps the last phase)."""
    err = {"code": row["error_code"], "message": row["error_message"]} if row.get("error_code") else None
    return {"id": row["id"], "object": "video", "model": row["model"], "status": row["status"],
            "progress": int(row["progress"]), "created_at": int(row["created_at"]),
            "completed_at": int(row["completed_at"]) if row.get("completed_at") else None,
            "expires_at": int(row["expires_at"]) if row.get("expires_at") else None,
            "seconds": row["seconds"], "size": row["size"], "prompt": row["prompt"], "error": err,
            "remixed_from_video_id": None, "clips_total": row["clips_total"], "clips_done": row["clips_done"],
            "phase": row["phase"] if row["status"] in ACTIVE else None}


def request_hash(request: dict, image_png: bytes | None = None, extend_from: dict | None = None,
                 upload: dict | None = None, seconds_label: str | None = None) -> str:
    """sha256 (hex) of a job's canonical request: the validated VideoRequest, the input image's bytes, and the
    extended video (its id, or the uploaded file's bytes). Two submissions under one ``Idempotency-Key`` are
    the same request iff their hashes agree."""
    import hashlib

    def digest(b: bytes | None) -> str | None:
        return None if b is None else hashlib.sha256(b).hexdigest()

    canon = {"request": request, "image": digest(image_png), "seconds": seconds_label,
             "extend": (extend_from or {}).get("id"), "upload": digest((upload or {}).get("video"))}
    return hashlib.sha256(json.dumps(canon, sort_keys=True, default=str).encode()).hexdigest()


# ---- the job task --------------------------------------------------------------------------------------------
_ENGINES: dict[tuple, Any] = {}


def _engine(cfg_json: str, model_dir: str, device: str | None):
    """A VideoEngine cached per worker process (Ray reuses workers, so models stay loaded between jobs)."""
    from video.config import VideoConfig
    from video.engine import VideoEngine

    key = (cfg_json, model_dir, device)
    if key not in _ENGINES:
        _ENGINES.clear()
        _ENGINES[key] = VideoEngine(VideoConfig.model_validate_json(cfg_json), model_dir, device=device)
    return _ENGINES[key]


def run_video_job(job_id: str, cfg_json: str, model_dir: str, job_dir: str, params: dict, manager) -> dict:
    """Run one video job in a Ray worker: generate, encode MP4 + thumbnail, save the last frame and the drift
    reference for later extensions. Reports progress to ``manager`` (the JobManager actor handle).

    ``params``: ``{"request": VideoRequest dict, "image": bool, "extend": {"frames": path, ...} | None}``.
    Returns ``{"frames", "fps", "started", "finished"}`` (wall-clock seconds measured in the worker). Raises NonFiniteOutputError, ValueError, OSError."""
    import numpy as np
    import torch
    from PIL import Image

    from video.drift import ColorStats
    from video.engine import Progress, progress_units
    from video.media import decode_video, encode_mp4, image_to_tensor, png_bytes, to_uint8
    from video.request import VideoRequest

    t0 = time.time()
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    device = "cuda" if params.get("gpus_per_job") and torch.cuda.is_available() else None
    manager.started.remote(job_id, gpus if gpus is not None else "cpu", os.getpid())
    engine = _engine(cfg_json, model_dir, device)
    req = VideoRequest.from_dict(params["request"])
    jd = Path(job_dir)
    image, reference, prefix = None, None, None
    ext = params.get("extend")
    if ext:
        image = torch.from_numpy(np.load(ext["last_frame"])).float()
        reference = ColorStats.from_dict(ext["reference"])
        prefix, _ = decode_video(ext["video"])
    elif params.get("image"):
        image = image_to_tensor(Image.open(jd / "input.png"), req.width, req.height)
    last = {"t": 0.0}

    def on_progress(p: Progress):
        now = time.monotonic()
        if now - last["t"] > 0.2 or p.phase != "denoising":
            last["t"] = now
            manager.progress.remote(job_id, p.phase, p.percent, p.clips_done)

    result = engine.generate(req, image=image, reference=reference, continuation=bool(ext), on_progress=on_progress)
    total = progress_units(req)
    manager.progress.remote(job_id, "encoding", int(100 * (total - 1) / total), req.num_clips)
    frames = to_uint8(result.frames)
    if prefix is not None:
        frames = np.concatenate([prefix, frames])
    encode_mp4(frames, req.fps, jd / "video.mp4")
    (jd / "thumbnail.png").write_bytes(png_bytes(result.frames[0] if prefix is None else
                                                 torch.from_numpy(prefix[0]).permute(2, 0, 1).float() / 255))
    np.save(jd / "last_frame.npy", result.frames[-1].numpy().astype(np.float32))
    (jd / "meta.json").write_text(json.dumps({"reference": result.reference.to_dict(), "frames": int(len(frames)),
                                              "fps": req.fps, "width": req.width, "height": req.height}))
    return {"frames": int(len(frames)), "fps": req.fps, "started": t0, "finished": time.time()}


# ---- the manager actor ---------------------------------------------------------------------------------------
class JobManager:
    """Owns the store and launches one Ray task per job (wrap with ``ray.remote``; see :func:`get_manager`).

    ``engine_cfg``: the video engine config (dict); ``model_dir``: the profile's model dir; ``model_id``: the
    public model id. All methods return plain dicts (Video objects) or raise :class:`JobError`.
    """

    def __init__(self, engine_cfg: dict, model_dir: str, model_id: str):
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
        self.refs: dict[str, Any] = {}
        self.watchers: dict[str, asyncio.Task] = {}
        self._recovered = False
        self._last_created = self.store.latest_created_at()

    def _created_at(self) -> float:
        """Now (wall clock, s), but strictly after every job already stored: creation order is list order."""
        now = max(time.time(), self._last_created + 1e-3)
        self._last_created = now
        return now

    # -- lifecycle
    def _handle(self):
        import ray

        return ray.get_runtime_context().current_actor

    async def recover(self) -> dict:
        """Apply the restart policy once (see module doc) and purge expired jobs. Returns counts."""
        if self._recovered:
            return {"interrupted": 0, "requeued": 0, "expired": 0}
        self._recovered = True
        now = time.time()
        interrupted = self.store.with_status("in_progress")
        for row in interrupted:
            self.store.update(row["id"], status="failed", phase=row["phase"], error_code="interrupted",
                              error_message="the service stopped while this job was running; submit it again",
                              completed_at=now)
        queued = self.store.with_status("queued")
        for row in queued:
            self._launch(row)
        expired = [r for r in self.store.with_status("completed") if r["expires_at"] and r["expires_at"] < now]
        for r in expired:
            self.store.delete(r["id"])
        return {"interrupted": len(interrupted), "requeued": len(queued), "expired": len(expired)}

    async def ping(self) -> bool:
        """Liveness (and the first-contact restart recovery)."""
        await self.recover()
        return True

    # -- submit
    async def create(self, request: dict, image_png: bytes | None = None, extend_from: dict | None = None,
                     upload: dict | None = None, idempotency_key: str | None = None,
                     seconds_label: str | None = None) -> dict:
        """Queue a validated job (``request``: a VideoRequest dict; ``image_png``: image-to-video input).

        Extensions pass ``extend_from`` (from :meth:`extension_source`) or ``upload`` (an uploaded source video:
        ``{"video": mp4 bytes, "last_frame": float32 (3, H, W) array, "reference": ColorStats dict}``).
        An ``idempotency_key`` seen before with the same canonical request (:func:`request_hash`) returns that
        job; with a different request it raises JobError(409, ``idempotency_key_reused``). Raises JobError(429)
        when ``max_queued`` jobs are unfinished."""
        await self.recover()
        digest = request_hash(request, image_png, extend_from, upload, seconds_label)
        if idempotency_key:
            prev = self.store.by_key(idempotency_key)
            if prev is not None:
                if prev.get("request_hash") not in (None, digest):
                    raise JobError(409, "this Idempotency-Key was already used with a different request; use a "
                                        "new key for a new request", "idempotency_key_reused", "Idempotency-Key")
                return video_object(prev)
        if self.store.count_active() >= self.cfg.jobs.max_queued:
            raise JobError(429, f"{self.cfg.jobs.max_queued} video jobs are already queued; retry later",
                           "queue_full")
        job_id = "video_" + uuid.uuid4().hex
        jd = self.store.job_dir(job_id)
        jd.mkdir(parents=True, exist_ok=True)
        if image_png is not None:
            (jd / "input.png").write_bytes(image_png)
        if upload is not None:
            import numpy as np

            (jd / "source.mp4").write_bytes(upload["video"])
            np.save(jd / "source_last_frame.npy", np.asarray(upload["last_frame"], dtype=np.float32))
            extend_from = {"id": None, "video": str(jd / "source.mp4"), "reference": upload["reference"],
                           "last_frame": str(jd / "source_last_frame.npy")}
        if seconds_label is None:
            from video.request import VideoRequest, seconds_label as label

            planned = VideoRequest.from_dict(request)
            seconds_label = label(planned.total_frames, planned.fps)
        params = {"request": request, "image": image_png is not None, "extend": extend_from,
                  "gpus_per_job": self.cfg.jobs.gpus_per_job}
        row = self.store.insert(dict(
            id=job_id, created_at=self._created_at(), model=self.model_id, status="queued", phase="queued",
            progress=0, clips_total=request["num_clips"], clips_done=0, prompt=request["prompt"],
            seconds=seconds_label,            size=f"{request['width']}x{request['height']}", params=params, idempotency_key=idempotency_key,
            request_hash=digest if idempotency_key else None,
            remixed_from=(extend_from or {}).get("id")))
        self._launch(row)
        return video_object(row)

    def _launch(self, row: dict) -> None:
        import ray

        jobs = self.cfg.jobs
        task = ray.remote(run_video_job).options(num_gpus=jobs.gpus_per_job, num_cpus=jobs.cpus_per_job,
                                                 max_retries=0, name=f"video-job-{row['id']}")
        ref = task.remote(row["id"], self.cfg_json, self.model_dir, str(self.store.job_dir(row["id"])),
                          row["params"], self._handle())
        self.refs[row["id"]] = ref
        self.watchers[row["id"]] = asyncio.get_running_loop().create_task(self._watch(row["id"], ref))

    async def _watch(self, job_id: str, ref) -> None:
        import ray

        try:
            from video.request import seconds_label

            result = await ref
            now = time.time()
            self.store.update_if_active(job_id, status="completed", phase="encoding", progress=100,
                                        seconds=seconds_label(result["frames"], result["fps"]),
                                        clips_done=self.store.get(job_id)["clips_total"], completed_at=now,
                                        expires_at=now + self.cfg.jobs.ttl_s, worker_started_at=result["started"],
                                        worker_finished_at=result["finished"])
        except (ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError) as exc:
            self.store.update_if_active(job_id, status="failed", error_code="worker_died",
                                        error_message=f"the job's worker stopped: {type(exc).__name__}",
                                        completed_at=time.time())
        except Exception as exc:  # noqa: BLE001 - recorded on the job
            from services.errors import unwrap

            cause = unwrap(exc)
            code = getattr(cause, "code", None) or ("invalid_input" if isinstance(cause, ValueError)
                                                    else "generation_failed")
            self.store.update_if_active(job_id, status="failed", error_code=str(code),
                                        error_message=f"{type(cause).__name__}: {cause}"[:2000],
                                        completed_at=time.time())
        finally:
            self.refs.pop(job_id, None)
            self.watchers.pop(job_id, None)

    # -- reports from job tasks
    async def started(self, job_id: str, device: str, pid: int) -> None:
        """From the job task: it runs on ``device`` (its ``CUDA_VISIBLE_DEVICES``, or ``cpu``) in process ``pid``."""
        self.store.update_if_active(job_id, status="in_progress", phase="denoising", started_at=time.time(),
                                    device=str(device), worker_pid=int(pid))

    async def progress(self, job_id: str, phase: str, percent: int, clips_done: int) -> None:
        """From the job task: phase and integer percent (capped at 99 until the result is stored)."""
        self.store.update_if_active(job_id, status="in_progress", phase=phase, progress=min(99, int(percent)),
                                    clips_done=int(clips_done))

    # -- queries
    def _row(self, job_id: str, param: str = "video_id") -> dict:
        row = self.store.get(job_id)
        if row is None:
            raise JobError(404, f"no video with id {job_id!r}", "video_not_found", param)
        return row

    async def get(self, job_id: str) -> dict:
        """The Video object. Raises JobError(404)."""
        await self.recover()
        return video_object(self._row(job_id))

    async def record(self, job_id: str) -> dict:
        """The raw store row (params and device included): for the service and tests."""
        return self._row(job_id)

    async def list(self, limit: int = 20, after: str | None = None, order: str = "desc") -> dict:
        """A page of Video objects: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""
        await self.recover()
        rows = self.store.list(limit + 1, after, order)
        data = [video_object(r) for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    async def content(self, job_id: str, variant: str = "video") -> bytes:
        """MP4 or PNG bytes of a completed job. Raises JobError 404 / 409 (not completed)."""
        row = self._row(job_id)
        if row["status"] != "completed":
            raise JobError(409, f"video {job_id} is {row['status']}, not completed", "video_not_ready")
        name = {"video": "video.mp4", "thumbnail": "thumbnail.png"}[variant]
        path = self.store.job_dir(job_id) / name
        if not path.exists():
            raise JobError(404, f"the {variant} of {job_id} is no longer stored", "content_missing")
        return path.read_bytes()

    async def extension_source(self, job_id: str) -> dict:
        """What an extension of a completed job needs: paths of its MP4 and float last frame, its drift
        reference, size and fps. Raises JobError 404 / 409 (``param`` ``video``: the request field naming it)."""
        row = self._row(job_id, "video")
        if row["status"] != "completed":
            raise JobError(409, f"video {job_id} is {row['status']}; only completed videos can be extended",
                           "video_not_ready", "video")
        jd = self.store.job_dir(job_id)
        meta = json.loads((jd / "meta.json").read_text())
        return {"id": job_id, "video": str(jd / "video.mp4"), "last_frame": str(jd / "last_frame.npy"),
                "reference": meta["reference"], "width": meta["width"], "height": meta["height"],
                "fps": meta["fps"], "frames": meta["frames"], "seconds": row["seconds"],
                "params": row["params"]["request"]}

    async def delete(self, job_id: str) -> dict:
        """Cancel a queued/running job (its worker is killed: the GPU is free at once) and delete its record
        and files. Raises JobError(404) for unknown (or already deleted) ids."""
        import ray

        self._row(job_id)
        ref = self.refs.pop(job_id, None)
        self.store.update_if_active(job_id, status="cancelled", error_code=None)
        if ref is not None:
            ray.cancel(ref, force=True)
            w = self.watchers.pop(job_id, None)
            if w is not None:
                w.cancel()
        self.store.delete(job_id)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    async def queue_length(self) -> int:
        """Jobs queued or running, as the store has them (the ``chimera_video_queue_length`` gauge)."""
        return self.store.count_active()

    async def running(self) -> list[str]:
        """Ids of jobs whose task is queued or running in Ray."""
        return list(self.refs)


def get_manager(engine_cfg: dict, model_dir: str, model_id: str):
    """The named, detached JobManager actor of this profile (created if missing). Detached: it outlives the
    Serve replica that created it (jobs keep running through a replica restart)."""
    import ray

    from video.config import VideoConfig

    jobs = VideoConfig.model_validate(engine_cfg).jobs
    actor = ray.remote(JobManager).options(name=jobs.actor_name, namespace=jobs.namespace, get_if_exists=True,
                                           lifetime="detached", num_cpus=0, max_concurrency=64)
    return actor.remote(engine_cfg, model_dir, model_id)
