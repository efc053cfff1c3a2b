"""The VLM's traffic dataset (issue 28): the prompts it served, appended to a local JSONL file and, for each image,
the rows the LLM got for it in a folder beside it (:class:`TrafficWriter`, opt-in: ``vlm.engine.traffic_capture``),
read back as training prompts by ``chimera speculator train --traffic`` (:func:`read_traffic`).

One line per answered chat request, ``{"v": 1, "messages": [...]}``: each message's ``role`` and ``content``, a
string or a list of parts, where a text part stays ``{"type": "text", "text": ...}`` and an image part becomes
``{"type": "image_ref", "key": <32 hex digits>}``: the image-cache key of that image's tower input
(:func:`grafting.image_cache.image_keys`, BLAKE2b-128 of the preprocessed pixels), never the pixels or the URL.

The image's projected embeddings (what the LLM saw at its placeholder positions: ``(h * w / 4, H_llm)``, the
output of tower and projector, :meth:`grafting.model.GraftedVLM.features_by_key`) are stored once per key as
``<folder>/<key>.safetensors``, one float16 tensor ``"embeds"``, where ``<folder>`` is the JSONL's name with
``.embeds`` for its suffix (``vlm/traffic.jsonl`` -> ``vlm/traffic.embeds/``): :func:`embeds_dir`. They are not
pixels but are derived from the image (a model could be trained to describe or partly reconstruct it from them):
capture is off by default, files are mode 0600 (the folder 0700) and they count in the same size cap as the lines.
A line is written only after every embeddings file it refers to exists, so a reader finds them unless they were
deleted since; :func:`read_traffic` skips and counts such lines. float16 halves the bytes of float32 (the cpu
profile's dtype); the rounding is about 1e-3 relative, below what a draft head trained on them notices.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.jsonl import jsonl_values

TRAFFIC_VERSION = 1
IMAGE_PART_TYPES = ("image_url", "image")
EMBEDS_SUFFIX = ".embeds"  # the embeddings folder: the JSONL's name with this suffix (embeds_dir)
EMBEDS_TENSOR = "embeds"  # the one tensor of an embeddings file
EMBEDS_DTYPE = torch.float16
KEY_RE = re.compile(r"[0-9a-f]{32}")  # an image-cache key; also the file name, so nothing else is accepted

log = logging.getLogger("chimera")


def embeds_dir(path: str | Path) -> Path:
    """The folder of the image embeddings of the dataset ``path``: ``path`` with its suffix replaced by
    ``.embeds`` (``traffic.jsonl`` -> ``traffic.embeds``)."""
    path = Path(path)
    return path.with_name(path.stem + EMBEDS_SUFFIX)


def embeds_file(path: str | Path, key: str) -> Path:
    """The embeddings file of image ``key`` for the dataset ``path``. Raises ValueError for a key that is not 32
    lower-case hex digits (a key is a file name: no other text may reach the file system)."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"image key {key!r} is not 32 lower-case hex digits")
    return embeds_dir(path) / f"{key}.safetensors"


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


def embeds_bytes(features: torch.Tensor) -> bytes:
    """The embeddings file of one image's ``features`` ``(rows, H)``: safetensors bytes of the float16 tensor
    ``"embeds"``. Raises ValueError for another shape or values that float16 cannot hold (not finite after the
    cast)."""
    from safetensors.torch import save

    if features.ndim != 2 or features.shape[0] == 0:
        raise ValueError(f"image features of shape {tuple(features.shape)}: want (rows, H)")
    half = features.detach().to("cpu", EMBEDS_DTYPE).contiguous()
    if not bool(torch.isfinite(half).all()):
        raise ValueError("image features are not finite in float16")
    return save({EMBEDS_TENSOR: half})


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) whole or not at all: a temporary file in its folder, renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class TrafficWriter:
    """Appends :func:`traffic_line` s to ``path`` (made with its folder when missing, mode 0600; a line is one
    ``write``, never split) and each new image's embeddings to :func:`embeds_dir` (mode 0700; a file per key,
    written once, whole) while the dataset stays within ``max_bytes``: the JSONL's size plus the bytes of the
    files in the embeddings folder, read before each line, so replicas sharing the files share the cap (each may
    pass it by the one line it writes while another checks) and deleted files start again from nothing. A line
    that would pass the cap with the embeddings files it needs is not written, nor are they: :attr:`full` turns
    True and one warning names the file and the cap (again only after a line was written since).
    :attr:`written` / :attr:`dropped` count this writer's lines. Thread-safe (a replica records off its event
    loop)."""

    def __init__(self, path: str | Path, max_bytes: int):
        self.path = Path(path)
        self.embeds = embeds_dir(self.path)
        self.max_bytes = int(max_bytes)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.full = self.size() >= self.max_bytes
        self.written = 0
        self.dropped = 0
        if self.full:
            self._warn()

    def _warn(self) -> None:
        log.warning("traffic capture: %s (with %s) has reached its cap of %.1f MiB; no more prompts are written "
                    "(delete or move both to start again)", self.path, self.embeds, self.max_bytes / 2**20)

    def size(self) -> int:
        """Bytes the dataset holds now: the JSONL file and every file in the embeddings folder (0 for missing)."""
        total = self.path.stat().st_size if self.path.exists() else 0
        try:
            with os.scandir(self.embeds) as it:
                total += sum(e.stat().st_size for e in it if e.is_file())
        except FileNotFoundError:
            pass
        return total

    def missing(self, image_keys: list[str]) -> set[str]:
        """The keys among ``image_keys`` whose embeddings file does not exist yet (the ones :meth:`record` needs
        features for). Raises ValueError for a malformed key."""
        return {k for k in image_keys if not embeds_file(self.path, k).exists()}

    def record(self, messages: list[dict[str, Any]], image_keys: list[str],
               features: dict[str, torch.Tensor] | None = None) -> bool:
        """Append the line of one served conversation, after writing the embeddings of each of its images not
        stored yet (``features[key]``: ``(rows, H)``, any float dtype, stored as float16); True when written,
        False at the cap (nothing written). Raises ValueError from :func:`traffic_line` or :func:`embeds_bytes`,
        or when an image is neither stored nor in ``features``; OSError when a file cannot be written."""
        features = features or {}
        data = (json.dumps(traffic_line(messages, image_keys), ensure_ascii=False) + "\n").encode("utf-8")
        with self._lock:
            new = {}
            for key in dict.fromkeys(image_keys):
                if key in self.missing([key]):
                    if key not in features:
                        raise ValueError(f"no embeddings for image {key} (not stored, not given)")
                    new[key] = embeds_bytes(features[key])
            if self.size() + len(data) + sum(map(len, new.values())) > self.max_bytes:
                if not self.full:
                    self.full = True
                    self._warn()
                self.dropped += 1
                return False
            if new:
                self.embeds.mkdir(mode=0o700, exist_ok=True)
            for key, blob in new.items():
                _write_new(embeds_file(self.path, key), blob)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            self.full = False
            self.written += 1
            return True

    def stats(self) -> dict[str, Any]:
        """``{"written", "dropped", "full"}`` of this writer (for the replica's end events)."""
        return {"written": self.written, "dropped": self.dropped, "full": self.full}


