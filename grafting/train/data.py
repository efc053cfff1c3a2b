"""LLaVA-style JSONL conversations -> padded training batches with loss on assistant tokens only.

A row is ``{"image": "<path relative to the JSONL>", "conversations": [{"from": "human"|"gpt"|"system",
"value": "..."}]}`` (LLaVA, arXiv:2304.08485); ``<image>`` marks where the image goes (at the start of the first
human turn when absent). Rows are rendered with the LLM's own chat template through
:class:`~grafting.processor.GraftProcessor`, so training sees exactly the token layout the service builds.
Labels are -100 everywhere except the tokens of assistant turns (their text and end-of-turn token), in every
turn of a multi-turn conversation; image spans are never labelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from core.jsonl import jsonl_values

from ..model import image_token_counts
from ..processor import GraftProcessor

IGNORE = -100
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; each row gets ``_root`` (the file's folder) for resolving image paths.
    Raises ValueError naming the line of a malformed row."""
    path = Path(path)
    rows = []
    for n, row in jsonl_values(path):
        if not isinstance(row, dict) or not isinstance(row.get("conversations"), list) or not row["conversations"]:
            raise ValueError(f"{path}:{n}: row has no conversations list")
        row["_root"] = str(path.parent)
        rows.append(row)
    return rows


def to_messages(row: dict, image: Image.Image | None) -> list[dict[str, Any]]:
    """A LLaVA row -> OpenAI-style messages; the image becomes an ``{"type": "image"}`` part where ``<image>``
    stood (dropped when ``image`` is None, e.g. for the blind baseline). Raises ValueError on unknown roles."""
    msgs, placed = [], False
    for turn in row["conversations"]:
        role = ROLE_OF.get(turn.get("from"))
        if role is None:
            raise ValueError(f"unknown conversation role {turn.get('from')!r}")
        text = turn["value"]
        if role == "user" and not placed and (image is not None or "<image>" in text):
            before, _, after = text.partition("<image>") if "<image>" in text else ("", "", text)
            parts = [{"type": "text", "text": s.strip()} for s in (before,) if s.strip()]
            if image is not None:
                parts.append({"type": "image", "image": image})
            parts += [{"type": "text", "text": after.strip()}] if after.strip() else []
            msgs.append({"role": role, "content": parts})
            placed = True
        else:
            msgs.append({"role": role, "content": text.replace("<image>", "").strip()})
    return msgs


def load_image(row: dict) -> Image.Image:
    """The row's image (path relative to its JSONL file) as RGB."""
    p = Path(row["image"])
    return Image.open(p if p.is_absolute() else Path(row["_root"]) / p).convert("RGB")


@dataclass
class Encoded:
    """One tokenized conversation: ``input_ids``/``labels`` ``(T,)`` long; ``pixel_values`` ``(P, 3, 14, 14)``
    float and ``image_grid_thw`` ``(I, 3)`` long, or None without images."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


def encode(processor: GraftProcessor, messages: list[dict]) -> Encoded:
    """Tokenize a conversation for training with assistant-only labels.

    Each assistant turn's tokens are found as the difference between the template rendered up to that turn
    (with the generation prompt) and rendered through it, so any chat template works, multi-turn included.
    Raises ValueError if the template is not prefix-stable (a turn re-renders earlier text differently) or
    when the processor rejects the messages (PromptError / ImageInputError).
    """
    conv, sources = processor.normalize(messages)
    images = processor.load_images(sources)
    ids = processor.template_ids(conv, add_generation_prompt=False)
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        start = len(processor.template_ids(conv[:i], add_generation_prompt=True))
        upto = processor.template_ids(conv[: i + 1], add_generation_prompt=False)
        if upto != ids[: len(upto)]:
            raise ValueError("chat template is not prefix-stable; cannot locate assistant tokens")
        end = len(upto)
        # the template's trailing newline after the end-of-turn token is not something to learn
        while end > start and processor.tokenizer.decode(upto[end - 1:end]).strip() == "":
            end -= 1
        labels[start:end] = upto[start:end]
    if not images:
        return Encoded(torch.tensor(ids), torch.tensor(labels), None, None)
    feats = processor.image_processor(images=images, return_tensors="pt")
    grid = feats["image_grid_thw"]
    per_image = image_token_counts(grid)
    t = processor.image_token_ids
    out_ids, out_labels, k = [], [], 0
    for tid, lab in zip(ids, labels):
        if tid == t.image:
            span = [t.start] + [t.image] * per_image[k] + [t.end]
            out_ids += span
            out_labels += [IGNORE] * len(span)
            k += 1
        else:
            out_ids.append(tid)
            out_labels.append(lab)
    if k != len(images):
        raise ValueError(f"chat template kept {k} of {len(images)} image markers")
    return Encoded(torch.tensor(out_ids), torch.tensor(out_labels), feats["pixel_values"], grid)


def collate(items: list[Encoded], pad_id: int, max_len: int | None = None) -> dict[str, torch.Tensor | None]:
    """Right-pad a list of :class:`Encoded` into a batch.

    Returns ``input_ids``/``labels``/``attention_mask`` ``(B, T)`` long, ``pixel_values`` ``(P, 3, 14, 14)``
    and ``image_grid_thw`` ``(I, 3)`` of all images in row order (None when no row has one).
    Raises ValueError when a row is longer than ``max_len`` (never truncated: that could cut an image span).
    """
    T = max(len(x.input_ids) for x in items)
    if max_len is not None and T > max_len:
        raise ValueError(f"a conversation is {T} tokens, over max_len {max_len}")
    B = len(items)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for i, x in enumerate(items):
        n = len(x.input_ids)
        ids[i, :n], labels[i, :n], mask[i, :n] = x.input_ids, x.labels, 1
    pv = [x.pixel_values for x in items if x.pixel_values is not None]
    grid = [x.image_grid_thw for x in items if x.image_grid_thw is not None]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values": torch.cat(pv) if pv else None, "image_grid_thw": torch.cat(grid) if grid else None}


class ConversationDataset(torch.utils.data.Dataset):
    """LLaVA JSONL rows encoded on access (images decoded per item). ``__getitem__`` -> :class:`Encoded`."""

    def __init__(self, rows: list[dict], processor: GraftProcessor):
        self.rows = rows
        self.processor = processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Encoded:
        row = self.rows[i]
        image = load_image(row) if row.get("image") else None
        return encode(self.processor, to_messages(row, image))
