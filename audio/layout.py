"""Orpheus token layout: prompt ids, audio ids per frame position, token -> SNAC frame parsing.

Orpheus (canopyai/Orpheus-TTS) speaks in frames of 7 audio tokens; the token at frame position ``p`` with SNAC
code ``c`` has id ``audio_start + p * 4096 + c``. SNAC 24 kHz codes of one frame: layer 0 <- p0,
layer 1 <- p1, p4, layer 2 <- p2, p3, p5, p6 (one frame = 1 + 2 + 4 codes = 2048 samples at 24 kHz).

Unlike the reference streaming decoder, the parser keeps code 0 (the reference's ``token > 0`` filter drops it
and shifts every later frame) and rejects ids outside the position's range instead of skipping them, so frame
alignment can never shift.
"""

from __future__ import annotations

import torch

from .config import TokenLayoutConfig

# frame position -> (SNAC layer, slot within the frame for that layer)
SNAC_SLOTS = [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (2, 2), (2, 3)]


class TokenLayout:
    """The ids of an Orpheus-layout LM (see :class:`~audio.config.TokenLayoutConfig`)."""

    def __init__(self, cfg: TokenLayoutConfig):
        self.cfg = cfg
        self.positions = cfg.positions
        self.codebook_size = cfg.codebook_size
        self.audio_start = cfg.audio_start
        self.audio_end = cfg.audio_start + cfg.positions * cfg.codebook_size  # exclusive
        self.end_of_speech = cfg.end_of_speech

    @property
    def vocab_size_needed(self) -> int:
        """Smallest LM vocabulary that holds every special and audio id."""
        c = self.cfg
        return max(self.audio_end, c.start_of_speech + 1, c.end_of_speech + 1, c.pad + 1, c.end_of_ai + 1)

    def prompt_ids(self, text_ids: list[int]) -> list[int]:
        """Orpheus prompt from already-tokenized ``"{voice}: {text}"`` ids (never re-tokenized special text):
        ``[start_of_human] + text_ids + [end_of_text, end_of_human, start_of_ai, start_of_speech]``."""
        c = self.cfg
        return [c.start_of_human, *text_ids, c.end_of_text, c.end_of_human, c.start_of_ai, c.start_of_speech]

    def speech_prompt(self, tokenizer, voice: str, text: str) -> list[int]:
        """Prompt ids for ``text`` in ``voice``: ``"{voice}: {text}"`` tokenized as plain text
        (``split_special_tokens=True``: no text can forge a control id; the tokenizer's own template, Llama-3's
        ``<|begin_of_text|>``, kept), then :meth:`prompt_ids`. The one prompt builder of the engine and of
        ``chimera quantize --family tts``."""
        return self.prompt_ids(tokenizer(f"{voice}: {text}", split_special_tokens=True).input_ids)

    def audio_id(self, position: int, code: int) -> int:
        """Token id of SNAC ``code`` at frame ``position``. Raises ValueError when either is out of range."""
        if not 0 <= position < self.positions or not 0 <= code < self.codebook_size:
            raise ValueError(f"audio position {position} / code {code} out of range")
        return self.audio_start + position * self.codebook_size + code

    def position_range(self, position: int) -> tuple[int, int]:
        """``[lo, hi)`` token ids valid at frame ``position``."""
        lo = self.audio_start + position * self.codebook_size
        return lo, lo + self.codebook_size

    def code_of(self, token_id: int, position: int) -> int:
        """SNAC code of ``token_id`` expected at frame ``position``. Raises ValueError for any other id
        (another position's audio id, a special or text id): the caller must never skip it silently."""
        lo, hi = self.position_range(position)
        if not lo <= token_id < hi:
            raise ValueError(f"token {token_id} is not an audio token of frame position {position} ([{lo}, {hi}))")
        return token_id - lo

    def frame_ids(self, codes: list[int]) -> list[int]:
        """The 7 token ids of one frame of codes (the inverse of parsing)."""
        return [self.audio_id(p, c) for p, c in enumerate(codes)]


class FrameParser:
    """Incremental token -> frame parser. ``push(token)`` returns a complete frame (list of 7 codes) or None.

    ``end_of_speech`` is accepted only at a frame boundary (then ``done`` is set); any id outside the current
    position's range raises ValueError. Code 0 is a normal code.
    """

    def __init__(self, layout: TokenLayout):
        self.layout = layout
        self.current: list[int] = []
        self.done = False

    @property
    def position(self) -> int:
        """Frame position (0..6) the next token must have."""
        return len(self.current)

    def push(self, token_id: int) -> list[int] | None:
        if self.done:
            raise ValueError("token after end_of_speech")
        if token_id == self.layout.end_of_speech:
            if self.current:
                raise ValueError(f"end_of_speech inside a frame (position {self.position})")
            self.done = True
            return None
        self.current.append(self.layout.code_of(int(token_id), self.position))
        if len(self.current) == self.layout.positions:
            frame, self.current = self.current, []
            return frame
        return None


def parse_frames(layout: TokenLayout, token_ids: list[int]) -> list[list[int]]:
    """All complete frames of a token sequence (stops at end_of_speech; a trailing partial frame is dropped).
    Raises ValueError on an out-of-range id."""
    parser, frames = FrameParser(layout), []
    for t in token_ids:
        if parser.done:
            break
        f = parser.push(t)
        if f is not None:
            frames.append(f)
    return frames


def frames_to_snac_codes(frames: list[list[int]] | torch.Tensor) -> list[torch.Tensor]:
    """Frames ``[N, 7]`` (int codes) -> SNAC 24 kHz codes ``[int64 (1, N), (1, 2N), (1, 4N)]`` per
    :data:`SNAC_SLOTS` (layer 0 <- p0; layer 1 <- p1, p4; layer 2 <- p2, p3, p5, p6)."""
    f = torch.as_tensor(frames, dtype=torch.long).reshape(-1, 7)
    l0 = f[:, [0]].reshape(1, -1)
    l1 = f[:, [1, 4]].reshape(1, -1)
    l2 = f[:, [2, 3, 5, 6]].reshape(1, -1)
    return [l0, l1, l2]