def record_served(writer: TrafficWriter, model, messages: list[dict[str, Any]], prompt) -> bool:
    """Record a conversation the VLM served: ``prompt`` (:class:`grafting.processor.Prompt`) is what the processor
    made of ``messages``; each image not stored yet gets its features from ``model``
    (:meth:`grafting.model.GraftedVLM.features_by_key`: the image cache's entry, else tower + projector on it
    alone). Blocking (may run the tower): call it off the event loop. Returns and raises as
    :meth:`TrafficWriter.record`."""
    from .image_cache import image_keys

    keys = image_keys(prompt.pixel_values, prompt.image_grid_thw) if prompt.pixel_values is not None else []
    need = writer.missing(keys)
    feats = model.features_by_key(prompt.pixel_values, prompt.image_grid_thw, need) if need else {}
    return writer.record(messages, keys, feats)


@dataclass
class Traffic:
    """A traffic dataset as read back (:func:`read_traffic`): ``text``, the conversations without images
    (``messages`` lists); ``images``, those with images, each ``(messages, embeds)``: ``messages`` with their
    ``image_ref`` parts, ``embeds`` one ``(rows, H)`` float16 CPU tensor per ``image_ref`` in message and part
    order; ``missing``, the lines skipped because an image's embeddings file is gone (deleted, or captured before
    embeddings were stored)."""

    text: list[list[dict[str, Any]]] = field(default_factory=list)
    images: list[tuple[list[dict[str, Any]], list[torch.Tensor]]] = field(default_factory=list)
    missing: int = 0


def _check_messages(messages: Any) -> list[str] | None:
    """The image keys of a line's ``messages`` in order, or None when they are not this format's."""
    if not isinstance(messages, list) or not messages:
        return None
    keys = []
    for m in messages:
        if not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["role"], str):
            return None
        content = m["content"]
        if content is None or isinstance(content, str):  # None: an assistant turn without text, as sent
            continue
        if not isinstance(content, list):
            return None
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"} \
                    and isinstance(p["text"], str):
                continue
            if isinstance(p, dict) and p.get("type") == "image_ref" and set(p) == {"type", "key"} \
                    and isinstance(p["key"], str) and KEY_RE.fullmatch(p["key"]):
                keys.append(p["key"])
                continue
            return None
    return keys


def _load_embeds(file: Path) -> torch.Tensor:
    """The ``(rows, H)`` float16 tensor of an embeddings file. Raises ValueError for one that is not."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(file)).get(EMBEDS_TENSOR)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"unreadable ({exc})") from None
    if t is None or t.ndim != 2 or t.shape[0] == 0 or t.dtype != EMBEDS_DTYPE:
        raise ValueError(f"not one (rows, H) float16 tensor {EMBEDS_TENSOR!r}")
    return t


def read_traffic(path: str | Path) -> Traffic:
    """The :class:`Traffic` of a dataset written by :class:`TrafficWriter` (its JSONL ``path``, embeddings from
    :func:`embeds_dir`; each file loaded once). Raises ValueError naming the line for one that is not JSON, not
    this format's version, or whose ``messages`` are not a non-empty list of ``{role, content}`` with string (or
    null) content or ``text`` / ``image_ref`` parts (a key of 32 hex digits), and naming the line and the file for
    an embeddings file that is not one ``(rows, H)`` float16 tensor; FileNotFoundError for a missing ``path``."""
    out, loaded = Traffic(), {}
    for n, line in jsonl_values(path):
        keys = _check_messages(line.get("messages")) if isinstance(line, dict) and line.get("v") == \
            TRAFFIC_VERSION else None
        if keys is None:
            raise ValueError(f"{path}:{n}: not a traffic line (v {TRAFFIC_VERSION} with a messages list of role "
                             f"and content, text and image_ref parts)")
        if not keys:
            out.text.append(line["messages"])
            continue
        files = [embeds_file(path, k) for k in keys]
        if not all(f.exists() for f in files):
            out.missing += 1
            continue
        for k, f in zip(keys, files):
            if k not in loaded:
                try:
                    loaded[k] = _load_embeds(f)
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: image {k}: {f}: {exc}") from None
        out.images.append((line["messages"], [loaded[k] for k in keys]))
    return out
