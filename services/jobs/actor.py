"""The job manager as a named, detached Ray actor: found by name, replaced when its configuration differs."""

from __future__ import annotations

import time

from .manager import JobManager, config_hash


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
