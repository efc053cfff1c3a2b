"""The models a profile serves: ``GET /v1/models`` and ``/v1/models/{id}`` (OpenAI list shape), and the check of a
request's ``model`` field against its endpoint's family."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..config.profiles import Profile
from .errors import APIError

OWNERS = {"vlm": "chimera", "video": "chimera", "tts": "chimera"}


def make_models_router(profile: Profile, started_at: float) -> APIRouter:
    """Routes ``GET /v1/models`` and ``GET /v1/models/{model_id}`` (404 ``model_not_found`` for an unknown id);
    ``created`` is ``started_at`` (Unix seconds) for every model."""
    router = APIRouter(tags=["models"])
    families = profile.families()

    @router.get("/v1/models")
    async def list_models():
        """The models this profile serves (OpenAI list shape)."""
        return {"object": "list", "data": [
            {"id": s.model_id, "object": "model", "created": int(started_at), "owned_by": OWNERS[f]}
            for f, s in families.items()]}

    @router.get("/v1/models/{model_id}")
    async def get_model(model_id: str):
        """One model by id (404 if unknown)."""
        for f, s in families.items():
            if s.model_id == model_id:
                return {"id": s.model_id, "object": "model", "created": int(started_at), "owned_by": OWNERS[f]}
        raise APIError(404, f"model {model_id!r} not found", param="model", code="model_not_found")

    return router


def check_model(profile: Profile, family: str, model: Any, param: str = "model") -> str:
    """Resolve a request's ``model`` for ``family``: None -> the family's model; an unknown id -> 404; another
    family's model -> 400. Returns the model id."""
    section = getattr(profile, family)
    if model is None:
        return section.model_id
    if not isinstance(model, str):
        raise APIError(400, "model must be a string", param=param, code="invalid_value")
    if model == section.model_id:
        return model
    if model in profile.model_ids():
        raise APIError(400, f"model {model!r} does not serve this endpoint (use {section.model_id!r})", param=param,
                       code="model_not_supported")
    raise APIError(404, f"model {model!r} not found (available: {', '.join(profile.model_ids())})", param=param,
                   code="model_not_found")
