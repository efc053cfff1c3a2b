"""Entry point for a Ray cluster that runs Chimera from a Serve config file (``serve deploy configs/serve.yaml``,
or KubeRay's ``RayService`` with the same ``serveConfigV2``: ``configs/kuberay-rayservice.yaml``).

``import_path: services.cluster:app_builder`` with ``args: {profile: gpu}``. The per-deployment options in the
config file (``ray_actor_options``, ``autoscaling_config``, ``max_ongoing_requests``, ``max_queued_requests``)
override the profile's; ``tests/test_cluster_config.py`` keeps the two consistent. Every node must see the
profile's ``model_dir`` (a shared volume holding what ``chimera prepare --profile gpu`` fetched) and have
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=services.api.edge:proxy_middlewares`` in its environment (the HTTP proxy
that Serve starts on each node reads it; ``chimera serve`` sets it itself when it starts Ray).
"""

from __future__ import annotations

from .config.memory_plan import check
from .config.profiles import load_profile
from .serve_app import build_application

ARGS = {"profile"}


def app_builder(args: dict):
    """Serve application builder: ``args`` = ``{"profile": <name or path>}`` (default ``gpu``).

    Checks the memory plan (:func:`services.config.memory_plan.check`, raising PlanError with the numbers when the
    profile does not fit ``ray.gpu_memory_gib`` GPUs) and returns the bound application (nothing starts here).
    Raises ValueError for other keys in ``args``, ProfileError for a bad profile.
    """
    unknown = set(args) - ARGS
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)} (accepted: {sorted(ARGS)})")
    profile = load_profile(args.get("profile", "gpu"))
    check(profile)
    return build_application(profile)
