"""The Ray Serve application: one FastAPI ingress deployment plus one deployment per model family.

``build_application(profile)`` binds every family's ``Deployment`` (``services/api/chat.py`` ...) with the profile's
options and passes their handles to the ingress, whose FastAPI app is built at replica start by
:func:`services.api.app.build_app`. ``run(profile)`` starts it on the profile's host and port; ``stop()`` ends it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from ray import serve

from .api.app import build_app
from .config.profiles import DeploymentOptions, Profile
from .deployments import deployment_class
from .deployments.backends import RayBackend
from .deployments.base import EngineDeployment

log = logging.getLogger("chimera")

APP_NAME = "chimera"
PROXY_CALLBACK = "services.api.edge:proxy_middlewares"
# While a replica shuts down it polls its in-flight requests this often (Ray's default, 2 s, is paid once per
# shutdown tier even by an idle replica: ingress, then the model deployments). In-flight requests still finish, up
# to Ray's graceful_shutdown_timeout_s (20 s).
DRAIN_POLL_S = 0.2


@serve.ingress()
class Ingress:
    """The HTTP ingress replica: holds one :class:`RayBackend` per family."""

    def __init__(self, profile: dict, **handles: Any):
        self.profile = Profile.model_validate(profile)
        self.backends = {fam: RayBackend(h) for fam, h in handles.items()}

    def __serve_build_asgi_app__(self):
        return build_app(self.profile, self.backends)


def _options(name: str, o: DeploymentOptions) -> dict:
    env = {"OMP_NUM_THREADS": str(o.torch_threads)} if o.torch_threads else {}
    return dict(name=name, num_replicas=o.num_replicas, max_ongoing_requests=o.max_ongoing_requests,
                max_queued_requests=o.max_queued_requests, health_check_period_s=o.health_check_period_s,
                health_check_timeout_s=o.health_check_timeout_s, graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
                graceful_shutdown_timeout_s=o.graceful_shutdown_timeout_s, max_surge_percent=o.surge_percent(),
                ray_actor_options={"num_cpus": o.num_cpus, "num_gpus": o.num_gpus,
                                   "runtime_env": {"env_vars": env} if env else {}})


def _versioned(dep, name: str, what: Any):
    """``dep`` with a Serve version derived from its class and ``what`` its replicas are built from (sha256 of
    their JSON, 16 hex digits). Without one, ``serve.run`` gives every deployment a random version, so a redeploy
    restarted every replica (Ray's ``client.deploy_applications``); with it a redeploy restarts only the
    deployments whose ``what`` changed, and Ray itself restarts those whose ``ray_actor_options`` changed and
    applies the other options (``num_replicas``, ``max_ongoing_requests`` ...) in place, as for Serve's own
    config-file deploys. ``version`` is no public option of ``Deployment.options`` any more: it is passed the way
    Serve passes it internally (``_internal=True``)."""
    blob = json.dumps([name, dep.func_or_class.__qualname__, what], sort_keys=True, default=str)
    return dep.options(version=hashlib.sha256(blob.encode()).hexdigest()[:16], _internal=True)


def build_application(profile: Profile, hold_until_ready: bool = False):
    """Bind the whole application graph for ``profile`` (nothing starts until ``serve.run``). Each deployment is
    versioned by its constructor arguments (:func:`_versioned`): deploying a changed profile over a running one
    replaces only the changed deployments (the ingress, which holds the whole profile, whenever anything
    changed), each with its ``max_surge_percent``. ``hold_until_ready`` (a reload, :func:`redeploy`): a new
    replica of an engine deployment (VLM, speech) finishes its constructor only once its engine answers
    (``EngineDeployment._hold_until_ready``), so that Serve keeps the old replica serving until then; it is no
    part of the version. At start it is False: replicas construct at once and ``/readyz`` reports the models
    still loading."""
    model_dir = str(profile.resolved_model_dir())
    handles = {}
    for fam, section in profile.families().items():
        opts = _options(fam, section.deployment)
        if fam == "vlm":  # issue 11 hook: image-cache-aware routing across VLM replicas (services/deployments/routing.py)
            from .deployments.routing import router_config

            opts["request_router_config"] = router_config()
        args = [section.model_dump(mode="json"), model_dir]
        cls = deployment_class(fam)
        # the version leaves the deployment options out: Ray compares them itself (torch_threads, which the
        # replica reads from its section, is in ray_actor_options' env too)
        dep = _versioned(serve.deployment(cls).options(**opts), fam, [section.model_dump(mode="json",
                                                                                          exclude={"deployment"}),
                                                                       model_dir])
        hold = {"hold_until_ready": True} if hold_until_ready and issubclass(cls, EngineDeployment) else {}
        handles[fam] = dep.bind(*args, **hold)
    data = profile.model_dump(mode="json")
    ingress = _versioned(serve.deployment(Ingress).options(**_options("ingress", profile.server.ingress)),
                         "ingress", data)
    return ingress.bind(data, **handles)


def init_ray(profile: Profile, **overrides: Any) -> None:
    """Start (or join) Ray with the edge middleware installed in Serve's HTTP proxy."""
    import ray

    from .api.edge import LIMITS_ENV
    from core.config import PROJECT_DIR_ENV, project_dir

    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_CALLBACK)
    os.environ[LIMITS_ENV] = json.dumps(profile.server.limits.body_limits())  # the proxy's edge limits
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if profile.ray.address:
        kwargs["address"] = profile.ray.address
    else:
        if profile.ray.num_cpus is not None:
            kwargs["num_cpus"] = profile.ray.num_cpus
        if profile.ray.num_gpus is not None:
            kwargs["num_gpus"] = profile.ray.num_gpus
    kwargs.update(overrides)
    kwargs.setdefault("runtime_env", {"env_vars": {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK,
                                                   LIMITS_ENV: os.environ[LIMITS_ENV],
                                                   PROJECT_DIR_ENV: str(project_dir().resolve())}})
    ray.init(**kwargs)


