"""Video chaining figures, measured side by side in one run (cpu profile, in-process engine, 1 torch thread).

Prints: time of 1 clip vs 4 chained clips (ratio), drift-correction overhead (same 4-clip job with and without
correction), and the drift itself with a model wrapped to make each clip 5% darker than its input frame
(last-clip luma change vs the first clip, corrected and uncorrected).

    .venv/bin/python bench/video_chaining.py [--size 64] [--steps 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from PIL import Image
from skimage import data

from services.config.profiles import load_profile
from video.build import prepare
from video.drift import mean_luma
from video.engine import VideoEngine
from video.media import image_to_tensor
from video.request import plan_request


def timed(fn, rounds: int) -> float:
    """Median wall time of ``fn()`` over ``rounds`` runs (s)."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    prof = load_profile("cpu")
    cfg, model_dir = prof.video.engine, prof.resolved_model_dir()
    prepare(cfg, model_dir)
    engine = VideoEngine(cfg, model_dir)
    F, fps = cfg.defaults.frames_per_clip, cfg.defaults.fps
    base = {"prompt": "a lighthouse at dusk", "size": f"{a.size}x{a.size}", "num_inference_steps": a.steps, "seed": 0}
    # whole clips (video.request: one clip is F frames, each chained clip adds F - 1), so nothing is cut
    one = plan_request(cfg, {**base, "seconds": F / fps})
    four = plan_request(cfg, {**base, "seconds": (1 + 4 * (F - 1)) / fps})
    four_off = plan_request(cfg, {**base, "seconds": (1 + 4 * (F - 1)) / fps, "drift_correction": False})
    engine.generate(one)  # warm-up
    t1 = timed(lambda: engine.generate(one), a.rounds)
    t4 = timed(lambda: engine.generate(four), a.rounds)
    t4_off = timed(lambda: engine.generate(four_off), a.rounds)
    print(f"{a.size}x{a.size}, {F} frames/clip, {a.steps} steps, median of {a.rounds}")
    print(f"1 clip            {t1 * 1e3:8.1f} ms  ({one.total_frames} frames)")
    print(f"4 chained clips   {t4 * 1e3:8.1f} ms  ({four.total_frames} frames)  ratio {t4 / t1:.2f}x")
    print(f"  no correction   {t4_off * 1e3:8.1f} ms  correction overhead {100 * (t4 / t4_off - 1):+.1f}%")

    photo = image_to_tensor(Image.fromarray(data.astronaut()), a.size, a.size)

    def darker(fn):
        def wrapped(k, cond, seed):
            out = fn(k, cond, seed)  # a Clip
            return photo[None].repeat(F, 1, 1, 1) if k == 0 else (cond.frame[None] * 0.95).expand_as(out.frames).clone()
        return wrapped

    for req, name in ((four, "corrected"), (four_off, "uncorrected")):
        fr = engine.generate(req, wrap=darker).frames
        first, last = mean_luma(fr[:F]), mean_luma(fr[-(F - 1):])
        print(f"5%-darker model, {name:11s}: last-clip luma {100 * (last - first) / first:+.1f}% vs first clip")


if __name__ == "__main__":
    main()
