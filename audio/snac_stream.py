"""SNAC 24 kHz decoding while generating, with a 2-frames-left / 2-frames-right window.

SNAC (hubertsiuzdak/snac) decodes codes with a convolutional decoder whose receptive field spans about two
frames each side; decoding frames ``[i-2, j+2)`` and keeping the samples of frames ``[i, j)`` matches a full
decode to about 1e-4 relative RMS (random weights) at the latency of two frames. Unlike the reference
Orpheus streamer (decode the last 4 frames every 7 tokens, keep samples [2048:4096]), every frame is
emitted: the first one as soon as its right context exists, the last two at ``flush()``.

:class:`BatchedSnacDecoder` is one decoder worker shared by the concurrent streams of an engine: windows of the
same length that are waiting at the same time are stacked into one batched SNAC call (on a GPU one call of B
windows costs about as much as one window), each stream still getting exactly its own samples, in order.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from pathlib import Path

import torch

from core.constants import SAMPLE_RATE

from .layout import frames_to_snac_codes

FRAME_SAMPLES = 2048  # 4 latent steps x hop 512

SNAC_24KHZ_CONFIG = {
    "sampling_rate": SAMPLE_RATE, "encoder_dim": 48, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 1024,
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


def rowwise_transposed_convs(snac_model: torch.nn.Module) -> None:
    """Make every ``ConvTranspose1d`` of ``snac_model`` run its batch row by row (weights computed once per call;
    the same ``F.conv_transpose1d`` call as the module's own for a batch of one, so unbatched decoding is
    unchanged). Measured on the cpu profile: the transposed convolutions are the only layers whose per-window
    result depends on the batch size (their kernel blocking changes with it: up to 5e-7 absolute); row by row,
    a window decoded in any batch gives bit-identical samples to its decode alone, so concurrent streams never
    change each other's audio. Idempotent; the weights are unchanged."""
    import torch.nn.functional as F

    for m in snac_model.modules():
        if isinstance(m, torch.nn.ConvTranspose1d) and "forward" not in m.__dict__:
            def forward(x: torch.Tensor, m=m) -> torch.Tensor:
                w = m.weight
                rows = [F.conv_transpose1d(x[i : i + 1], w, m.bias, m.stride, m.padding, m.output_padding, m.groups,
                                           m.dilation) for i in range(x.shape[0])]
                return rows[0] if len(rows) == 1 else torch.cat(rows)

            m.forward = forward


@torch.inference_mode()
def decode_frames(snac_model: torch.nn.Module, frames: list[list[int]] | torch.Tensor) -> torch.Tensor:
    """One-shot decode of frames ``[N, 7]`` -> float32 audio ``(N * 2048,)`` in [-1, 1] at 24 kHz."""
    if len(frames) == 0:
        return torch.zeros(0)
    return decode_batch(snac_model, [frames])[0]


@torch.inference_mode()
def decode_batch(snac_model: torch.nn.Module, windows: list) -> list[torch.Tensor]:
    """Decode B windows of the same length N (each frames ``[N, 7]``, N >= 1) in one SNAC call: codes stacked to
    ``[(B, N), (B, 2N), (B, 4N)]`` -> B float32 audio tensors ``(N * 2048,)`` (CPU). SNAC's decoder has no
    normalisation or attention across the batch (24 kHz: ``attn_window_size`` None), so each window's samples
    are its own decode up to float32 rounding (the convolutions' sums may be reordered). Raises ValueError
    when the windows differ in length."""
    if len({len(w) for w in windows}) != 1:
        raise ValueError("decode_batch needs windows of one length")
    dev = next(snac_model.parameters()).device
    per = [frames_to_snac_codes(w) for w in windows]
    codes = [torch.cat(level).to(dev) for level in zip(*per)]
    audio = snac_model.decode(codes).float().cpu()
    return [a.reshape(-1) for a in audio]


class _Window:
    __slots__ = ("frames", "first", "seq", "future")

    def __init__(self, frames, first: bool, seq: int):
        self.frames, self.first, self.seq, self.future = frames, first, seq, Future()


