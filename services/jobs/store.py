"""The durable store of video jobs and the API's Video object.

- :class:`JobStore`: one SQLAlchemy table (SQLite by default; any SQLAlchemy URL) plus a results directory
  with one folder per job (``input.png``, ``video.mp4``, ``thumbnail.png``, ``last_frame.npy``, ``meta.json``).
  The job manager (:mod:`services.jobs.manager`) is its one writer.
- Order: ``created_at`` is strictly increasing in creation order (the manager never hands out the same instant
  twice, also across a restart), and lists break any tie by id, so a list's order never depends on how fast
  jobs were submitted.
- ``seconds`` of a Video object: the planned duration while queued or running, then the duration of the MP4
  written (its frames / fps; :func:`video.request.seconds_label`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import sqlalchemy as sa

ACTIVE = ("queued", "in_progress")
TOMBSTONE = ".deleted-"  # prefix of a job folder being removed (JobStore.delete)


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
            sa.Column("engine_device", sa.String(64), nullable=True),  # torch device of the job's engine
            sa.Column("worker_pid", sa.Integer, nullable=True),
            sa.Column("worker_started_at", sa.Float, nullable=True),
            sa.Column("worker_finished_at", sa.Float, nullable=True),
            sa.Column("remixed_from", sa.String(64), nullable=True),
            sa.Column("owner", sa.String(32), nullable=True, index=True),  # the creating API key's id, or None
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
        """Remove the record and the job's results folder.

        The folder is first renamed to a tombstone (``.deleted-<id>-<random>``, atomic) and then removed: a
        killed worker still writing its next file into the job's folder gets FileNotFoundError (the worker never
        creates the folder) instead of racing the removal and leaving a folder behind. A tombstone left by a
        crash mid-removal is removed by :meth:`remove_tombstones`."""
        import uuid

        with self.engine.begin() as c:
            c.execute(self.table.delete().where(self.table.c.id == job_id))
        tomb = self.results_dir / f"{TOMBSTONE}{job_id}-{uuid.uuid4().hex[:8]}"
        try:
            self.job_dir(job_id).rename(tomb)
        except FileNotFoundError:  # no folder (never written, or removed already)
            return
        shutil.rmtree(tomb, ignore_errors=True)

    def remove_tombstones(self) -> int:
        """Remove the folders of deletions a crash interrupted (:meth:`delete`); returns how many."""
        tombs = list(self.results_dir.glob(TOMBSTONE + "*"))
        for t in tombs:
            shutil.rmtree(t, ignore_errors=True)
        return len(tombs)

    def expired(self, now: float) -> list[str]:
        """Ids of finished jobs whose ``expires_at`` is at or before ``now`` (seconds, the manager's clock)."""
        t = self.table
        with self.engine.connect() as c:
            q = sa.select(t.c.id).where(t.c.expires_at.is_not(None), t.c.expires_at <= now, t.c.status.not_in(ACTIVE))
            return [r[0] for r in c.execute(q)]

    def list(self, limit: int = 20, after: str | None = None, order: str = "desc",
             owner: str | None = None) -> list[dict]:
        """Jobs newest first (``order="asc"``: oldest first), starting after the job ``after``; with ``owner``,
        only that owner's. Raises LookupError when ``after`` names no stored job (of that owner)."""
        t = self.table
        q = t.select() if owner is None else t.select().where(t.c.owner == owner)
        desc = order != "asc"
        if after is not None:
            ref = self.get(after)
            if ref is None or (owner is not None and ref["owner"] != owner):
                raise LookupError(after)
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
    def digest(b: bytes | None) -> str | None:
        return None if b is None else hashlib.sha256(b).hexdigest()

    canon = {"request": request, "image": digest(image_png), "seconds": seconds_label,
             "extend": (extend_from or {}).get("id"), "upload": digest((upload or {}).get("video"))}
    return hashlib.sha256(json.dumps(canon, sort_keys=True, default=str).encode()).hexdigest()
