"""Reading JSON Lines files (one JSON value per line; blank lines skipped), for the graft's training rows
(``grafting/train/data.py``) and the VLM's traffic dataset (``grafting/traffic.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_values(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number from 1, value)`` of each non-blank line of ``path`` (UTF-8). Raises ValueError
    ``"<path>:<n>: not JSON (...)"`` for a line that is not JSON; OSError (FileNotFoundError) from opening it."""
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield n, json.loads(raw)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not JSON ({err})") from None
