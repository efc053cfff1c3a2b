"""Validating a video request against the profile, before anything is queued.

Field names are OpenAI's Videos API (``prompt``, ``model``, ``seconds``, ``size="WxH"``) plus vLLM-Omni's
(``width``, ``height``, ``num_frames``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``,
``seed``, ``fps``) and ours (``sparsity``, ``drift_correction``). Values may arrive as strings (multipart forms).

Duration: a clip has ``F`` frames (``num_frames``, else the profile's ``frames_per_clip``; always 4k+1, Wan's
VAE compresses time by 4: diffusers would silently round, we refuse) and covers ``(F - 1) / fps`` seconds;
chained clips share their seam frame, so ``N`` clips give ``1 + N (F - 1)`` frames. ``seconds`` asks for
``N = ceil(seconds * fps / (F - 1))`` clips; without ``seconds`` one clip is made.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .config import VideoConfig

_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")


class RequestError(ValueError):
    """A request field is invalid; ``param`` names it, ``code`` is a stable machine-readable reason (the HTTP
    layer answers 400 with both). Codes: ``invalid_value`` (default), ``invalid_size``, ``invalid_frame_count``,
    ``invalid_duration``, ``prompt_too_long``, ``unsupported_input``."""

    status_code = 400

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self):  # keeps param and code when pickled across processes (Ray)
        return (type(self), (str(self), self.param, self.code))


class VideoParams(BaseModel):
    """Raw request fields (unknown fields are ignored, so vLLM-Omni and OpenAI clients both work)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    prompt: str
    model: str | None = None
    seconds: float | None = None
    size: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    sparsity: float | None = None
    drift_correction: bool = True

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, v):
        return None if v in ("", None) else v


