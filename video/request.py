"""Validating a video request against the profile, before anything is queued.

Field names are OpenAI's Videos API (``prompt``, ``model``, ``seconds``, ``size="WxH"``) plus vLLM-Omni's
(``width``, ``height``, ``num_frames``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``,
``seed``, ``fps``) and ours (``sparsity``, ``drift_correction``, ``quality``, ``cache``). Values may arrive as
strings (multipart forms). Any other field is refused (RequestError, code ``unsupported_parameter``, ``param``
naming it): nothing is accepted and silently ignored.

Duration (the rule): an MP4 of ``n`` frames at ``fps`` lasts ``n / fps`` seconds, and that is what the Video
object's ``seconds`` reports. ``seconds`` asks for ``T = max(1, floor(seconds * fps + 1/2))`` frames (for an
extension: ``T`` frames added after the source video's last frame), so the video lasts the requested seconds
within half a frame (within one frame when ``T`` is raised to 1). Without ``seconds`` the video is one clip of
``F`` frames (``F / fps`` seconds; an extension adds ``F - 1``).

Clips: ``F`` (``num_frames``, else the profile's ``frames_per_clip``) is the length of a full clip; it is always
4k+1 with k >= 1 (Wan's VAE compresses time by 4: diffusers would silently round, we refuse). Chained clips
share their seam frame (clip k+1 starts from clip k's last frame, which is not repeated), so clip 0 contributes
all its frames and every later clip (every clip of an extension) ``F - 1`` new ones. The video takes the fewest
clips that reach ``T`` frames: ``N = max(1, ceil((T - c) / (F - 1)))`` with ``c = 1`` (``c = 0`` for an
extension). The last clip is shortened to the smallest 4k+1 length (at least 5) that still covers the frames
left, and the joined frames are cut to exactly ``T`` (at most 4 frames of the last clip are dropped). E.g.
cpu profile (``F = 9``, 2 fps): ``seconds 5`` -> 10 frames = 9 + a 5-frame clip (4 new, 1 kept) = 5.0 s;
gpu profile (``F = 121``, 24 fps): ``seconds 8`` -> 192 frames = 121 + a 73-frame clip (72 new, 71 kept) = 8.0 s.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from core.validate import InputError, check_seed, find_invalid_unicode

from .config import VideoConfig

_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")


class RequestError(InputError):
    """A request field is invalid; ``param`` names it, ``code`` is a stable machine-readable reason (the HTTP
    layer answers 400 with both). Codes: ``invalid_value`` (default), ``invalid_size``, ``invalid_frame_count``,
    ``invalid_duration``, ``prompt_too_long``, ``unsupported_input``, ``unsupported_parameter`` (a field this
    service does not implement), ``unsupported_value`` (a known value this profile does not offer),
    ``invalid_unicode`` (text with a lone UTF-16 surrogate), and
    ``missing_required_parameter``."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message, param, code)


