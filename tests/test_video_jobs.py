"""Video job manager on Ray (no Serve): cancel frees the worker, restart recovery, idempotency, queue limit
(one GPU per job, manager restarts and replacement: tests/test_video_gpu_jobs.py).

Ray runs with 2 logical GPUs (the ``ray_cluster`` fixture), so GPU scheduling is tested without hardware. Each test starts its own JobManager actor on a temporary store and results directory.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import psutil
import pytest

from services.jobs.errors import JobError
from services.jobs.manager import JobManager
from services.jobs.store import JobStore
from video.request import plan_request


@pytest.fixture(autouse=True)
def _no_manager_outlives_its_test(ray_cluster):
    """Kill every test manager (namespace ``tests``) a test left alive: one that failed before its ``ray.kill``
    would keep its job workers, each holding one of the session's 2 logical GPUs, and every later test's worker
    would wait for a GPU forever."""
    yield
    ray = ray_cluster
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "tests" and actor["name"].startswith(("test-jobs-", "test-mgr-")):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace="tests"), no_restart=True)
            except ValueError:  # gone meanwhile
                pass


def _manager(ray, profile, model_dir, tmp_path, name=None, engine=None, **jobs):
    """A job manager actor of the cpu profile's video engine on this test's store and results (``jobs``: fields
    of the jobs section to change; tests that run one job at a time ask ``workers=1``: each worker loads an engine,
    which only competes for the 2 cores when it is not needed). Returns (handle, engine config)."""
    cfg = profile.video.engine.model_copy(deep=True, update=engine or {})
    cfg.jobs = cfg.jobs.model_copy(update={"store_url": f"sqlite:///{tmp_path}/jobs.sqlite",
                                           "results_dir": str(tmp_path / "results"), "cpus_per_job": 0.25,
                                           **jobs})
    actor = ray.remote(JobManager).options(name=name or f"test-jobs-{uuid.uuid4().hex[:8]}", namespace="tests",
                                           num_cpus=0, max_concurrency=64)
    return actor.remote(cfg.model_dump(mode="json"), str(model_dir), "chimera-video"), cfg


def _submit(ray, mgr, cfg, **fields):
    req = plan_request(cfg, {"prompt": "a red kite over the sea", **fields})
    return ray.get(mgr.create.remote(req.to_dict()))["id"]


def _wait(ray, mgr, job_id, until, timeout=600):
    # ``timeout``: a ceiling on a monotonic clock that only turns a hang into a failure
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = ray.get(mgr.record.remote(job_id))
        if until(rec):
            return rec
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting on {job_id}: {rec['status']} {rec['progress']}")


def _gone(pid: int, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout  # a ceiling against a hang, not a speed requirement
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:  # gone before or while being looked at (no pid_exists-then-status race)
            return True
        time.sleep(0.1)
    return False


LONG = {"seconds": 32, "num_inference_steps": 50, "size": "128x128"}  # 8 clips x 50 steps: several seconds


def test_cancel_frees_the_worker(ray_cluster, profile, model_dir, tmp_path):
    ray = ray_cluster
    mgr, cfg = _manager(ray, profile, model_dir, tmp_path, gpus_per_job=1, workers=1)
    job = _submit(ray, mgr, cfg, **LONG)
    rec = _wait(ray, mgr, job, lambda r: r["status"] == "in_progress" and r["progress"] > 0)
    out = ray.get(mgr.delete.remote(job))
    assert out == {"id": job, "object": "video.deleted", "deleted": True}
    assert _gone(rec["worker_pid"]), "the job's worker still runs after cancel"
    [fresh] = ray.get(mgr.workers_where.remote())  # a fresh worker holds the slot (and its GPU) again
    assert fresh["pid"] != rec["worker_pid"] and fresh["gpu_ids"] in (["0"], ["1"])
    with pytest.raises(Exception) as e:  # deleting twice: 404
        ray.get(mgr.delete.remote(job))
    assert isinstance(e.value.cause, JobError) and e.value.cause.status_code == 404
    assert not (tmp_path / "results" / job).exists()
    nxt = _submit(ray, mgr, cfg, num_inference_steps=2)  # the next job runs on the fresh worker
    done = _wait(ray, mgr, nxt, lambda r: r["status"] not in ("queued", "in_progress"))
    assert done["status"] == "completed" and done["worker_pid"] == fresh["pid"]
    ray.kill(mgr)


def test_restart_recovery(ray_cluster, profile, model_dir, tmp_path):
    from video.media import decode_video

    ray = ray_cluster
    mgr, cfg = _manager(ray, profile, model_dir, tmp_path, workers=1)
    done = _submit(ray, mgr, cfg, num_inference_steps=2)
    _wait(ray, mgr, done, lambda r: r["status"] == "completed")
    running = _submit(ray, mgr, cfg, **LONG)
    rec = _wait(ray, mgr, running, lambda r: r["status"] == "in_progress" and r["progress"] > 0)
    ray.kill(mgr)  # the service dies mid-job
    assert _gone(rec["worker_pid"]), "the job's worker outlived its manager"

    # a job still queued when the service died (never started): written straight into the store as the newest
    # job, derived from the running job's row (no wall-clock gap between jobs is assumed). 1000 s ahead: as if the
    # clock had stepped back across the restart.
    from services.jobs.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path}/jobs.sqlite", tmp_path / "results")
    row, running_row = store.get(done), store.get(running)
    assert running_row["created_at"] > row["created_at"]  # the manager stamps creation order, however fast
    queued = "video_queued_at_crash"
    (tmp_path / "results" / queued).mkdir()
    store.insert({**{k: row[k] for k in ("model", "prompt", "seconds", "size", "params", "clips_total")},
                  "id": queued, "created_at": running_row["created_at"] + 1000.0, "status": "queued",
                  "phase": "queued", "progress": 0, "clips_done": 0})
    store.engine.dispose()

    mgr2, _ = _manager(ray, profile, model_dir, tmp_path, workers=1)  # a new service on the same store and results
    page = ray.get(mgr2.list.remote())
    assert [v["id"] for v in page["data"]] == [queued, running, done]
    newer = _submit(ray, mgr2, cfg, num_inference_steps=2)  # a new job sorts newest, whatever the clock says
    assert [v["id"] for v in ray.get(mgr2.list.remote())["data"]] == [newer, queued, running, done]
    assert _wait(ray, mgr2, queued, lambda r: r["status"] not in ("queued", "in_progress"))["status"] == "completed"
    v = ray.get(mgr2.get.remote(running))
    assert v["status"] == "failed" and v["error"]["code"] == "interrupted"
    assert v["phase"] is None  # finished jobs report no phase
    assert ray.get(mgr2.get.remote(done))["status"] == "completed"
    frames, fps = decode_video(ray.get(mgr2.content_path.remote(done))["path"])
    assert frames.shape == (9, 64, 64, 3) and fps == 2
    assert ray.get(mgr2.get.remote(done))["seconds"] == "4.5"  # one 9-frame clip at 2 fps, as served
    with pytest.raises(Exception) as e:  # the interrupted job has no content: 409
        ray.get(mgr2.content_path.remote(running))
    assert e.value.cause.status_code == 409
    assert _wait(ray, mgr2, newer, lambda r: r["status"] not in ("queued", "in_progress"))["status"] == "completed"
    ray.kill(mgr2)


def test_idempotency_key_is_bound_to_the_request(ray_cluster, profile, model_dir, tmp_path):
    """Same key + same canonical request -> the first job; same key + any other request -> 409
    ``idempotency_key_reused``; nothing extra is queued. ``queue_length`` counts queued + running jobs."""
    ray = ray_cluster
    mgr, cfg = _manager(ray, profile, model_dir, tmp_path, workers=1)
    req = plan_request(cfg, {"prompt": "a kite", "num_inference_steps": 2}).to_dict()
    first = ray.get(mgr.create.remote(req, idempotency_key="k1"))
    assert first["phase"] == "queued"
    assert ray.get(mgr.create.remote(dict(req), idempotency_key="k1"))["id"] == first["id"]
    assert ray.get(mgr.queue_length.remote()) == 1
    others = [((plan_request(cfg, {"prompt": "a kite", "num_inference_steps": 3}).to_dict(),), {}),
              ((req,), {"image_png": b"\x89PNG other input"}),
              ((req,), {"seconds_label": "8"})]
    for args, kw in others:
        with pytest.raises(Exception) as e:
            ray.get(mgr.create.remote(*args, idempotency_key="k1", **kw))
        cause = e.value.cause
        assert (cause.status_code, cause.code, cause.param) == (409, "idempotency_key_reused", "Idempotency-Key")
    assert [v["id"] for v in ray.get(mgr.list.remote())["data"]] == [first["id"]]
    rec = _wait(ray, mgr, first["id"], lambda r: r["status"] not in ("queued", "in_progress"))
    assert rec["status"] == "completed" and rec["request_hash"] is not None
    assert ray.get(mgr.get.remote(first["id"]))["phase"] is None
    assert ray.get(mgr.queue_length.remote()) == 0
    ray.kill(mgr)


def test_queue_full_is_429(ray_cluster, profile, model_dir, tmp_path):
    """``max_queued`` counts the jobs queued or running, and the 429 says so: with one job running and none
    queued, the message used to say the jobs were "already queued"."""
    ray = ray_cluster
    mgr, cfg = _manager(ray, profile, model_dir, tmp_path, max_queued=1, workers=1)
    job = _submit(ray, mgr, cfg, **LONG)
    _wait(ray, mgr, job, lambda rec: rec["status"] == "in_progress")
    with pytest.raises(Exception) as e:
        _submit(ray, mgr, cfg)
    assert e.value.cause.status_code == 429 and e.value.cause.code == "queue_full"
    assert "video jobs are already queued or running" in str(e.value.cause), e.value.cause
    assert [v["id"] for v in ray.get(mgr.list.remote())["data"]] == [job]  # nothing left behind
    ray.get(mgr.delete.remote(job))
    ray.kill(mgr)


def test_non_finite_output_fails_the_job(ray_cluster, profile, model_dir, tmp_path):
    """A checkpoint whose transformer outputs NaN (as an fp16 overflow would): the job fails with a clear error
    code instead of producing a black video, and no MP4 is written."""
    import shutil

    import torch
    from diffusers import WanTransformer3DModel

    ray = ray_cluster
    broken = tmp_path / "broken_wan"
    shutil.copytree(model_dir / profile.video.engine.model, broken)
    tr = WanTransformer3DModel.from_pretrained(broken, subfolder="transformer")
    with torch.no_grad():
        tr.proj_out.bias.fill_(float("nan"))
    tr.save_pretrained(broken / "transformer")
    mgr, cfg = _manager(ray, profile, model_dir, tmp_path, workers=1)
    cfg.model = str(broken)
    actor = ray.remote(JobManager).options(name=f"test-jobs-{uuid.uuid4().hex[:8]}", namespace="tests", num_cpus=0)
    ray.kill(mgr)
    mgr = actor.remote(cfg.model_dump(mode="json"), str(model_dir), "chimera-video")
    job = _submit(ray, mgr, cfg, num_inference_steps=2)
    rec = _wait(ray, mgr, job, lambda r: r["status"] not in ("queued", "in_progress"))
    assert rec["status"] == "failed" and rec["error_code"] == "non_finite_output"
    assert "non-finite" in rec["error_message"]
    assert not (tmp_path / "results" / job / "video.mp4").exists()
    ray.kill(mgr)


def _local_manager(profile, model_dir, tmp_path, clock=time.time):
    """A JobManager object in this process (methods awaited directly, no actor) on a store in ``tmp_path``, with
    one worker; its job launcher is a scripted no-op (these tests are about the store, expiry and recovery, not
    generation). Stop it with :func:`_stop` (kills its worker actor)."""
    cfg = profile.video.engine.model_copy(deep=True)
    cfg.jobs = cfg.jobs.model_copy(update={"store_url": f"sqlite:///{tmp_path}/jobs.sqlite",
                                           "results_dir": str(tmp_path / "results"), "cpus_per_job": 0.25,
                                           "workers": 1})
    m = JobManager(cfg.model_dump(mode="json"), str(model_dir), "chimera-video", clock=clock)
    m._launch = lambda row: None
    return m, cfg


def _stop(ray, m):
    for w in m.workers:
        ray.kill(w, no_restart=True)
    m.store.engine.dispose()


def _crashed_running_job(tmp_path, profile, job_id="video_running_at_crash", created_at=1.0):
    """A store left by a service that died while ``job_id`` ran (written before any manager starts)."""
    cfg = profile.video.engine
    store = JobStore(f"sqlite:///{tmp_path}/jobs.sqlite", tmp_path / "results")
    req = plan_request(cfg, {"prompt": "a kite"}).to_dict()
    store.job_dir(job_id).mkdir()
    store.insert({"id": job_id, "created_at": created_at, "model": "chimera-video", "status": "in_progress",
                  "phase": "denoising", "progress": 40, "clips_total": 1, "clips_done": 0, "prompt": "a kite",
                  "seconds": "4.5", "size": "64x64", "params": {"request": req}})
    store.engine.dispose()
    return job_id


def test_expired_jobs_are_gone_while_the_manager_lives(ray_cluster, profile, model_dir, tmp_path):
    """One long-lived manager, an injected clock. A job whose ``expires_at`` has come is exactly like a deleted
    one: 404 ``video_not_found`` on get, content, record and delete, not listed, record and folder removed; a
    job that expired without anyone asking for it is swept by the next create; a job interrupted by a crash
    (failed at recovery) expires ``ttl_s`` after it too. Jobs not yet expired are untouched."""
    ray = ray_cluster
    now = [2.0e9]
    crashed = _crashed_running_job(tmp_path, profile)
    m, cfg = _local_manager(profile, model_dir, tmp_path, clock=lambda: now[0])
    ttl = cfg.jobs.ttl_s
    req = plan_request(cfg, {"prompt": "a kite", "num_inference_steps": 2}).to_dict()
    results = tmp_path / "results"

    async def go():
        a, b = [(await m.create(req))["id"] for _ in range(2)]
        for job, done_at in ((a, now[0]), (b, now[0] + 100)):
            m.store.update(job, status="completed", completed_at=done_at, expires_at=done_at + ttl)
            (m.store.job_dir(job) / "video.mp4").write_bytes(b"\0" * 10)
        assert (await m.get(crashed))["expires_at"] == int(now[0] + ttl)  # failed interrupted at recovery
        assert (await m.content_path(a))["size"] == 10
        now[0] += ttl  # a and the crashed job expire now, b in 100 s
        for call in (m.get, m.content_path, m.record, m.delete, m.extension_source):
            with pytest.raises(JobError) as info:
                await call(a)
            assert (info.value.status_code, info.value.code) == (404, "video_not_found"), call
        assert m.store.get(a) is None and not (results / a).exists()
        assert [v["id"] for v in (await m.list())["data"]] == [b]  # the crashed job is swept by the list
        assert m.store.get(crashed) is None and not (results / crashed).exists()
        assert (await m.get(b))["status"] == "completed"
        now[0] += 100  # b expires; nobody asks for it
        c = (await m.create(req))["id"]
        assert m.store.get(b) is None and sorted(p.name for p in results.iterdir()) == [c]
        assert await m.queue_length() == 1

    try:
        asyncio.run(go())
    finally:
        _stop(ray, m)


def test_concurrent_first_calls_wait_for_one_recovery(ray_cluster, profile, model_dir, tmp_path):
    """Two first calls at once, the first one's recovery held half-way (a scripted hold in the manager's store
    I/O): the second reads nothing before the recovery is done, and both see the crashed job ``interrupted``."""
    ray = ray_cluster
    job = _crashed_running_job(tmp_path, profile)
    m, _ = _local_manager(profile, model_dir, tmp_path)
    real_io, calls = m._io, []

    async def go():
        hold = asyncio.Event()

        async def io(fn, *args, **kwargs):
            calls.append((fn.__name__, hold.is_set()))
            if fn.__name__ == "with_status":
                await hold.wait()
            return await real_io(fn, *args, **kwargs)

        m._io = io
        first = asyncio.create_task(m.get(job))
        while ("with_status", False) not in calls:
            await asyncio.sleep(0)
        second = asyncio.create_task(m.get(job))
        for _ in range(50):  # every step the second call can take without waiting on the recovery
            await asyncio.sleep(0)
        hold.set()
        return await asyncio.gather(first, second)

    try:
        got = asyncio.run(go())
    finally:
        _stop(ray, m)
    assert [c for c in calls if not c[1]] == [("with_status", False)], calls  # nothing else ran before the hold
    assert [(v["status"], v["error"]["code"]) for v in got] == [("failed", "interrupted")] * 2


def test_recovery_that_fails_half_way_is_retried(ray_cluster, profile, model_dir, tmp_path):
    """The first recovery's store update fails (a scripted OSError): that call raises, and the next call runs
    the recovery again, so the crashed job ends ``interrupted`` instead of staying ``in_progress`` for good."""
    ray = ray_cluster
    job = _crashed_running_job(tmp_path, profile)
    m, _ = _local_manager(profile, model_dir, tmp_path)
    real_io, failures = m._io, [OSError("disk full")]

    async def io(fn, *args, **kwargs):
        if fn.__name__ == "update" and failures:
            raise failures.pop()
        return await real_io(fn, *args, **kwargs)

    m._io = io

    async def go():
        with pytest.raises(OSError):
            await m.get(job)
        return await m.get(job)

    try:
        v = asyncio.run(go())
    finally:
        _stop(ray, m)
    assert (v["status"], v["error"]["code"]) == ("failed", "interrupted")


def test_delete_leaves_no_folder_for_a_late_writer(tmp_path, monkeypatch):
    """A killed worker may still write into its job's folder while delete removes it. Scripted here: each file
    the removal unlinks is followed by the worker writing its next file there. That write fails (the folder was
    renamed away first) and nothing of the job is left in the results directory."""
    store = JobStore(f"sqlite:///{tmp_path}/jobs.sqlite", tmp_path / "results")
    jd = store.job_dir("video_x")
    jd.mkdir()
    (jd / "input.png").write_bytes(b"png")
    store.insert({"id": "video_x", "created_at": 1.0, "model": "m", "status": "cancelled", "phase": "denoising",
                  "progress": 50, "clips_total": 1, "clips_done": 0, "prompt": "p", "seconds": "4", "size": "64x64",
                  "params": {}})
    real_unlink, late = os.unlink, []

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        try:
            (jd / "thumbnail.png").write_bytes(b"late")
            late.append("written")
        except FileNotFoundError:
            late.append("refused")

    monkeypatch.setattr(os, "unlink", unlink)
    store.delete("video_x")
    monkeypatch.undo()
    assert late == ["refused"]
    assert store.get("video_x") is None and list((tmp_path / "results").iterdir()) == []
    store.engine.dispose()