def run(profile: Profile, host: str | None = None, port: int | None = None, blocking: bool = False) -> str:
    """Deploy the application; returns the base URL. Ray must be initialised (see :func:`init_ray`)."""
    host = host or profile.server.host
    port = port or profile.server.port
    serve.start(http_options={"host": host, "port": port, "request_timeout_s": profile.server.request_timeout_s})
    serve.run(build_application(profile), name=APP_NAME, route_prefix="/", blocking=blocking)
    return f"http://{host}:{port}"


def redeploy(profile: Profile) -> None:
    """Deploy ``profile`` over the running application (``chimera serve``'s SIGHUP reload); returns once Serve
    reports it RUNNING, i.e. every replaced deployment's new replicas are ready, their engines loaded (and, with
    ``max_surge_percent``, the old ones served meanwhile and are draining now, see :func:`build_application`).
    Raises RuntimeError when Serve reports DEPLOY_FAILED (a new replica's constructor kept failing): with surge
    the old replicas keep serving."""
    serve.run(build_application(profile, hold_until_ready=True), name=APP_NAME, route_prefix="/", blocking=False)


def stop() -> None:
    """Stop the service: delete the application (each replica finishes its in-flight requests first, see
    ``DRAIN_POLL_S``; the VLM replica then stops its batcher thread), then disconnect from Ray, which also stops
    the local Ray (Serve's controller and proxies with it) that :func:`init_ray` started (its raylet ends every
    worker process). Does nothing when Ray is not initialised; idempotent."""
    import ray

    if ray.is_initialized():
        # Delete the application (replicas drain and stop their engines), then end the local Ray. Not
        # serve.shutdown(): its controller call graceful_shutdown never returns (the controller ray.kills itself
        # at its end, and the raylet logs the retried task as failed) and it waits out the proxies' drain, seconds
        # for nothing here, since ray.shutdown() ends the controller and proxies with the rest of the local Ray.
        try:
            serve.delete(APP_NAME)
        except Exception:  # noqa: BLE001 - no Serve running (never deployed): nothing to delete
            log.debug("serve.delete(%s) at stop", APP_NAME, exc_info=True)
        ray.shutdown()
