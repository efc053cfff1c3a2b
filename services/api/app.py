"""The FastAPI ingress, built by a factory so tests can drive it without Ray (``httpx.ASGITransport``).

``build_app(profile, backends)`` mounts the routes of every family in the profile (:mod:`services.api.chat`,
:mod:`services.api.videos`, :mod:`services.api.speech`), the operational endpoints (``/healthz``, ``/readyz``,
``/metrics``, ``/v1/models``), API-key auth for ``/v1/*``, per-endpoint metrics and OpenAI-shaped errors.
"""

from __future__ import annotations

import importlib
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config.profiles import Profile
from ..deployments.backends import Backend
from . import metrics
from .auth import AuthMiddleware
from .edge import EdgeMiddleware
from .errors import error_body, install_error_handlers
from .models import make_models_router
from .playground import mount_playground
from .readiness import ReadyStates

ROUTER_MODULES = {"vlm": "services.api.chat", "video": "services.api.videos", "tts": "services.api.speech"}


def family_router(family: str):
    """``make_router(section, backend, profile)`` of a family's API module (:data:`ROUTER_MODULES`); KeyError for
    an unknown family."""
    return importlib.import_module(ROUTER_MODULES[family]).make_router


def build_app(profile: Profile, backends: dict[str, Backend]) -> FastAPI:
    """Build the ingress app for ``profile`` with one backend per family present (``vlm``, ``video``, ``tts``).

    Raises KeyError if a family of the profile has no backend."""
    app = FastAPI(title="Chimera", version="0.1.0",
                  description="OpenAI-compatible API for a grafted vision-LLM, video diffusion jobs and speech.")
    app.state.profile = profile
    app.state.backends = backends
    install_error_handlers(app)
    families = profile.families()

    @app.get("/healthz", tags=["ops"])
    async def healthz():
        """Liveness: the ingress answers."""
        return {"status": "ok"}

    ready_states = ReadyStates({f: (lambda f=f: backends[f].call("ready")) for f in families})

    @app.get("/readyz", tags=["ops"])
    async def readyz():
        """200 once every model of the profile is loaded, else 503 listing those that are not; answered within
        about a second even while the deployments start (:class:`services.api.readiness.ReadyStates`)."""
        states = await ready_states.current()
        not_ready = [families[f].model_id for f, ok in states.items() if not ok]
        body = {"status": "ready" if not not_ready else "loading",
                "models": {families[f].model_id: ("ready" if ok else "loading") for f, ok in states.items()}}
        if not_ready:
            body["error"] = error_body(f"models not loaded yet: {', '.join(not_ready)}", "service_unavailable",
                                       None, "model_not_ready")["error"]
        return JSONResponse(body, status_code=200 if not not_ready else 503)

    @app.get("/metrics", tags=["ops"])
    async def prometheus_metrics():
        """Prometheus text exposition of the ingress metrics (before-scrape hooks refresh gauges first)."""
        await metrics.run_before_scrape()
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    app.state.started_at = time.time()
    app.include_router(make_models_router(profile, app.state.started_at))
    for fam, section in families.items():
        app.include_router(family_router(fam)(section, backends[fam], profile))

    mount_playground(app)
    app.add_middleware(metrics.MetricsMiddleware, router=app.router)
    app.add_middleware(AuthMiddleware, keys=profile.server.all_api_keys(),
                       protect_metrics=profile.server.metrics_requires_key)
    app.add_middleware(EdgeMiddleware, limits=profile.server.limits.body_limits())
    return app
