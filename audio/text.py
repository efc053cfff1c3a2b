"""Text handling for speech: sentence splitting (one-shot and incremental) and angle-bracket tags.

Orpheus reads supported non-verbal tags (``<laugh>``, ``<chuckle>`` ...) as text and renders them as sounds;
other angle-bracket tags (``<break time="1s"/>``, HTML) would be read aloud, so they are stripped and reported.

Splitting is prefix-stable: a boundary is a sentence terminator followed by whitespace, and an over-long sentence
is cut by a rule that only looks at its first ``max_chars + 1`` characters. So text appended in any pieces
(even inside a word or a tag) splits exactly as the same text in one piece, and every character lands in
exactly one sentence (nothing is lost at the joins).
"""

from __future__ import annotations

import re
import unicodedata

_BOUNDARY = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*\s+")
_TAG = re.compile(r"<\s*(/?)\s*([A-Za-z][\w:-]*)[^<>]*>")
_SPACE = re.compile(r"\s+")


def clean_sentence(text: str, tags: list[str]) -> tuple[str, list[str]]:
    """Keep supported tags (normalised to ``<name>``), strip other angle-bracket tags, collapse whitespace.

    Returns ``(clean_text, stripped)``, ``stripped`` being the removed tags verbatim."""
    stripped: list[str] = []
    allowed = {t.lower() for t in tags}

    def repl(m: re.Match) -> str:
        name = m.group(2).lower()
        if not m.group(1) and name in allowed and m.group(0).replace(" ", "").lower() == f"<{name}>":
            return f"<{name}>"
        stripped.append(m.group(0))
        return " "

    out = _SPACE.sub(" ", _TAG.sub(repl, text)).strip()
    out = re.sub(r" ([.,!?;:\u2026])", r"\1", out)  # "a <b>lot</b>." -> "a lot."
    return out, stripped


def has_speech(text: str) -> bool:
    """True when cleaned ``text`` holds something to say: a character other than punctuation and whitespace
    (Unicode categories P*, Z*). ``""`` or ``"."`` have nothing; ``"<laugh>"`` or ``"Hi"`` do."""
    return any(not unicodedata.category(c).startswith(("P", "Z")) and not c.isspace() for c in text)


def _cut_long(s: str, max_chars: int) -> int:
    """Where to cut a sentence longer than ``max_chars`` (looks only at ``s[:max_chars + 1]``): after the last
    comma/semicolon followed by a space, else at the last space, else hard at ``max_chars``."""
    head = s[: max_chars + 1]
    for pat in (r"[,;:]\s", r"\s"):
        hits = [m.end() for m in re.finditer(pat, head)]
        hits = [h for h in hits if h > max_chars // 4]
        if hits:
            return hits[-1]
    return max_chars


def _open_tag(s: str) -> bool:
    """True while ``s`` ends inside an unclosed ``<...`` (a tag may still be arriving)."""
    i = s.rfind("<")
    return i >= 0 and ">" not in s[i:] and len(s) - i <= 64


class SentenceBuffer:
    """Incremental sentence splitter: ``append(text)`` returns the sentences completed so far (raw text);
    ``finish()`` returns the rest. ``split(text) == append(text) + finish()`` for any way of cutting ``text``."""

    def __init__(self, max_chars: int = 300):
        self.max_chars = max_chars
        self.pending = ""

    def append(self, text: str) -> list[str]:
        self.pending += text
        out: list[str] = []
        while True:
            m = _BOUNDARY.search(self.pending)
            # a boundary needs its whitespace; it must not lie past an over-long cut
            if m and m.end() <= self.max_chars + 1:
                out.append(self.pending[: m.end()])
                self.pending = self.pending[m.end():]
                continue
            if len(self.pending) > self.max_chars and not _open_tag(self.pending[: self.max_chars + 1]):
                k = _cut_long(self.pending, self.max_chars)
                out.append(self.pending[:k])
                self.pending = self.pending[k:]
                continue
            return out

    def finish(self) -> list[str]:
        """Return what is left as final sentences and empty the buffer."""
        out = self.append("")
        rest, self.pending = self.pending, ""
        while len(rest) > self.max_chars:
            k = _cut_long(rest, self.max_chars)
            out.append(rest[:k])
            rest = rest[k:]
        if rest:
            out.append(rest)
        return out

    def clear(self) -> None:
        self.pending = ""


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Raw sentences of ``text`` (joined they give back ``text`` exactly)."""
    buf = SentenceBuffer(max_chars)
    return buf.append(text) + buf.finish()
