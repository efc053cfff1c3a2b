"""Drift correction for chained clips: match each clip's colour statistics to the FIRST clip's.

Chained image-to-video drifts (each clip a little darker, bluer, more saturated than its conditioning frame);
matching to the previous clip follows that drift, matching to the first clip cancels it. The transfer is
Reinhard et al., "Color Transfer between Images" (IEEE CG&A 2001): per-channel mean/std in a perceptual space,
here CIE L*a*b* (D65), computed over all frames of a clip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# sRGB (D65) <-> XYZ, IEC 61966-2-1.
_RGB2XYZ = torch.tensor([[0.412453, 0.357580, 0.180423],
                         [0.212671, 0.715160, 0.072169],
                         [0.019334, 0.119193, 0.950227]], dtype=torch.float64)
_WHITE = torch.tensor([0.95047, 1.0, 1.08883], dtype=torch.float64)
_EPS = 216 / 24389
_KAPPA = 24389 / 27


def rgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """sRGB in [0, 1], shape ``(..., 3, H, W)`` any float dtype -> CIE L*a*b* (L in [0, 100]) in float64.

    Agrees with ``skimage.color.rgb2lab`` to ~1e-4."""
    x = rgb.to(torch.float64).clamp(0, 1)
    lin = torch.where(x > 0.04045, ((x + 0.055) / 1.055) ** 2.4, x / 12.92)
    xyz = torch.einsum("ij,...jhw->...ihw", _RGB2XYZ, lin) / _WHITE.view(3, 1, 1)
    f = torch.where(xyz > _EPS, xyz.clamp_min(1e-12) ** (1 / 3), (_KAPPA * xyz + 16) / 116)
    L = 116 * f[..., 1, :, :] - 16
    a = 500 * (f[..., 0, :, :] - f[..., 1, :, :])
    b = 200 * (f[..., 1, :, :] - f[..., 2, :, :])
    return torch.stack([L, a, b], dim=-3)


def lab_to_rgb(lab: torch.Tensor) -> torch.Tensor:
    """CIE L*a*b* ``(..., 3, H, W)`` -> sRGB float64 clipped to [0, 1] (inverse of :func:`rgb_to_lab`)."""
    lab = lab.to(torch.float64)
    fy = (lab[..., 0, :, :] + 16) / 116
    fx = fy + lab[..., 1, :, :] / 500
    fz = fy - lab[..., 2, :, :] / 200
    f = torch.stack([fx, fy, fz], dim=-3)
    xyz = torch.where(f ** 3 > _EPS, f ** 3, (116 * f - 16) / _KAPPA) * _WHITE.view(3, 1, 1)
    lin = torch.einsum("ij,...jhw->...ihw", torch.linalg.inv(_RGB2XYZ), xyz).clamp(0, 1)
    return torch.where(lin > 0.0031308, 1.055 * lin ** (1 / 2.4) - 0.055, 12.92 * lin).clamp(0, 1)


@dataclass
class ColorStats:
    """Per-channel L*a*b* mean and std over all pixels of all frames of a clip (each a list of 3 floats)."""

    mean: list[float]
    std: list[float]

    def to_dict(self) -> dict:
        return {"mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: dict) -> "ColorStats":
        return cls(mean=[float(x) for x in d["mean"]], std=[float(x) for x in d["std"]])


def color_stats(frames: torch.Tensor) -> ColorStats:
    """Statistics of ``frames``: float ``(T, 3, H, W)`` sRGB in [0, 1]."""
    lab = rgb_to_lab(frames).transpose(0, 1).reshape(3, -1)
    return ColorStats(mean=lab.mean(1).tolist(), std=lab.std(1).tolist())


def match_color(frames: torch.Tensor, ref: ColorStats, min_std: float = 1e-3) -> torch.Tensor:
    """Shift/scale ``frames`` (float ``(T, 3, H, W)``, [0, 1]) so their L*a*b* mean/std equal ``ref``'s.

    Returns a tensor of the input's dtype and shape, clipped to [0, 1]. The statistics are pooled over the
    whole clip (not per frame), so motion and lighting changes within the clip are kept."""
    lab = rgb_to_lab(frames)
    cur = color_stats(frames)
    mean = torch.tensor(cur.mean, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(cur.std, dtype=torch.float64).clamp_min(min_std).view(3, 1, 1)
    rmean = torch.tensor(ref.mean, dtype=torch.float64).view(3, 1, 1)
    rstd = torch.tensor(ref.std, dtype=torch.float64).view(3, 1, 1)
    out = (lab - mean) / std * rstd + rmean
    return lab_to_rgb(out).to(frames.dtype)


def mean_luma(frames: torch.Tensor) -> float:
    """Mean Rec. 601 luma of float ``(..., 3, H, W)`` sRGB frames in [0, 1]."""
    w = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64).view(3, 1, 1)
    return float((frames.to(torch.float64) * w).sum(-3).mean())
