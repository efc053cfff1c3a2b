"""What runs one video job: :func:`run_video_job` (generate, encode, save), in a Ray worker."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


_ENGINES: dict[tuple, Any] = {}


def _engine(cfg_json: str, model_dir: str, device: str | None):
    """A VideoEngine cached per worker process (Ray reuses workers, so models stay loaded between jobs)."""
    from video.config import VideoConfig
    from video.engine import VideoEngine

    key = (cfg_json, model_dir, device)
    if key not in _ENGINES:
        _ENGINES.clear()
        _ENGINES[key] = VideoEngine(VideoConfig.model_validate_json(cfg_json), model_dir, device=device)
    return _ENGINES[key]


def run_video_job(job_id: str, cfg_json: str, model_dir: str, job_dir: str, params: dict, manager) -> dict:
    """Run one video job in a Ray worker: generate, encode MP4 + thumbnail, save the last frame and the drift
    reference for later extensions. Reports progress to ``manager`` (the JobManager actor handle).

    ``params``: ``{"request": VideoRequest dict, "image": bool, "extend": {"frames": path, ...} | None}``.
    Returns ``{"frames", "fps", "started", "finished"}`` (wall-clock seconds measured in the worker). Raises NonFiniteOutputError, ValueError, OSError."""
    import numpy as np
    import torch
    from PIL import Image

    from video.drift import ColorStats
    from video.engine import Progress, progress_units
    from video.media import decode_video, encode_mp4, image_to_tensor, png_bytes, to_uint8
    from video.request import VideoRequest

    t0 = time.time()
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    device = "cuda" if params.get("gpus_per_job") and torch.cuda.is_available() else None
    manager.started.remote(job_id, gpus if gpus is not None else "cpu", os.getpid())
    engine = _engine(cfg_json, model_dir, device)
    req = VideoRequest.from_dict(params["request"])
    jd = Path(job_dir)
    image, reference, prefix = None, None, None
    ext = params.get("extend")
    if ext:
        image = torch.from_numpy(np.load(ext["last_frame"])).float()
        reference = ColorStats.from_dict(ext["reference"])
        prefix, _ = decode_video(ext["video"])
    elif params.get("image"):
        image = image_to_tensor(Image.open(jd / "input.png"), req.width, req.height)
    last = {"t": 0.0}

    def on_progress(p: Progress):
        now = time.monotonic()
        if now - last["t"] > 0.2 or p.phase != "denoising":
            last["t"] = now
            manager.progress.remote(job_id, p.phase, p.percent, p.clips_done)

    result = engine.generate(req, image=image, reference=reference, continuation=bool(ext), on_progress=on_progress)
    total = progress_units(req)
    manager.progress.remote(job_id, "encoding", int(100 * (total - 1) / total), req.num_clips)
    frames = to_uint8(result.frames)
    if prefix is not None:
        frames = np.concatenate([prefix, frames])
    encode_mp4(frames, req.fps, jd / "video.mp4")
    (jd / "thumbnail.png").write_bytes(png_bytes(result.frames[0] if prefix is None else
                                                 torch.from_numpy(prefix[0]).permute(2, 0, 1).float() / 255))
    np.save(jd / "last_frame.npy", result.frames[-1].numpy().astype(np.float32))
    (jd / "meta.json").write_text(json.dumps({"reference": result.reference.to_dict(), "frames": int(len(frames)),
                                              "fps": req.fps, "width": req.width, "height": req.height}))
    return {"frames": int(len(frames)), "fps": req.fps, "started": t0, "finished": time.time()}