class VideoParams(BaseModel):
    """Raw request fields: OpenAI's, vLLM-Omni's and ours (module doc). Unknown fields are refused, and so is a
    value of another type (a list, an object, a boolean for a number, a number for ``drift_correction``, null for
    ``prompt`` or ``drift_correction``); a number may arrive as its text (multipart forms)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

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
    seed: int | None = None  # range: core.validate.check_seed, after parsing
    sparsity: float | None = None
    drift_correction: bool = True
    quality: str | None = None
    cache: str | None = None

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds(cls, v):
        return None if v in ("", None) else v

    @field_validator("seconds", "width", "height", "num_frames", "fps", "num_inference_steps", "guidance_scale",
                     "seed", "sparsity", mode="before")
    @classmethod
    def _not_a_bool(cls, v):  # pydantic's lax mode would read true/false as 1/0
        if isinstance(v, bool):
            raise ValueError("a boolean is not a number")
        return v

    @field_validator("drift_correction", mode="before")
    @classmethod
    def _a_bool(cls, v):  # a JSON boolean, or a form's text ("true", "false", "1", "0", ...); never a number or null
        if not isinstance(v, (bool, str)):
            raise ValueError("must be a boolean (true or false)")
        return v

    @field_validator("quality", "cache", mode="before")
    @classmethod
    def _none_word(cls, v):  # multipart forms cannot send JSON null: "" / "none" / "null" mean it
        return None if isinstance(v, str) and v.strip().lower() in ("", "none", "null") else v


#: ``quality`` values: ``full`` (the profile's model, scheduler, steps and guidance) and ``fast`` (the
#: step-distilled profile ``cfg.fast``: its LoRA-fused transformer, scheduler, steps and guidance).
QUALITIES = ("full", "fast")
#: ``cache`` values (diffusers' step-cache hooks, :mod:`video.cache`); null: no cache.
CACHES = ("mag", "first_block", "taylorseer")


@dataclass
class VideoRequest:
    """A validated request: everything the engine needs (sizes in pixels, ``fps`` in Hz).

    ``frames_per_clip``: frames of a full clip; ``last_clip_frames``: frames generated for the last clip
    (4k+1, <= ``frames_per_clip``; None: a full clip); ``target_frames``: frames the job produces (an
    extension: the frames it adds), the joined clips cut to it (None: every generated frame is kept);
    ``continuation``: the video continues an existing one (clip 0's first frame is that video's last, dropped).
    Records written before ``target_frames`` existed load with the defaults and keep their old length."""

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
    target_frames: int | None = None
    last_clip_frames: int | None = None
    continuation: bool = False
    quality: str = "full"
    cache: str | None = None

    def clip_frames(self, k: int) -> int:
        """Frames generated for clip ``k`` (0-based): ``frames_per_clip``, the last clip ``last_clip_frames``."""
        if k == self.num_clips - 1 and self.last_clip_frames is not None:
            return self.last_clip_frames
        return self.frames_per_clip

    @property
    def generated_frames(self) -> int:
        """Frames the chained clips join into, before the cut to ``target_frames``."""
        return (0 if self.continuation else 1) + sum(self.clip_frames(k) - 1 for k in range(self.num_clips))

    @property
    def total_frames(self) -> int:
        """Frames this job produces (an extension: the frames it adds to the source video)."""
        return self.generated_frames if self.target_frames is None else self.target_frames

    @property
    def size(self) -> str:
        """``"WxH"``."""
        return f"{self.width}x{self.height}"

    @property
    def duration_s(self) -> float:
        """Seconds the produced frames last in the MP4: ``total_frames / fps``."""
        return self.total_frames / self.fps

    def to_dict(self) -> dict:
        """A plain dict (JSON-serialisable) of the fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VideoRequest":
        """Inverse of :meth:`to_dict`."""
        return cls(**d)


def seconds_label(frames: int, fps: float) -> str:
    """The Video object's ``seconds``: the duration ``frames / fps`` of an MP4, as a decimal string (``"4"``,
    ``"4.5"``; 6 significant digits, so it is off by less than 1e-5 relative)."""
    return f"{frames / fps:g}"


