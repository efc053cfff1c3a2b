"""Profiles: which checkpoints, devices, limits and Ray Serve options the service runs with.

A profile is a YAML file in ``configs/`` (``configs/<name>.yaml``) or any path, validated by pydantic.
Every model family owns the schema of its ``engine:`` block (``grafting.config.VLMConfig``,
``video.config.VideoConfig``, ``audio.config.TTSConfig``); this module composes them with the
deployment options. A wrong key or value raises :class:`ProfileError` naming the key and the reason.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Generic, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from audio.config import TTSConfig
from core.config import ConfigFieldError, Strict, in_project
from grafting.config import VLMConfig
from video.config import VideoConfig

CONFIG_DIR = Path(str(importlib.resources.files("configs")))  # package data: installed with the package
E = TypeVar("E", bound=BaseModel)


class ProfileError(ValueError):
    """A profile file is missing, unreadable, or has a wrong key or value (the message names it)."""


class DeploymentOptions(Strict):
    """Ray Serve options of one deployment (see ``ray.serve.deployment``).

    ``num_cpus``/``num_gpus`` are per replica; fractional CPUs let three deployments share a 2-core host.
    ``max_queued_requests`` bounds the queue: beyond it requests get 429 with ``Retry-After``.
    ``max_surge_percent``: when a redeploy (``chimera serve``'s SIGHUP reload) replaces this deployment's replicas,
    Ray Serve first starts up to this percentage of ``num_replicas`` (rounded up) as new replicas and stops an old
    one only once its replacement is ready, so requests keep being answered (Ray's ``max_surge_percent``). 0: an old
    replica stops before its replacement starts (requests wait, or fail when it was the only one). None (default):
    100 for a deployment without GPUs, 0 for one with GPUs, whose surge replica needs GPUs of its own
    (``services/config/memory_plan.py`` counts them when set). ``graceful_shutdown_timeout_s``: how long a stopping
    replica's in-flight requests may still run (Ray's default 20 s) before it is killed.
    """

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(8, ge=1)
    max_queued_requests: int = Field(64, ge=-1)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    # Threads for torch inside the replica (Ray pins OMP to the replica's CPUs otherwise).
    torch_threads: int | None = Field(None, ge=1)
    max_surge_percent: int | None = Field(None, ge=0, le=100)
    graceful_shutdown_timeout_s: float = Field(20.0, gt=0)

    def surge_percent(self) -> int:
        """``max_surge_percent`` as Ray gets it: the value, or for None 100 without GPUs and 0 with them."""
        if self.max_surge_percent is not None:
            return self.max_surge_percent
        return 100 if self.num_gpus == 0 else 0

    def surge_replicas(self) -> int:
        """Replicas started beside the old ones during a redeploy: ``ceil(surge_percent x num_replicas / 100)``
        (Ray's integer ceiling, ``deployment_state._surge_replicas_to_start``)."""
        return (self.surge_percent() * self.num_replicas + 99) // 100


class FamilySection(Strict, Generic[E]):
    """One model family in a profile: the public model id, its deployment options and its engine config."""

    model_id: str
    deployment: DeploymentOptions = DeploymentOptions()
    engine: E


class EdgeLimits(Strict):
    """Size and time limits enforced at the edge (``services/api/edge.py``, in Ray's proxy: before any replica).

    Body limits in bytes per route (``Content-Length``, or counted while a chunked body arrives; over it: 413
    ``request_too_large``); ``default_body_bytes`` covers every other request. Websocket
    (``/v1/audio/speech/stream``) limits: ``ws_max_message_bytes`` per client frame (over it: close 1009),
    ``ws_max_pending_commits`` committed utterances waiting for audio (over it: error ``too_many_commits``,
    the commit is dropped, the socket stays open), ``ws_idle_timeout_s`` without a client frame while no audio
    is being made (then: close 1001)."""

    chat_body_bytes: int = Field(20 << 20, gt=0)
    speech_body_bytes: int = Field(1 << 20, gt=0)
    video_body_bytes: int = Field(24 << 20, gt=0)
    extension_body_bytes: int = Field(272 << 20, gt=0)
    default_body_bytes: int = Field(1 << 20, gt=0)
    ws_max_message_bytes: int = Field(64 << 10, gt=0)
    ws_max_pending_commits: int = Field(8, ge=1)
    ws_idle_timeout_s: float = Field(300.0, gt=0)

    def body_limits(self) -> dict:
        """The body limits as :class:`services.api.edge.EdgeMiddleware` takes them: ``{"routes", "default"}``."""
        return {"routes": {"/v1/chat/completions": self.chat_body_bytes, "/v1/audio/speech": self.speech_body_bytes,
                           "/v1/videos": self.video_body_bytes, "/v1/videos/extensions": self.extension_body_bytes},
                "default": self.default_body_bytes}


#: Environment variable with more API keys (comma-separated), added to the profile's ``server.api_keys``.
API_KEYS_ENV = "CHIMERA_API_KEYS"


class ServerOptions(Strict):
    """HTTP front door: bind address, API keys (empty = no auth), edge limits, timeouts.

    ``api_keys``: accepted bearer keys; :meth:`all_api_keys` adds those of ``CHIMERA_API_KEYS``. With none,
    the API is open. ``metrics_requires_key``: ``/metrics`` needs a key too (only when keys are configured)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_keys: list[str] = []
    metrics_requires_key: bool = False
    limits: EdgeLimits = EdgeLimits()
    request_timeout_s: float = Field(600.0, gt=0)
    ingress: DeploymentOptions = DeploymentOptions(num_cpus=0.25, max_ongoing_requests=256, max_queued_requests=-1)

    def all_api_keys(self) -> list[str]:
        """The profile's keys plus those of ``CHIMERA_API_KEYS`` (comma-separated, blanks dropped), deduplicated
        in order. Raises ProfileError for a blank key in the profile."""
        keys = list(self.api_keys) + [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
        if any(not k.strip() for k in self.api_keys):
            raise ProfileError("server.api_keys: a key must not be blank")
        return list(dict.fromkeys(keys))


class RayOptions(Strict):
    """Options for ``ray.init`` when ``chimera serve`` starts a local cluster (ignored when joining one).

    ``gpu_memory_gib``: memory of each GPU, for the memory plan checked at start (``services/config/memory_plan.py``,
    ``chimera profile show``); None: read from the visible CUDA devices, unchecked where there are none.
    """

    address: str | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None
    gpu_memory_gib: float | None = Field(None, gt=0)


class Profile(Strict):
    """A whole service profile. Sections left out (``vlm``, ``video``, ``tts``) are not deployed."""

    name: str
    model_dir: Path = Path(".chimera/models/cpu")
    server: ServerOptions = ServerOptions()
    ray: RayOptions = RayOptions()
    vlm: FamilySection[VLMConfig] | None = None
    video: FamilySection[VideoConfig] | None = None
    tts: FamilySection[TTSConfig] | None = None

    @model_validator(mode="after")
    def _vllm_spans_the_deployment_gpus(self) -> "Profile":
        """With the ``vllm`` backend on GPUs, the LLM is split over exactly the VLM deployment's GPUs."""
        v = self.vlm
        if v is not None and v.engine.backend == "vllm" and v.deployment.num_gpus >= 1 \
                and v.engine.vllm.tensor_parallel_size != v.deployment.num_gpus:
            raise ValueError(f"vlm.engine.vllm.tensor_parallel_size ({v.engine.vllm.tensor_parallel_size}) must equal "
                             f"vlm.deployment.num_gpus ({v.deployment.num_gpus:g})")
        return self

    def resolved_model_dir(self) -> Path:
        """The model directory as an absolute path (``CHIMERA_MODEL_DIR`` overrides the profile; a relative one is
        under :func:`core.config.project_dir`, :func:`core.config.in_project`)."""
        return in_project(os.environ.get("CHIMERA_MODEL_DIR") or self.model_dir).resolve()

    def families(self) -> dict[str, FamilySection]:
        """The configured sections by family name (``vlm``, ``video``, ``tts``), in that order."""
        return {k: getattr(self, k) for k in ("vlm", "video", "tts") if getattr(self, k) is not None}

    def model_ids(self) -> dict[str, str]:
        """Public model id -> family name."""
        return {s.model_id: fam for fam, s in self.families().items()}


def profile_path(name_or_path: str | os.PathLike) -> Path:
    """``cpu`` -> ``configs/cpu.yaml``; an existing path is returned as is. Raises ProfileError if missing."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))
    raise ProfileError(f"profile {str(name_or_path)!r} not found (known profiles: {', '.join(known)})")


def _format_validation_error(err: ValidationError) -> str:
    """Each error as ``  <dotted key>: <reason>``; a family config's cross-field check
    (:class:`core.config.ConfigFieldError`) names its key below the section (``vlm.engine`` +
    ``default_max_new_tokens``)."""
    lines = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"] if not str(x).startswith("FamilySection")]
        msg = e["msg"]
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigFieldError):
            loc, msg = loc + [cause.field], cause.reason
        lines.append(f"  {'.'.join(loc) or '<root>'}: {msg}")
    return "invalid profile:\n" + "\n".join(lines)


def parse_profile(data: dict) -> Profile:
    """Validate a profile dict. Raises ProfileError listing every wrong key (dotted path) and why."""
    try:
        return Profile.model_validate(data)
    except ValidationError as err:
        raise ProfileError(_format_validation_error(err)) from None


def load_profile(name_or_path: str | os.PathLike = "cpu") -> Profile:
    """Load and validate ``configs/<name>.yaml`` (or a path). Raises ProfileError."""
    path = profile_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ProfileError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile must be a mapping")
    try:
        return parse_profile(data)
    except ProfileError as err:
        raise ProfileError(f"{path}: {err}") from None
