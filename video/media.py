"""Media in and out of the video engine: reference images to tensors, MP4 (H.264) encode/decode, PNG thumbnails.
Uploaded images are decoded by the one image decoder, :func:`core.media.decode_image`.

Frames inside the engine are float tensors ``(T, 3, H, W)`` in [0, 1]; they are quantised to uint8 only when
written. MP4s are written with PyAV (libx264, yuv420p, ``crf``), read back with PyAV.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from core.validate import InputError


class MediaError(InputError):
    """A bad uploaded video. ``status_code``: 400 unreadable, 413 too large, 415 not a video.

    ``code`` (stable, machine-readable): ``too_large`` for 413, ``unsupported_media_type`` for 415,
    ``invalid_media`` otherwise, unless given."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message, param,
                         code or {413: "too_large", 415: "unsupported_media_type"}.get(status_code, "invalid_media"),
                         status_code)


def image_to_tensor(img: Image.Image, width: int, height: int) -> torch.Tensor:
    """Scale to cover ``width`` x ``height`` pixels and centre-crop (aspect kept): float32 ``(3, H, W)`` in [0, 1]."""
    img = ImageOps.fit(img.convert("RGB"), (width, height), method=Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    """Float ``(T, 3, H, W)`` in [0, 1] -> uint8 ``(T, H, W, 3)`` (rounded)."""
    return (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def encode_mp4(frames: torch.Tensor | np.ndarray, fps: int, path: str | Path, crf: int = 12) -> None:
    """Write an H.264 MP4 (yuv420p; even width/height) at ``fps`` frames per second.

    ``frames``: float tensor ``(T, 3, H, W)`` in [0, 1] or uint8 array ``(T, H, W, 3)``. Written to a temporary
    name first, then renamed, so a crash never leaves a half file under ``path``."""
    import av

    arr = to_uint8(frames) if isinstance(frames, torch.Tensor) else np.asarray(frames, dtype=np.uint8)
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    with av.open(str(tmp), mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(int(fps), 1))
        stream.width, stream.height = arr.shape[2], arr.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for f in arr:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    tmp.replace(path)


#: Video containers an uploaded video may come in (the first name of PyAV's ``container.format.name``, a demuxer's
#: comma-separated aliases): MP4/MOV (the family ``mov,mp4,m4a,3gp,3g2,mj2``), Matroska/WebM, AVI, MPEG-TS, MPEG-PS,
#: FLV, Ogg and ASF/WMV. Still images and image sequences (``png_pipe``, ``jpeg_pipe``, ``webp_pipe``, ``gif``,
#: ``apng``, ``image2``, ...), which FFmpeg also opens as one-stream "videos", are not.
VIDEO_CONTAINERS = {"mov": "MP4/MOV", "matroska": "Matroska/WebM", "avi": "AVI", "mpegts": "MPEG-TS",
                    "mpeg": "MPEG-PS", "flv": "FLV", "ogg": "Ogg", "asf": "ASF/WMV"}


def _check_container(name: str) -> None:
    """Raise MediaError 415 ``unsupported_media_type`` (``param`` ``video``) unless ``name`` (PyAV's
    ``container.format.name``) is one of :data:`VIDEO_CONTAINERS`; the message names what was read and what is
    accepted."""
    if name.split(",")[0] in VIDEO_CONTAINERS:
        return
    image = any(k in name for k in ("pipe", "image2", "gif", "apng"))
    what = f"{name!r} ({'an image or image sequence' if image else 'not a video container'})"
    raise MediaError(f"video: the upload is {what}; send a video file: "
                     f"{', '.join(dict.fromkeys(VIDEO_CONTAINERS.values()))}", 415, "video")


def check_video_container(data: bytes) -> None:
    """Refuse an uploaded video whose container FFmpeg reads as something other than a video container
    (:data:`VIDEO_CONTAINERS`): a PNG, JPEG, WebP, GIF or APNG image, an image sequence, raw audio, ... Only the
    header is read (PyAV; no frame is decoded): cheap enough for the ingress to answer before queueing anything.
    Raises MediaError 415 ``unsupported_media_type`` (``param`` ``video``). Data FFmpeg cannot open at all passes
    here: :func:`probe_video` refuses it with the same status and code."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            name = container.format.name
    except (av.error.FFmpegError, ValueError):
        return
    _check_container(name)


def probe_video(data: bytes, max_frames: int, max_width: int, max_height: int, max_pixels: int) -> dict:
    """Read a video's container header (PyAV; no frame is decoded) and check it against limits first.

    Returns ``{"frames": int, "width": int, "height": int, "fps": float}``; ``frames`` is the header's count, or
    duration x rate when the container has none (rounded up). Raises MediaError: 415 ``unsupported_media_type``
    when it is not a video container (:data:`VIDEO_CONTAINERS`) with a video stream; 413 ``too_many_frames`` over
    ``max_frames``; 413 ``video_too_large`` when width, height or width*height (pixels) is over its limit."""
    import math

    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            name = container.format.name
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 0.0
            frames = int(stream.frames or 0)
            if not frames:
                duration = (float(stream.duration * stream.time_base) if stream.duration and stream.time_base
                            else (container.duration or 0) / 1e6)
                frames = math.ceil(duration * fps)
    except (av.error.FFmpegError, IndexError, ValueError) as err:
        raise MediaError(f"video: not a readable video container ({type(err).__name__})", 415, "video") from None
    _check_container(name)
    if frames > max_frames:
        raise MediaError(f"video has {frames} frames; the limit is {max_frames}", 413, "video", "too_many_frames")
    if width > max_width or height > max_height or width * height > max_pixels:
        raise MediaError(f"video is {width}x{height}; the limits are {max_width}x{max_height} and {max_pixels} "
                         "pixels", 413, "video", "video_too_large")
    return {"frames": frames, "width": width, "height": height, "fps": fps}


def decode_video(src: str | Path | bytes, max_frames: int | None = None) -> tuple[np.ndarray, float]:
    """Decode every frame of a video file (path or bytes): uint8 ``(T, H, W, 3)`` and the frame rate (Hz).

    Raises MediaError(415) when the data is not a decodable video."""
    import av

    try:
        with av.open(io.BytesIO(src) if isinstance(src, bytes) else str(src)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 0.0
            frames = []
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
                if max_frames is not None and len(frames) > max_frames:
                    raise MediaError(f"video has more than {max_frames} frames", 413, "video")
    except MediaError:
        raise
    except (av.error.FFmpegError, IndexError, ValueError) as err:
        raise MediaError(f"video: not a decodable video ({type(err).__name__})", 415, "video") from None
    if not frames:
        raise MediaError("video: no frames", 415, "video")
    return np.stack(frames), fps


def png_bytes(frame: torch.Tensor) -> bytes:
    """One float frame ``(3, H, W)`` in [0, 1] as PNG bytes (the job thumbnail)."""
    buf = io.BytesIO()
    Image.fromarray(to_uint8(frame[None])[0]).save(buf, format="PNG")
    return buf.getvalue()