def plan_frames(seconds: float | None, fps: int, frames_per_clip: int, continuation: bool = False
                ) -> tuple[int, int, int]:
    """The duration rule of the module doc: ``(target_frames, num_clips, last_clip_frames)`` for ``seconds``
    (None: one full clip) at ``fps`` with full clips of ``frames_per_clip`` (4k+1 >= 5) frames. Pure
    arithmetic; limits are checked by :func:`plan_request`."""
    c, step = (0 if continuation else 1), frames_per_clip - 1
    if seconds is None:
        return frames_per_clip - 1 + c, 1, frames_per_clip
    target = max(1, math.floor(seconds * fps + 0.5))
    clips = max(1, -(-(target - c) // step))
    rest = target - c - (clips - 1) * step  # new frames the last clip must add, in [0, step]
    last = max(5, 4 * -(-rest // 4) + 1)
    return target, clips, last


def _first_error(err: ValidationError) -> RequestError:
    e = err.errors()[0]
    param = ".".join(str(x) for x in e["loc"]) or None
    code = "missing_required_parameter" if e["type"] == "missing" else "invalid_value"
    return RequestError(f"{param}: {e['msg']}", param, code)


def plan_request(cfg: VideoConfig, fields: dict, has_image: bool = False, continuation: bool = False,
                 inherit: dict | None = None) -> VideoRequest:
    """Validate raw request ``fields`` against the profile (``cfg.defaults``, ``cfg.limits``) and plan the
    clips (module doc). ``continuation``: the request extends an existing video (``seconds`` is the added length).
    ``inherit``: the request (a :meth:`VideoRequest.to_dict`) of the video an extension continues; what the
    extension leaves out (or sends as null) it takes from there: ``quality`` (records older than ``quality``:
    ``"full"``) and ``negative_prompt``; and, when its quality is the source's, the source's
    ``num_inference_steps`` and ``guidance_scale`` (so it looks like the source); with another ``quality`` the
    defaults of that quality (``cfg.fast``'s for ``"fast"``, ``cfg.defaults``' for ``"full"``). Fields given
    always win.

    Raises RequestError (a ValueError; HTTP 400) naming the field: a field not implemented here
    (``unsupported_parameter``), text with a lone surrogate (``invalid_unicode``), unknown ``size`` strings,
    ``size`` and ``width``/``height`` that disagree, sizes not multiples of ``cfg.size_multiple`` or over the
    limits, ``seconds`` <= 0 or over ``max_seconds``, ``num_frames`` under 5 or not 4k+1 or over the limit, too
    many clips, prompt too long, ``seed`` not an integer with ``|seed| < 2**63``, ``sparsity`` outside (0, 1],
    image input on a model without image-to-video,
    ``quality`` not in :data:`QUALITIES` or ``cache`` not in :data:`CACHES` (``invalid_value``), ``quality
    "fast"`` on a profile without a fast profile or ``cache "mag"`` without calibrated ratios
    (``unsupported_value``). ``quality "fast"`` takes its step count and guidance from ``cfg.fast`` unless given.
    """
    for name in fields:
        if name not in VideoParams.model_fields:
            raise RequestError(f"{name} is not supported by this service (unknown video request field)",
                               str(name), "unsupported_parameter")
    for name in ("prompt", "negative_prompt"):
        if isinstance(fields.get(name), str) and find_invalid_unicode(fields[name], name):
            raise RequestError(f"{name} is not valid Unicode text (it holds a lone UTF-16 surrogate)", name,
                               "invalid_unicode")
    try:
        p = VideoParams.model_validate(fields)
    except ValidationError as err:
        raise _first_error(err) from None
    check_seed(p.seed, RequestError)
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
    if frames < 5:
        raise RequestError(f"num_frames {frames} is too few: a clip has at least 5 frames (4k+1 with k >= 1; "
                           f"Wan's VAE compresses time by 4); use 5 or more, or ask for a length with seconds",
                           "num_frames", "invalid_frame_count")
    if (frames - 1) % 4:
        lo = (frames - 1) // 4 * 4 + 1
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
    target, clips, last = plan_frames(p.seconds, fps, frames, continuation)
    if clips > lim.max_clips:
        raise RequestError(f"{p.seconds:g} s at {fps} fps needs {clips} clips of {frames} frames; the limit is "
                           f"{lim.max_clips} clips", "seconds", "invalid_duration")
    inherited = None if inherit is None else inherit.get("quality") or "full"
    quality = p.quality or inherited or "full"
    if quality not in QUALITIES:
        raise RequestError(f"quality {quality!r} is not one of {', '.join(QUALITIES)}", "quality")
    if quality == "fast" and cfg.fast is None:
        raise RequestError("quality 'fast' is not offered by this model (no step-distilled profile configured)",
                           "quality", "unsupported_value")
    if p.cache is not None and p.cache not in CACHES:
        raise RequestError(f"cache {p.cache!r} is not one of {', '.join(CACHES)} (or null: no cache)", "cache")
    if p.cache == "mag" and cfg.cache.mag.mag_ratios is None:
        raise RequestError("cache 'mag' is not calibrated for this model (no MagCache ratios configured)", "cache",
                           "unsupported_value")
    if quality == "fast":
        d = d.model_copy(update={"num_inference_steps": cfg.fast.num_inference_steps,
                                 "guidance_scale": cfg.fast.guidance_scale})
    if inherit is not None:
        kept = ("negative_prompt",) + (("num_inference_steps", "guidance_scale") if quality == inherited else ())
        d = d.model_copy(update={k: inherit[k] for k in kept})
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
                        seconds=p.seconds, target_frames=target, last_clip_frames=last, continuation=continuation,
                        quality=quality, cache=p.cache)
