"""Audio containers for speech responses, and the playback-speed resampler.

- ``pcm``: raw signed 16-bit little-endian, 24 kHz mono; streams as is.
- ``wav``: a streamed WAV starts with a 44-byte header whose RIFF and data sizes are 0xFFFFFFFF (length unknown
  while generating, the convention most players and ``soundfile`` accept), then pcm16 as it is made.
- ``flac``, ``mp3`` (MPEG layer III), ``opus`` (Ogg/Opus): encoded by libsndfile (``soundfile``, libsndfile
  >= 1.1) once all audio exists; they are not streamed chunk by chunk.
"""

from __future__ import annotations

import io
import struct

import numpy as np

from core.constants import SAMPLE_RATE

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg"}
STREAMABLE = ("wav", "pcm")
_SF_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
               "opus": ("OGG", "OPUS")}


def to_pcm16(audio: np.ndarray) -> bytes:
    """float32 samples ``(n,)`` in [-1, 1] -> ``2n`` bytes signed 16-bit little-endian (clipped)."""
    a = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)
    return (a * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int = SAMPLE_RATE, channels: int = 1, streamed: bool = True, n_bytes: int = 0) -> bytes:
    """44-byte PCM16 WAV header; ``streamed`` sets the RIFF and data sizes to 0xFFFFFFFF (unknown length)."""
    data = 0xFFFFFFFF if streamed else n_bytes
    riff = 0xFFFFFFFF if streamed else 36 + n_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * channels * 2, channels * 2, 16)
            + b"data" + struct.pack("<I", data))


def encode(pcm16: bytes, response_format: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """Whole pcm16 mono audio -> bytes of ``response_format`` (pcm, wav, flac, mp3, opus).
    Raises ValueError for another format."""
    if response_format == "pcm":
        return pcm16
    if response_format not in _SF_FORMATS:
        raise ValueError(f"unsupported response_format {response_format!r}")
    import soundfile as sf

    fmt, subtype = _SF_FORMATS[response_format]
    samples = np.frombuffer(pcm16, dtype="<i2")
    if response_format == "opus" and len(samples) == 0:
        samples = np.zeros(1, dtype="<i2")
    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format=fmt, subtype=subtype)
    return buf.getvalue()


class SpeedResampler:
    """Playback speed by linear-interpolation resampling across chunk boundaries (like tape speed: duration
    divided by ``speed``, pitch multiplied by it). ``push(x)`` / ``flush()`` take and return float32 ``(n,)``;
    the concatenated output has about ``len(input) / speed`` samples. ``speed == 1`` passes audio through."""

    def __init__(self, speed: float = 1.0):
        self.speed = float(speed)
        self.buf = np.zeros(0, dtype=np.float32)
        self.pos = 0.0  # next output position, in samples of self.buf

    def push(self, x: np.ndarray) -> np.ndarray:
        if self.speed == 1.0:
            return np.asarray(x, dtype=np.float32)
        self.buf = np.concatenate([self.buf, np.asarray(x, dtype=np.float32)])
        n = int(np.floor((len(self.buf) - 2 - self.pos) / self.speed)) + 1 if len(self.buf) - 2 >= self.pos else 0
        return self._take(n)

    def _take(self, n: int, last: bool = False) -> np.ndarray:
        if n <= 0:
            return np.zeros(0, dtype=np.float32)
        t = self.pos + self.speed * np.arange(n)
        i = np.floor(t).astype(np.int64)
        f = (t - i).astype(np.float32)
        j = np.minimum(i + 1, len(self.buf) - 1)
        out = self.buf[i] * (1 - f) + self.buf[j] * f
        self.pos += self.speed * n
        drop = min(int(np.floor(self.pos)), len(self.buf))
        self.buf, self.pos = self.buf[drop:], self.pos - drop
        return out.astype(np.float32)

    def flush(self) -> np.ndarray:
        if self.speed == 1.0 or len(self.buf) == 0:
            return np.zeros(0, dtype=np.float32)
        n = int(np.ceil((len(self.buf) - self.pos) / self.speed)) if len(self.buf) > self.pos else 0
        return self._take(n, last=True)
