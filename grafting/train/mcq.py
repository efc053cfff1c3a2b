"""Multiple-choice items and readers for files on disk: the synthetic test split, MMStar and MMMU-Pro.

Formats read (the real sets cannot be downloaded here; the readers are tested on small fixtures):
- MMStar / MMMU-Pro as distributed by VLMEvalKit (``MMStar.tsv``, ``MMMU_Pro_10c.tsv``, ``MMMU_Pro_V.tsv``):
  tab-separated, columns ``index, question, A, B, C, ... , answer`` (a letter), ``image`` (base64, or a JSON
  list of base64 strings), optional ``category``/``l2-category``/``subject``.
- MMMU-Pro as exported from the HF dataset ``MMMU/MMMU_Pro`` to JSONL: ``id, question, options`` (a list, or
  its Python/JSON string), ``answer`` (letter), ``image_1``..``image_7`` (base64 or file paths), ``subject``.
The question shown to the model lists the options with letters; the choices scored are the letters.
"""

from __future__ import annotations

import ast
import base64
import csv
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

LETTERS = "ABCDEFGHIJ"


@dataclass
class MCItem:
    """One multiple-choice question: ``question`` (text shown after the images), ``choices`` (the reply
    strings scored), ``answer_index``, ``images`` (file paths or PIL images), ``question_type`` (category),
    ``held_out`` (synthetic: an unseen colour/shape pair)."""

    id: str
    question: str
    choices: list[str]
    answer_index: int
    images: list[Any] = field(default_factory=list)
    question_type: str = "all"
    held_out: bool = False


def synth_items(path: str | Path) -> list[MCItem]:
    """Items of a synthetic ``test.jsonl`` (:func:`grafting.train.synth.write_dataset`)."""
    from .data import read_jsonl

    items = []
    for row in read_jsonl(path):
        q = row["conversations"][0]["value"].replace("<image>", "").strip()
        img = str(Path(row["_root"]) / row["image"])
        items.append(MCItem(row["id"], q, row["choices"], row["answer_index"], [img], row["question_type"],
                            bool(row.get("held_out_pair", False))))
    return items


def _decode_b64_image(s: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(s))).convert("RGB")


def _images_field(value: str) -> list[Image.Image]:
    value = value.strip()
    if value.startswith("["):
        return [_decode_b64_image(v) for v in json.loads(value)]
    return [_decode_b64_image(value)]


def format_question(question: str, options: list[str]) -> str:
    """Question plus lettered options and the instruction to answer with a letter."""
    lines = [question.strip(), "Options:"] + [f"{LETTERS[i]}. {o}" for i, o in enumerate(options)]
    return "\n".join(lines) + "\nAnswer with the option's letter from the given choices directly."


def read_vlmevalkit_tsv(path: str | Path, limit: int | None = None) -> list[MCItem]:
    """MMStar / MMMU-Pro in VLMEvalKit's TSV layout -> items (choices are the letters of non-empty options).

    Raises ValueError naming the row when the answer letter is not one of its options or a column is missing.
    """
    csv.field_size_limit(sys.maxsize)
    items = []
    with open(path, newline="") as f:
        for n, row in enumerate(csv.DictReader(f, delimiter="\t"), 2):
            try:
                options = [row[L] for L in LETTERS if row.get(L) not in (None, "", "nan")]
                answer = row["answer"].strip()
                qtype = row.get("category") or row.get("subject") or "all"
                images = _images_field(row["image"]) if row.get("image") else []
                question = row["question"]
            except KeyError as err:
                raise ValueError(f"{path}:{n}: missing column {err}") from None
            letters = list(LETTERS[: len(options)])
            if answer not in letters:
                raise ValueError(f"{path}:{n}: answer {answer!r} is not one of {letters}")
            items.append(MCItem(str(row.get("index", n)), format_question(question, options), letters,
                                letters.index(answer), images, qtype))
            if limit and len(items) >= limit:
                break
    return items


def read_mmmu_pro_jsonl(path: str | Path, limit: int | None = None) -> list[MCItem]:
    """MMMU-Pro rows exported from ``MMMU/MMMU_Pro`` (standard config) as JSONL -> items.

    ``<image k>`` references in the question are replaced by ``[image k]``; images are listed in order.
    Raises ValueError naming the line for unparsable options or an out-of-range answer.
    """
    items = []
    root = Path(path).parent
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        opts = row["options"]
        if isinstance(opts, str):
            try:
                opts = ast.literal_eval(opts)
            except (ValueError, SyntaxError):
                raise ValueError(f"{path}:{n}: options is not a list") from None
        letters = list(LETTERS[: len(opts)])
        if row["answer"] not in letters:
            raise ValueError(f"{path}:{n}: answer {row['answer']!r} is not one of {letters}")
        images = []
        for k in range(1, 8):
            v = row.get(f"image_{k}")
            if v:
                is_path = len(v) < 1024 and (root / v).is_file()
                images.append(str(root / v) if is_path else _decode_b64_image(v))
        q = row["question"]
        for k in range(1, 8):
            q = q.replace(f"<image {k}>", f"[image {k}]")
        items.append(MCItem(str(row.get("id", n)), format_question(q, opts), letters, letters.index(row["answer"]),
                            images, row.get("subject") or "all"))
        if limit and len(items) >= limit:
            break
    return items


def read_items(path: str | Path, limit: int | None = None) -> list[MCItem]:
    """Pick the reader by file: ``.tsv`` -> VLMEvalKit, ``.jsonl`` with ``choices`` rows -> synthetic test,
    other ``.jsonl`` -> MMMU-Pro. Raises ValueError for other extensions."""
    path = Path(path)
    if path.suffix == ".tsv":
        return read_vlmevalkit_tsv(path, limit)
    if path.suffix == ".jsonl":
        first = json.loads(next(l for l in path.read_text().splitlines() if l.strip()))
        if "choices" in first and "conversations" in first:
            return synth_items(path)[:limit] if limit else synth_items(path)
        return read_mmmu_pro_jsonl(path, limit)
    raise ValueError(f"unsupported benchmark file {path} (.tsv or .jsonl)")
