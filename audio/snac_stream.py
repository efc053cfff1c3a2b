"""SNAC 24 kHz decoding while generating, with a 2-frames-left / 2-frames-right window.

SNAC (hubertsiuzdak/snac) decodes codes with a convolutional decoder whose receptive field spans about two
frames each side; decoding frames ``[i-2, j+2)`` and keeping the samples of frames ``[i, j)`` matches a full
decode to about 1e-4 relative RMS (random weights) at the latency of two frames. Unlike the reference
Orpheus streamer (decode the last 4 frames every 7 tokens, keep samples [2048:4096]), every frame is
emitted: the first one as soon as its right context exists, the last two at ``flush()``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .layout import frames_to_snac_codes

SAMPLE_RATE = 24000
FRAME_SAMPLES = 2048  # 4 latent steps x hop 512

SNAC_24KHZ_CONFIG = {
    "sampling_rate": 24000, "encoder_dim": 48, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 4096, "codebook_dim": 8,
    "vq_strides": [4, 2, 1], "noise": True, "depthwise": True,
}  # hubertsiuzdak/snac_24khz config.json


def set_noise(snac_model: torch.nn.Module, enabled: bool) -> None:
    """Turn SNAC's decoder ``NoiseBlock``s on or off (off: decode is deterministic; weights unchanged)."""
    from snac.layers import NoiseBlock

    for m in snac_model.modules():
        if isinstance(m, NoiseBlock):
            if enabled:
                m.__dict__.pop("forward", None)
            else:
                m.forward = lambda x: x


def load_snac(path: str | Path, device: str = "cpu", noise: bool = False) -> torch.nn.Module:
    """``SNAC.from_pretrained`` (dir with ``config.json`` + ``pytorch_model.bin``, or hub id), eval mode,
    float32 on ``device``, with decoder noise set by ``noise``."""
    from snac import SNAC

    model = SNAC.from_pretrained(str(path)).eval().to(device)
    set_noise(model, noise)
    return model


@torch.inference_mode()
def decode_frames(snac_model: torch.nn.Module, frames: list[list[int]] | torch.Tensor) -> torch.Tensor:
    """One-shot decode of frames ``[N, 7]`` -> float32 audio ``(N * 2048,)`` in [-1, 1] at 24 kHz."""
    if len(frames) == 0:
        return torch.zeros(0)
    dev = next(snac_model.parameters()).device
    codes = [c.to(dev) for c in frames_to_snac_codes(frames)]
    return snac_model.decode(codes).reshape(-1).float().cpu()


class StreamingDecoder:
    """Decode frames as they arrive. ``push(frame)`` returns audio (float32 ``(k * 2048,)``, maybe empty)
    for frames that now have ``right`` frames of right context; ``flush()`` returns the rest.

    ``chunk_frames``: after the first emission, wait until that many frames are ready before decoding
    (fewer, larger decodes cost less: a window of k+4 frames emits k). Concatenated output has exactly
    ``N * 2048`` samples for N pushed frames.
    """

    def __init__(self, snac_model: torch.nn.Module, left: int = 2, right: int = 2, chunk_frames: int = 1):
        self.model = snac_model
        self.left, self.right, self.chunk = left, right, max(1, chunk_frames)
        self.frames: list[list[int]] = []  # frames from index `base` on
        self.base = 0  # absolute index of self.frames[0]
        self.emitted = 0  # absolute index of the next frame to emit
        self.total = 0

    def _decode(self, end: int) -> torch.Tensor:
        """Emit frames [emitted, end) decoding the window [emitted-left, min(total, end+right))."""
        start = max(self.base, self.emitted - self.left)
        stop = min(self.total, end + self.right)
        audio = decode_frames(self.model, self.frames[start - self.base : stop - self.base])
        off = (self.emitted - start) * FRAME_SAMPLES
        out = audio[off : off + (end - self.emitted) * FRAME_SAMPLES]
        self.emitted = end
        keep_from = max(0, self.emitted - self.left)  # drop frames no window needs any more
        del self.frames[: keep_from - self.base]
        self.base = keep_from
        return out

    def push(self, frame: list[int]) -> torch.Tensor:
        self.frames.append(list(frame))
        self.total += 1
        ready = self.total - self.right  # frames [emitted, ready) have their right context
        need = 1 if self.emitted == 0 else self.chunk
        if ready - self.emitted >= need:
            return self._decode(ready)
        return torch.zeros(0)

    def flush(self) -> torch.Tensor:
        """Emit every remaining frame (the last ``right`` frames decode with what right context exists)."""
        if self.emitted >= self.total:
            return torch.zeros(0)
        return self._decode(self.total)
