"""The VLM's traffic dataset (issue 28): the prompts it served, appended to a local JSONL file
(:class:`TrafficWriter`, opt-in: ``vlm.engine.traffic_capture``), read back as training prompts by
``chimera speculator train --traffic`` (:func:`read_traffic`).

One line per answered chat request, ``{"v": 1, "messages": [...]}``: each message's ``role`` and ``content``, a
string or a list of parts, where a text part stays ``{"type": "text", "text": ...}`` and an image part becomes
``{"type": "image_ref", "key": <32 hex digits>}``: the image-cache key of that image's tower input
(:func:`grafting.image_cache.image_keys`, BLAKE2b-128 of the preprocessed pixels), never the pixels or the URL.
A reference cannot be turned back into an image: the reader skips conversations with images and counts them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from core.jsonl import jsonl_values

TRAFFIC_VERSION = 1
IMAGE_PART_TYPES = ("image_url", "image")

log = logging.getLogger("chimera")


def traffic_line(messages: list[dict[str, Any]], image_keys: list[str]) -> dict[str, Any]:
    """The dataset line of a served conversation: ``messages`` as the processor accepted them, the ``i``-th image
    part (in message and part order, the order of ``image_keys``) replaced by ``{"type": "image_ref", "key":
    image_keys[i]}``. Raises ValueError when the image parts and keys differ in number."""
    keys = iter(image_keys)
    out, used = [], 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") in IMAGE_PART_TYPES:
                    key = next(keys, None)
                    if key is None:
                        raise ValueError(f"more image parts than image keys ({len(image_keys)})")
                    parts.append({"type": "image_ref", "key": key})
                    used += 1
                else:
                    parts.append({"type": "text", "text": part.get("text", "")})
            content = parts
        out.append({"role": m["role"], "content": content})
    if used != len(image_keys):
        raise ValueError(f"{used} image parts but {len(image_keys)} image keys")
    return {"v": TRAFFIC_VERSION, "messages": out}


class TrafficWriter:
    """Appends :func:`traffic_line` s to ``path`` (made with its folder when missing, mode 0600; a line is one
    ``write``, never split) while the file stays within ``max_bytes``. The size is the file's own, read before each
    line, so replicas sharing the file share the cap (each may pass it by the one line it writes while another
    checks) and a deleted file starts again from nothing. A line that would pass the cap is not written:
    :attr:`full` turns True and one warning names the file and the cap (again only after a line was written since).
    :attr:`written` / :attr:`dropped` count this writer's lines. One writer per replica, called from its event
    loop."""

    def __init__(self, path: str | Path, max_bytes: int):
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.full = self.path.exists() and self.path.stat().st_size >= self.max_bytes
        self.written = 0
        self.dropped = 0
        if self.full:
            self._warn()

    def _warn(self) -> None:
        log.warning("traffic capture: %s has reached its cap of %.1f MiB; no more prompts are written (delete or "
                    "move the file to start again)", self.path, self.max_bytes / 2**20)

    def record(self, messages: list[dict[str, Any]], image_keys: list[str]) -> bool:
        """Append the line of one served conversation; True when written, False at the cap. Raises ValueError from
        :func:`traffic_line`, OSError when the file cannot be written."""
        data = (json.dumps(traffic_line(messages, image_keys), ensure_ascii=False) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size + len(data) > self.max_bytes:
                if not self.full:
                    self.full = True
                    self._warn()
                self.dropped += 1
                return False
            os.write(fd, data)
        finally:
            os.close(fd)
        self.full = False
        self.written += 1
        return True

    def stats(self) -> dict[str, Any]:
        """``{"written", "dropped", "full"}`` of this writer (for the replica's end events)."""
        return {"written": self.written, "dropped": self.dropped, "full": self.full}


def read_traffic(path: str | Path) -> tuple[list[list[dict[str, Any]]], int]:
    """``(conversations, skipped)`` of a traffic dataset: the text-only conversations (``messages`` lists, text
    parts kept), and the number of lines skipped because they hold an image reference (its embeddings cannot be
    re-made from the key). Raises ValueError naming the line for one that is not JSON, not this format's
    version, or has no ``messages`` list; FileNotFoundError for a missing file."""
    conversations, skipped = [], 0
    for n, line in jsonl_values(path):
        if not isinstance(line, dict) or line.get("v") != TRAFFIC_VERSION or not isinstance(
                line.get("messages"), list):
            raise ValueError(f"{path}:{n}: not a traffic line (v {TRAFFIC_VERSION} with a messages list)")
        messages = line["messages"]
        if any(isinstance(m.get("content"), list) and any(p.get("type") == "image_ref" for p in m["content"])
               for m in messages):
            skipped += 1
            continue
        conversations.append(messages)
    return conversations, skipped