class BatchedSnacDecoder:
    """One SNAC decoder worker shared by an engine's concurrent streams (their threads call :meth:`decode`).

    ``decode(frames)`` blocks until the worker has decoded that window and returns what
    ``decode_frames(snac_model, frames)`` returns (float32 ``(N * 2048,)``): bit-identical on the cpu profile (the
    transposed convolutions run row by row, :func:`rowwise_transposed_convs`), else equal up to float32 rounding
    (see :func:`decode_batch`). The worker takes the most urgent waiting window (a sentence's first window, for
    time to first audio, then the oldest) together with every other waiting window of the same frame count, at
    most ``max_frames`` frames per call (at least one window), and decodes them in one batched call. Windows are
    never padded to a common length (padding would change the samples near a window's end), so windows of other
    lengths wait for the next call. A stream has at most one window outstanding, so its audio comes back in
    order. The worker thread runs only while windows are waiting (started by :meth:`submit`, it ends when none
    is left), so an idle decoder holds no thread. If a batched call raises, each of its windows is decoded alone
    and only a window that fails alone gets the exception. ``calls`` / ``windows`` count SNAC calls and windows
    decoded (windows / calls = the mean batch size).
    """

    def __init__(self, snac_model: torch.nn.Module, max_frames: int = 256):
        rowwise_transposed_convs(snac_model)
        self.model, self.max_frames = snac_model, max(1, max_frames)
        self._cond = threading.Condition()
        self._waiting: list[_Window] = []
        self._worker: threading.Thread | None = None
        self._seq = itertools.count()
        self.calls = self.windows = 0

    def submit(self, windows: list, first: list[bool] | None = None) -> list[Future]:
        """Queue windows (each frames ``[N, 7]``, N >= 1) at once; returns one Future per window (result: float32
        audio ``(N * 2048,)``). Windows submitted in one call are all waiting when the worker next takes, so
        those of one length are decoded together (within ``max_frames``). ``first[i]``: window i is the first
        window of its stream's sentence (taken before the others; default: none is)."""
        first = first or [False] * len(windows)
        jobs = [_Window([list(f) for f in w], bool(b), next(self._seq)) for w, b in zip(windows, first, strict=True)]
        with self._cond:
            self._waiting += jobs
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="snac-decoder", daemon=True)
                self._worker.start()
        return [j.future for j in jobs]

    def decode(self, frames, first: bool = False) -> torch.Tensor:
        """Decode one window (frames ``[N, 7]``) through the worker; blocks until its audio is ready. Raises what
        decoding that window alone raises."""
        if len(frames) == 0:
            return torch.zeros(0)
        return self.submit([frames], [first])[0].result()

    def _take(self) -> list[_Window]:
        """The next batch (called with the lock held, at least one window waiting)."""
        head = min(self._waiting, key=lambda j: (not j.first, j.seq))
        n = len(head.frames)
        same = sorted((j for j in self._waiting if len(j.frames) == n), key=lambda j: (not j.first, j.seq))
        batch = same[: max(1, self.max_frames // n)]
        taken = {id(j) for j in batch}
        self._waiting = [j for j in self._waiting if id(j) not in taken]
        return batch

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._waiting:
                    self._worker = None
                    return
                batch = self._take()
            try:
                outs = decode_batch(self.model, [j.frames for j in batch])
            except Exception:  # noqa: BLE001 - re-decoded one by one below: only a failing window fails
                outs = None
            self.calls += 1
            self.windows += len(batch)
            for i, j in enumerate(batch):
                if outs is not None:
                    j.future.set_result(outs[i])
                    continue
                try:
                    j.future.set_result(decode_batch(self.model, [j.frames])[0])
                except Exception as exc:  # noqa: BLE001 - handed to the stream that submitted the window
                    j.future.set_exception(exc)


class StreamingDecoder:
    """Decode frames as they arrive. ``push(frame)`` returns audio (float32 ``(k * 2048,)``, maybe empty)
    for frames that now have ``right`` frames of right context; ``flush()`` returns the rest.

    ``snac``: a SNAC model (windows decoded in the calling thread) or a :class:`BatchedSnacDecoder` shared with
    other streams (windows decoded by its worker, batched with theirs). ``chunk_frames``: after the first
    emission, wait until that many frames are ready before decoding (fewer, larger decodes cost less: a window
    of k+4 frames emits k). Concatenated output has exactly ``N * 2048`` samples for N pushed frames.
    """

    def __init__(self, snac: "torch.nn.Module | BatchedSnacDecoder", left: int = 2, right: int = 2,
                 chunk_frames: int = 1):
        self.model = snac
        self.left, self.right, self.chunk = left, right, max(1, chunk_frames)
        self.frames: list[list[int]] = []  # frames from index `base` on
        self.base = 0  # absolute index of self.frames[0]
        self.emitted = 0  # absolute index of the next frame to emit
        self.total = 0

    def _decode(self, end: int) -> torch.Tensor:
        """Emit frames [emitted, end) decoding the window [emitted-left, min(total, end+right))."""
        start = max(self.base, self.emitted - self.left)
        stop = min(self.total, end + self.right)
        window = self.frames[start - self.base : stop - self.base]
        if isinstance(self.model, BatchedSnacDecoder):
            audio = self.model.decode(window, first=self.emitted == 0)
        else:
            audio = decode_frames(self.model, window)
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
