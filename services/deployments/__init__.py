"""The model replicas of the Ray Serve application, one class per family (:func:`deployment_class`)."""

from __future__ import annotations

import importlib

DEPLOYMENT_MODULES = {"vlm": "services.deployments.vlm", "video": "services.deployments.video",
                      "tts": "services.deployments.speech"}


def deployment_class(family: str) -> type:
    """The Ray Serve replica class (``Deployment``) of ``family`` (``vlm``, ``video``, ``tts``); KeyError for an
    unknown family. Imported on demand, so the ingress never imports a family's model code."""
    return importlib.import_module(DEPLOYMENT_MODULES[family]).Deployment