@dataclass
class VideoRequest:
    """A validated request: everything the engine needs (sizes in pixels, ``fps`` in Hz)."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    frames_per_clip: int
    num_clips: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int | None
    sparsity: float = 1.0
    drift_correction: bool = True
    seconds: float | None = None

    @property
    def total_frames(self) -> int:
        """Frames of the joined video: ``1 + num_clips * (frames_per_clip - 1)``."""
        return 1 + self.num_clips * (self.frames_per_clip - 1)

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def duration_s(self) -> float:
        """Seconds the requested clips cover (``seconds`` if given)."""
        return self.seconds if self.seconds is not None else self.num_clips * (self.frames_per_clip - 1) / self.fps

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VideoRequest":
        return cls(**d)


def _first_error(err: ValidationError) -> RequestError:
    e = err.errors()[0]
    param = ".".join(str(x) for x in e["loc"]) or None
    code = "missing_required_parameter" if e["type"] == "missing" else "invalid_value"
    return RequestError(f"{param}: {e['msg']}", param, code)


def plan_request(cfg: VideoConfig, fields: dict, has_image: bool = False) -> VideoRequest:
    """Validate raw request ``fields`` against the profile (``cfg.defaults``, ``cfg.limits``).

    Raises RequestError (a ValueError; HTTP 400) naming the field: unknown ``size`` strings, ``size`` and
    ``width``/``height`` that disagree, sizes not multiples of ``cfg.size_multiple`` or over the limits,
    ``seconds`` <= 0 or over ``max_seconds``, ``num_frames`` not 4k+1, too many clips, prompt too long,
    ``sparsity`` outside (0, 1], image input on a model without image-to-video.
    """
    try:
        p = VideoParams.model_validate(fields)
    except ValidationError as err:
        raise _first_error(err) from None
    lim, d = cfg.limits, cfg.defaults
    if not p.prompt.strip():
        raise RequestError("prompt must not be empty", "prompt")
    if len(p.prompt) > lim.max_prompt_chars:
        raise RequestError(f"prompt is {len(p.prompt)} characters, the limit is {lim.max_prompt_chars}", "prompt",
                           "prompt_too_long")
    if p.negative_prompt is not None and len(p.negative_prompt) > lim.max_prompt_chars:
        raise RequestError(f"negative_prompt is over {lim.max_prompt_chars} characters", "negative_prompt",
                           "prompt_too_long")

    width, height = p.width, p.height
    if p.size is not None:
        m = _SIZE.match(p.size)
        if not m:
            raise RequestError(f"size {p.size!r} is not of the form 'WIDTHxHEIGHT' (e.g. '832x480')", "size",
                               "invalid_size")
        sw, sh = int(m.group(1)), int(m.group(2))
        if (width is not None and width != sw) or (height is not None and height != sh):
            raise RequestError(f"size {p.size!r} disagrees with width={width} height={height}", "size",
                               "invalid_size")
        width, height = sw, sh
    width = d.width if width is None else width
    height = d.height if height is None else height
    mult = cfg.size_multiple
    for name, v, cap in (("width", width, lim.max_width), ("height", height, lim.max_height)):
        if v <= 0 or v % mult:
            raise RequestError(f"{name} {v} must be a positive multiple of {mult} pixels for this model", "size",
                               "invalid_size")
        if v > cap:
            raise RequestError(f"{name} {v} is over the limit of {cap} pixels", "size", "invalid_size")
    if width * height > lim.max_pixels:
        raise RequestError(f"size {width}x{height} is over the limit of {lim.max_pixels} pixels", "size",
                           "invalid_size")

    fps = d.fps if p.fps is None else p.fps
    if not 1 <= fps <= 60:
        raise RequestError(f"fps {fps} must be between 1 and 60", "fps")
    frames = d.frames_per_clip if p.num_frames is None else p.num_frames
    if frames < 5 or (frames - 1) % 4:
        lo = max(5, (frames - 1) // 4 * 4 + 1)
        raise RequestError(f"num_frames {frames} is not of the form 4k+1 (Wan's VAE compresses time by 4); "
                           f"use {lo} or {lo + 4}", "num_frames", "invalid_frame_count")
    if frames > lim.max_frames_per_clip:
        raise RequestError(f"num_frames {frames} is over the limit of {lim.max_frames_per_clip} per clip",
                           "num_frames", "invalid_frame_count")
    if p.seconds is not None:
        if not math.isfinite(p.seconds) or p.seconds <= 0:
            raise RequestError(f"seconds must be greater than 0 (got {p.seconds})", "seconds", "invalid_duration")
        if p.seconds > lim.max_seconds:
            raise RequestError(f"seconds {p.seconds:g} is over the limit of {lim.max_seconds:g}", "seconds",
                               "invalid_duration")
        clips = max(1, math.ceil(p.seconds * fps / (frames - 1) - 1e-9))
    else:
        clips = 1
    if clips > lim.max_clips:
        raise RequestError(f"{p.seconds:g} s at {fps} fps needs {clips} clips of {frames} frames; the limit is "
                           f"{lim.max_clips} clips", "seconds", "invalid_duration")
    steps = d.num_inference_steps if p.num_inference_steps is None else p.num_inference_steps
    if not 1 <= steps <= lim.max_steps:
        raise RequestError(f"num_inference_steps must be between 1 and {lim.max_steps}", "num_inference_steps")
    guidance = d.guidance_scale if p.guidance_scale is None else p.guidance_scale
    if not (math.isfinite(guidance) and 0 <= guidance <= 50):
        raise RequestError("guidance_scale must be between 0 and 50", "guidance_scale")
    sparsity = cfg.sparse_attention.sparsity if p.sparsity is None else p.sparsity
    if not (0 < sparsity <= 1):
        raise RequestError(f"sparsity {sparsity} must be in (0, 1] (fraction of attention kept; 1.0 = dense)",
                           "sparsity")
    if has_image and cfg.variant == "t2v" and not cfg.i2v_model:
        raise RequestError("this model is text-to-video only (no i2v_model configured)", "input_reference",
                           "unsupported_input")
    if clips > 1 and cfg.variant == "t2v" and not cfg.i2v_model:
        raise RequestError("chained clips need image-to-video, which this model lacks; ask for one clip",
                           "seconds", "unsupported_input")
    return VideoRequest(prompt=p.prompt, negative_prompt=d.negative_prompt if p.negative_prompt is None
                        else p.negative_prompt, width=width, height=height, frames_per_clip=frames,
                        num_clips=clips, fps=fps, num_inference_steps=steps, guidance_scale=guidance,
                        seed=p.seed, sparsity=sparsity, drift_correction=p.drift_correction,
                        seconds=p.seconds)
