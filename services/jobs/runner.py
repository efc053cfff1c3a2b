"""What runs video jobs: :class:`JobWorker`, one long-lived Ray actor per GPU holding its engine.

Why a long-lived actor per GPU, not a fresh process per job (``max_calls=1``): the production Ray Serve video
stacks (vLLM-Omni's diffusion workers, xDiT/xfuser's Ray workers, FastVideo) keep one process per GPU with the
pipeline loaded and feed it requests, because loading a Wan 5B/14B checkpoint (tens of GB) costs tens of seconds
to minutes, longer than many jobs; a process per job would pay it every time. The actor asks Ray for
``gpus_per_job`` GPUs once, at creation: Ray pins it to them for its whole life and sets its
``CUDA_VISIBLE_DEVICES``, and the engine is built in ``__init__`` on ``cuda:0`` of that view, the one GPU the
actor was given (on the CPU when it was given none, or CUDA is absent). A job runs inside ``run`` and the actor
runs one call at a time, so one job owns one GPU and never shares it, and no engine ever crosses devices: an
engine lives and dies with the actor that holds its GPU. Cancelling kills the actor (its GPU memory is freed at
once) and the manager starts a fresh one in its place.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path


class JobWorker:
    """One job slot: a Ray actor (wrap with ``ray.remote(num_gpus=gpus_per_job)``; the job manager does) holding a
    :class:`video.engine.VideoEngine` built on the GPU Ray gave it.

    ``cfg_json``: the VideoConfig as JSON; ``model_dir``: the profile's model dir; ``gpus``: the GPUs asked for
    (0: the engine runs on ``cfg.device``, the CPU on the cpu profile). An engine that does not load (a missing
    or broken checkpoint: OSError, ValueError, a CUDA error) does not kill the actor: ``__init__`` logs it once
    and returns, :meth:`status` reports it (the manager decides whether to start another worker) and :meth:`run`
    raises EngineUnavailableError naming it.
    """

    def __init__(self, cfg_json: str, model_dir: str, gpus: float):
        import ray
        import torch

        from video.config import VideoConfig
        from video.engine import VideoEngine

        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = "cuda:0" if gpus and torch.cuda.is_available() else None  # cuda:0 = the one GPU in its view
        self.engine, self.load_error = None, None
        try:
            self.engine = VideoEngine(VideoConfig.model_validate_json(cfg_json), model_dir, device=device)
        except Exception as exc:  # noqa: BLE001 - reported by status() and run(), not a dead actor
            logging.getLogger("chimera").exception("video job worker: the engine did not load")
            self.load_error = f"{type(exc).__name__}: {exc}"[:2000]

    def status(self) -> dict:
        """Whether this worker's engine loaded: ``{"loaded": bool, "error": str | None}`` (``error``: the loading
        exception as ``"<type>: <message>"``). Answers once ``__init__`` has returned, so awaiting it waits for
        the load (the manager's watch; readiness never awaits it)."""
        return {"loaded": self.engine is not None, "error": self.load_error}

    def where(self) -> dict:
        """Where this worker's engine runs: ``{"pid": int, "gpu_ids": [str] (Ray's ids of its GPUs),
        "cuda_visible_devices": str | None, "engine_device": str (the torch device of the engine's weights; None
        when the engine did not load)}``."""
        return {"pid": os.getpid(), "gpu_ids": self.gpu_ids, "cuda_visible_devices": self.visible,
                "engine_device": None if self.engine is None else
                str(next(self.engine.t2v.transformer.parameters()).device)}

    def run(self, job_id: str, job_dir: str, params: dict, manager) -> dict:
        """Run one job on this worker's engine (:func:`run_video_job`; same arguments, same result). Raises
        EngineUnavailableError (503 ``engine_unavailable``) naming the cause when the engine did not load."""
        if self.engine is None:
            from core.llm_client import EngineUnavailableError

            raise EngineUnavailableError(f"the video engine did not load: {self.load_error}")
        return run_video_job(self.engine, job_id, job_dir, params, manager, self.where())


def run_video_job(engine, job_id: str, job_dir: str, params: dict, manager, where: dict) -> dict:
    """Run one video job on ``engine`` (a VideoEngine): generate, encode MP4 + thumbnail, save the last frame and
    the drift reference for later extensions. Reports to ``manager`` (the JobManager actor handle) where it runs
    (``where``: :meth:`JobWorker.where`; waited for, so the row names its device before the job can finish), then
    its progress (fire-and-forget).

    ``params``: ``{"request": VideoRequest dict, "image": bool, "extend": {"frames": path, ...} | None}``.
    Returns ``{"frames", "fps", "started", "finished"}`` (wall-clock seconds measured in the worker). Raises
    NonFiniteOutputError, ValueError, OSError.

    It only writes into the existing ``job_dir`` and never creates it: a job deleted meanwhile (the store renames
    its folder away before removing it, :meth:`services.jobs.store.JobStore.delete`) makes every later write of
    a worker that is still being killed fail (FileNotFoundError) instead of leaving files behind."""
    import numpy as np
    import torch
    from PIL import Image

    from video.drift import ColorStats
    from video.engine import Progress, progress_units
    from video.media import decode_video, encode_mp4, image_to_tensor, png_bytes, to_uint8
    from video.request import VideoRequest

    import ray

    t0 = time.time()
    # awaited, not fire-and-forget: the manager records ``started`` only while the job is active, so a report
    # still in flight when a short job's result arrived would be dropped and the row would name no device
    ray.get(manager.started.remote(job_id, where))
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
