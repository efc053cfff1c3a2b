"""Clip chaining: a long video as N image-to-video clips, each starting from the previous clip's last frame.

What keeps chains from drifting (see design notes): the last frame is handed over in memory as float32
(never re-read from an encoded file), each clip gets a fresh seed (:func:`clip_seeds`), the VAE encodes in
fp32 (the engine's job), and every clip after the first is colour-matched to the FIRST clip
(:mod:`video.drift`). The first frame of clip k+1 re-creates clip k's last frame, so it is dropped at the
seam: N clips of F frames join into ``1 + N (F - 1)`` frames with no repeated frame. ``total_frames`` cuts the
joined frames to a requested length (the last clip may be longer than what is left: see
:mod:`video.request` for the duration rule).

Latent chaining (``latent=True``): a clip may return its latents (:class:`Clip`); the next clip then gets the
last latent frame in its :class:`Handover` and conditions on it directly, with no VAE decode -> encode round trip
of the conditioning frame (the round trip is what makes chained clips creep in colour and contrast; SkyReels-V2
and InfiniteTalk pass latents or motion frames for the same reason). The seam rule is unchanged: the next clip's
first frame is the decode of the handed-over latent frame and is dropped. Drift correction stays the safety net
on the decoded frames (the first clip remains the colour reference); it cannot feed back into a latent handover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .drift import ColorStats, color_stats, match_color



@dataclass
class Handover:
    """What clip k+1 is conditioned on: ``frame`` float32 ``(3, H, W)`` in [0, 1] (clip k's last frame, after
    drift correction; or the input image) and, with latent chaining, ``latents``: clip k's last latent frame
    ``(1, C, 1, h, w)`` in the pipeline's normalised latent space (None: condition on ``frame``)."""

    frame: torch.Tensor
    latents: torch.Tensor | None = None


@dataclass
class Clip:
    """A generated clip: ``frames`` float32 ``(F, 3, H, W)`` in [0, 1] and its ``latents`` ``(1, C, f, h, w)``
    (normalised; None when the clip function does not provide them)."""

    frames: torch.Tensor
    latents: torch.Tensor | None = None


# clip_fn(index, Handover or None (text-to-video clip 0), seed) -> Clip, or frames (F, 3, H, W) float32
ClipFn = Callable[[int, "Handover | None", int], "Clip | torch.Tensor"]


class NonFiniteOutputError(RuntimeError):
    """A clip came out with NaN/Inf values (fp16 overflow, a broken kernel): the job fails instead of
    producing a black video. ``code`` is the job error code."""

    code = "non_finite_output"


def clip_seeds(seed: int, n: int) -> list[int]:
    """``n`` different seeds derived from ``seed`` (clip 0 uses ``seed`` itself), the others in [0, 2**62)."""
    g = torch.Generator().manual_seed(seed)
    return [seed] + [int(torch.randint(0, 2**62, (1,), generator=g)) for _ in range(n - 1)]


@dataclass
class ChainResult:
    """Joined frames float32 ``(T, 3, H, W)`` in [0, 1], the first clip's colour statistics (the drift
    reference; pass it on to extend the video later), and the per-clip frame counts kept."""

    frames: torch.Tensor
    reference: ColorStats
    kept_per_clip: list[int]


def check_finite(frames: torch.Tensor, what: str) -> None:
    """Raise NonFiniteOutputError when ``frames`` holds NaN or Inf."""
    if not torch.isfinite(frames).all():
        bad = int((~torch.isfinite(frames)).sum())
        raise NonFiniteOutputError(f"{what} has {bad} non-finite values (NaN/Inf): generation failed numerically")


def chain_clips(clip_fn: ClipFn, num_clips: int, seeds: list[int], first_image: torch.Tensor | None = None,
                drift_correction: bool = True, reference: ColorStats | None = None, continuation: bool = False,
                on_clip_done: Callable[[int], None] | None = None, total_frames: int | None = None,
                latent: bool = False) -> ChainResult:
    """Generate ``num_clips`` clips with ``clip_fn`` and join them.

    ``first_image``: conditioning frame of clip 0 (None: text-to-video). ``reference``: colour statistics to
    match (extensions pass the original video's); by default the first clip's. ``continuation``: the video
    continues an existing one ending in ``first_image``, so clip 0's first frame is dropped too.
    ``total_frames``: keep only the first ``total_frames`` joined frames (the end of the last clip is cut;
    ``kept_per_clip`` counts what stays); None keeps all. ``latent``: hand clip k's last latent frame to clip
    k+1 (when clip k returned latents; module doc). Raises NonFiniteOutputError on NaN/Inf output,
    ValueError when fewer than ``num_clips`` seeds are given or the clips join into fewer than ``total_frames``.
    """
    if len(seeds) < num_clips:
        raise ValueError(f"need {num_clips} seeds, got {len(seeds)}")
    parts, kept = [], []
    cond = None if first_image is None else Handover(first_image)
    for k in range(num_clips):
        out = clip_fn(k, cond, seeds[k])
        out = out if isinstance(out, Clip) else Clip(out)
        clip = out.frames.to(torch.float32)
        check_finite(clip, f"clip {k + 1} of {num_clips}")
        if reference is None:
            reference = color_stats(clip)
        elif drift_correction:
            clip = match_color(clip, reference)
        part = clip[1:] if (k > 0 or continuation) else clip
        parts.append(part)
        kept.append(part.shape[0])
        cond = Handover(clip[-1].clone(),
                        out.latents[:, :, -1:].clone() if latent and out.latents is not None else None)
        if on_clip_done is not None:
            on_clip_done(k)
    frames = torch.cat(parts)
    if total_frames is not None:
        if total_frames > frames.shape[0]:
            raise ValueError(f"the clips join into {frames.shape[0]} frames, fewer than the {total_frames} asked")
        frames, cut = frames[:total_frames], frames.shape[0] - total_frames
        while cut:  # drop the cut frames from the counts, last clip first
            n = min(cut, kept[-1])
            kept[-1] -= n
            cut -= n
            if kept[-1] == 0 and cut:
                kept.pop()
    return ChainResult(frames=frames, reference=reference, kept_per_clip=kept)
