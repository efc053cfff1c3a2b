"""The prompt file a family writes for the quantization worker (``prompts.safetensors``): the files-on-disk
interface between the family's environment (which knows its prompts: chat templates, images through the tower and
projector) and ``.venv-quant`` (which knows only the language model).

Each prompt is one tensor: ``"<set>/<i>/ids"`` ``(T,)`` int64 token ids, or ``"<set>/<i>/embeds"`` ``(T, H)``
float32 input embeddings (prompts with images: exactly what the service sends vLLM as ``prompt_embeds``). The
metadata key ``"chimera"`` holds JSON ``{"sets": {set: {"role": "search" | "heldout", "count": n,
"description": str}}, "score_vocab": [start, end] | null}``. Roles: ``search`` (the quantization worker's unit
selection), ``train`` (the speculator worker's training set, :mod:`core.spec.worker`), ``heldout`` (both
workers' reports). The quantization worker answers every prompt greedily with the
reference model and scores the answer's positions; with ``score_vocab`` (the speech LM's audio ids) both the
answers and the statistics are restricted to the ids ``start <= id < end``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROLES = ("search", "train", "heldout")


@dataclass
class PromptSet:
    """One named set: ``role`` (``search``: selects units; ``train``: trains a draft head; ``heldout``: the
    report), ``description`` and its
    ``prompts``, each ``(T,)`` int64 ids or ``(T, H)`` float32 embeddings."""

    role: str
    description: str
    prompts: list[torch.Tensor] = field(default_factory=list)


def write_prompts(path: str | Path, sets: dict[str, PromptSet], score_vocab: tuple[int, int] | None = None) -> Path:
    """Save ``sets`` (and ``score_vocab``) to ``path`` (safetensors). Raises ValueError for an unknown role, an
    empty set, a prompt that is neither ``(T,)`` int64 nor ``(T, H)`` float32, or a set name containing ``/``."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, s in sets.items():
        if s.role not in ROLES or not s.prompts or "/" in name:
            raise ValueError(f"prompt set {name!r}: role {s.role!r} (one of {ROLES}), {len(s.prompts)} prompts")
        for i, p in enumerate(s.prompts):
            if p.ndim == 1 and p.dtype == torch.int64:
                tensors[f"{name}/{i}/ids"] = p.contiguous()
            elif p.ndim == 2 and p.dtype == torch.float32:
                tensors[f"{name}/{i}/embeds"] = p.contiguous()
            else:
                raise ValueError(f"prompt {name}/{i}: {tuple(p.shape)} {p.dtype}, want (T,) int64 or (T, H) float32")
        meta[name] = {"role": s.role, "count": len(s.prompts), "description": s.description}
    path = Path(path)
    vocab = list(score_vocab) if score_vocab is not None else None
    save_file(tensors, str(path), metadata={"chimera": json.dumps({"sets": meta, "score_vocab": vocab})})
    return path


def read_prompts(path: str | Path) -> tuple[dict[str, PromptSet], tuple[int, int] | None]:
    """The sets and the score vocabulary of a file written by :func:`write_prompts`. Raises ValueError when its
    metadata is missing."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = (f.metadata() or {}).get("chimera")
        if meta is None:
            raise ValueError(f"{path} is not a chimera prompt file (no 'chimera' metadata)")
        sets = {}
        keys = set(f.keys())
        meta = json.loads(meta)
        for name, m in meta["sets"].items():
            prompts = [f.get_tensor(f"{name}/{i}/ids" if f"{name}/{i}/ids" in keys else f"{name}/{i}/embeds")
                       for i in range(m["count"])]
            sets[name] = PromptSet(m["role"], m["description"], prompts)
    vocab = meta.get("score_vocab")
    return sets, (tuple(vocab) if vocab else None)


def split_roles(path: str | Path, sets: dict[str, PromptSet], fit: str) -> tuple[list[str], list[str]]:
    """The names of ``sets`` (read from ``path``) with role ``fit`` (``search`` for the quantization worker,
    ``train`` for the speculator's) and with role ``heldout``, in file order. Raises ValueError naming ``path``
    when either list is empty."""
    fitted = [n for n, s in sets.items() if s.role == fit]
    heldout = [n for n, s in sets.items() if s.role == "heldout"]
    if not fitted or not heldout:
        raise ValueError(f"{path}: needs a {fit} set and a held-out set, has {sorted(sets)}")
    return fitted, heldout
