"""One GPU per video job for real, and a job manager that is restarted, re-acquired and replaced.

Ray runs with 2 logical GPUs and no CUDA (the ``ray_cluster`` fixture): Ray still pins each GPU worker actor to
one GPU id and sets its ``CUDA_VISIBLE_DEVICES``, and each job's row records what its worker really had (that
variable, the torch device of its engine's weights, its pid), so the tests check where jobs ran, not only Ray's
labels. The tiny cpu-profile video model runs on the CPU.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.api.errors import to_api_error
from services.deployments.video import ManagerUnavailableError
from services.jobs.actor import get_manager
from services.jobs.manager import ENGINE_LOAD_ATTEMPTS, config_hash
from tests.test_video_jobs import LONG, _gone, _manager, _no_manager_outlives_its_test, _submit, _wait  # noqa: F401
from video.request import plan_request

_DONE = ("completed", "failed", "cancelled")


def test_each_job_runs_on_its_own_gpu(ray_cluster, profile, model_dir, tmp_path):
    """Two workers, one per GPU; four jobs. Each worker's engine sits on the device of its own GPU; every job ran
    in the process of the worker holding the GPU its row names; the first two jobs (handed out while both workers
    were idle) ran on different GPUs; jobs on one GPU never overlap in time (the worker runs one at a time)."""
    import torch

    ray = ray_cluster
    mgr, cfg = _manager(ray, profile, model_dir, tmp_path, gpus_per_job=1, workers=2)
    where = ray.get(mgr.workers_where.remote())
    engine_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert sorted(w["gpu_ids"] for w in where) == [["0"], ["1"]]
    assert all(w["cuda_visible_devices"] == w["gpu_ids"][0] for w in where)
    assert all(w["engine_device"] == engine_device for w in where)
    pid_of = {w["cuda_visible_devices"]: w["pid"] for w in where}
    assert len(set(pid_of.values())) == 2

    ids = [_submit(ray, mgr, cfg, seconds=4, num_inference_steps=2, seed=i) for i in range(4)]
    recs = [_wait(ray, mgr, i, lambda r: r["status"] in _DONE) for i in ids]
    assert [r["status"] for r in recs] == ["completed"] * 4, [r["error_message"] for r in recs]
    for r in recs:
        assert r["device"] in pid_of and r["worker_pid"] == pid_of[r["device"]]
        assert r["engine_device"] == engine_device
    assert recs[0]["device"] != recs[1]["device"]
    for gpu in pid_of:
        spans = sorted((r["worker_started_at"], r["worker_finished_at"]) for r in recs if r["device"] == gpu)
        assert spans, f"GPU {gpu} ran no job"
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # one job at a time on a GPU
    assert ray.get(mgr.running.remote()) == []
    ray.kill(mgr)


def _section(profile, tmp_path, name: str, **jobs) -> dict:
    """The video section of the cpu profile with its own store, results and manager name (namespace tests)."""
    sec = profile.video.model_copy(deep=True)
    sec.engine.jobs = sec.engine.jobs.model_copy(update={
        "store_url": f"sqlite:///{tmp_path}/jobs.sqlite", "results_dir": str(tmp_path / "results"),
        "cpus_per_job": 0.25, "actor_name": name, "namespace": "tests", **jobs})
    return sec.model_dump(mode="json")


def _ready(dep, timeout: float = 600) -> list:
    """Ask ``dep.ready()`` until it is True (or raises); returns every answer. ``timeout``: a ceiling on a
    monotonic clock that only turns a hang into a failure."""
    deadline, answers = time.monotonic() + timeout, []
    while not (answers and answers[-1]):
        assert time.monotonic() < deadline, f"not ready within {timeout} s"
        answers.append(asyncio.run(dep.ready()))
        if not answers[-1]:
            time.sleep(0.2)
    return answers


def test_ready_means_a_worker_holds_its_engine(ray_cluster, profile, model_dir, tmp_path):
    """The video deployment's ``ready`` (what ``/readyz`` asks) with a Wan checkpoint that is not there: never
    True; False while the workers try, then EngineUnavailableError (503 ``engine_unavailable``) naming the
    checkpoint. The slot's worker was started ``ENGINE_LOAD_ATTEMPTS`` times, then given up (one clear error, not
    a restart loop): a job queued while it tried and three jobs after it fail ``engine_unavailable`` naming the
    checkpoint (not ``worker_died``), and no worker is started for them. With the checkpoint there: True once
    loaded, and a job then runs."""
    import ray

    from core.llm_client import EngineUnavailableError
    from services.deployments.video import Deployment

    missing = tmp_path / "no_such_wan"
    sec = _section(profile, tmp_path, f"test-mgr-{uuid.uuid4().hex[:8]}", workers=1)  # one slot to give up
    sec["engine"]["model"] = str(missing)
    dep = Deployment(sec, str(model_dir))
    cfg = profile.video.engine
    early = _submit(ray, dep.manager, cfg, num_inference_steps=2)  # queued while the worker tries to load
    with pytest.raises(EngineUnavailableError) as e:
        answers = _ready(dep)
        raise AssertionError(f"a deployment whose engine cannot load said ready: {answers}")
    assert e.value.status_code == 503 and e.value.code == "engine_unavailable" and str(missing) in str(e.value)
    state = ray.get(dep.manager.readiness.remote())
    assert (state["ready"], state["loaded"], state["starts"]) == (False, 0, [ENGINE_LOAD_ATTEMPTS]), state
    assert str(missing) in state["error"], state
    jobs = [early] + [_submit(ray, dep.manager, cfg, num_inference_steps=2) for _ in range(3)]
    for job in jobs:
        rec = _wait(ray, dep.manager, job, lambda r: r["status"] in _DONE)
        assert (rec["status"], rec["error_code"]) == ("failed", "engine_unavailable"), rec
        assert str(missing) in rec["error_message"]
    assert ray.get(dep.manager.readiness.remote())["starts"] == [ENGINE_LOAD_ATTEMPTS]  # no restart per job
    ray.kill(dep.manager, no_restart=True)

    (tmp_path / "ok").mkdir()
    dep = Deployment(_section(profile, tmp_path / "ok", f"test-mgr-{uuid.uuid4().hex[:8]}"), str(model_dir))
    assert _ready(dep)[-1] is True
    job = asyncio.run(dep.create({"prompt": "a red kite", "num_inference_steps": 2}))["id"]
    assert _wait(ray, dep.manager, job, lambda r: r["status"] in _DONE)["status"] == "completed"
    ray.kill(dep.manager, no_restart=True)


def _kill_for_good(ray, manager, timeout_s: float = 60.0) -> None:
    """``ray.kill(manager, no_restart=True)`` and wait until the actor is dead (a call raises RayActorError): the
    kill is asynchronous, and a call sent before it lands is still answered by the old actor (seen once: the
    read below then kept the old handle). A state, not a time; bounded."""
    ray.kill(manager, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(manager.ping.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed manager still answers"
        time.sleep(0.05)


def test_killed_manager_is_restarted_and_reacquired(ray_cluster, profile, model_dir, tmp_path):
    """The video deployment's manager (Deployment, outside Serve). Killed with restart (as a crash would): the
    next API call works on the restarted manager and the job that was running is failed ``interrupted``, its
    worker gone. Killed for good: a read re-acquires the named manager (a new one) and answers; a create on the
    dead handle is 503 ``model_unavailable`` (not repeated: it may have been applied), the next create works."""
    import ray

    from services.deployments.video import Deployment

    dep = Deployment(_section(profile, tmp_path, f"test-mgr-{uuid.uuid4().hex[:8]}"), str(model_dir))
    _ready(dep)
    job = asyncio.run(dep.create({"prompt": "a red kite", **LONG}))["id"]
    rec = _wait(ray, dep.manager, job, lambda r: r["status"] == "in_progress" and r["progress"] > 0)

    ray.kill(dep.manager, no_restart=False)
    page = asyncio.run(dep.list())
    assert [v["id"] for v in page["data"]] == [job]
    v = asyncio.run(dep.get(job))
    assert v["status"] == "failed" and v["error"]["code"] == "interrupted"
    assert _gone(rec["worker_pid"]), "the running job's worker outlived the manager"

    first = dep.manager
    _kill_for_good(ray, first)
    assert asyncio.run(dep.get(job))["status"] == "failed"  # a read: re-acquired, asked again
    assert dep.manager._actor_id != first._actor_id

    _kill_for_good(ray, dep.manager)
    with pytest.raises(ManagerUnavailableError) as e:  # a write on a dead handle: not repeated
        asyncio.run(dep.create({"prompt": "a blue kite", "num_inference_steps": 2}))
    err = to_api_error(e.value)  # what the API answers
    assert (err.status, err.code, err.headers) == (503, "model_unavailable", {"Retry-After": "5"})
    new = asyncio.run(dep.create({"prompt": "a blue kite", "num_inference_steps": 2}))
    assert new["status"] == "queued"
    assert _wait(ray, dep.manager, new["id"], lambda r: r["status"] in _DONE)["status"] == "completed"
    ray.kill(dep.manager, no_restart=True)


def test_changed_config_replaces_the_manager(ray_cluster, profile, model_dir, tmp_path):
    """get_manager with config A, again with A (the same actor), then with B (max_queued 1): the A manager is
    killed, the one answering has B's hash and applies B's queue limit (a second job is 429 ``queue_full``);
    re-acquiring with A and ``replace=False`` (an old replica) returns B untouched."""
    ray = ray_cluster
    name = f"test-mgr-{uuid.uuid4().hex[:8]}"
    a = _section(profile, tmp_path, name)["engine"]
    b = _section(profile, tmp_path, name, max_queued=1)["engine"]
    assert config_hash(a, str(model_dir), "chimera-video") != config_hash(b, str(model_dir), "chimera-video")
    mgr_a = get_manager(a, str(model_dir), "chimera-video")
    assert get_manager(a, str(model_dir), "chimera-video")._actor_id == mgr_a._actor_id
    mgr_b = get_manager(b, str(model_dir), "chimera-video")
    assert mgr_b._actor_id != mgr_a._actor_id
    assert ray.get(mgr_b.get_config_hash.remote()) == config_hash(b, str(model_dir), "chimera-video")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(mgr_a.get_config_hash.remote())
    # a replica of the old deployment re-acquiring its lost handle takes the live manager, B, as it is
    assert get_manager(a, str(model_dir), "chimera-video", replace=False)._actor_id == mgr_b._actor_id
    cfg = profile.video.engine
    job = ray.get(mgr_b.create.remote(plan_request(cfg, {"prompt": "a kite", **LONG}).to_dict()))["id"]
    with pytest.raises(Exception) as e:
        ray.get(mgr_b.create.remote(plan_request(cfg, {"prompt": "a kite"}).to_dict()))
    assert (e.value.cause.status_code, e.value.cause.code) == (429, "queue_full")
    ray.get(mgr_b.delete.remote(job))
    ray.kill(mgr_b, no_restart=True)
