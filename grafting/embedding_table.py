"""The LLM's input-embedding table alone, for an engine whose LLM layers run in another process (the ``vllm``
backend, ``grafting/backend.py``): tower and projector run here, and prompts with images go to the LLM as
``(T, H)`` embeddings (the LLM's own rows for the text tokens, projected image features at the placeholder
positions: :meth:`grafting.model.GraftedVLM.embed`, bit-identical to what the in-process LLM prefills with).

Only the input-embedding tensor is read from the checkpoint (:func:`load_input_embeddings`), not the layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

EMBED_KEY_SUFFIXES = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight")


class EmbeddingTable(nn.Module):
    """The LLM's input-embedding table alone, standing in for the LLM inside :class:`GraftedVLM` when another
    process runs the LLM's layers. ``weight``: ``(V, H)``; :meth:`get_input_embeddings` returns the frozen
    ``nn.Embedding``; ``generation_config`` is the checkpoint's (EOS ids)."""

    def __init__(self, weight: torch.Tensor, generation_config: Any = None):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(weight, freeze=True)
        self.generation_config = generation_config

    def get_input_embeddings(self) -> nn.Embedding:
        """The frozen ``(V, H)`` embedding."""
        return self.embed_tokens


def _checkpoint_file(llm_path: str, name: str) -> Path | None:
    local = Path(llm_path)
    if local.is_dir():
        return local / name if (local / name).exists() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(llm_path, name))
    except EntryNotFoundError:
        return None


def load_input_embeddings(llm_path: str, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Read only the input-embedding tensor ``(V, H)`` of a safetensors checkpoint (local dir or hub id; with a
    ``model.safetensors.index.json`` only the shard holding it). Raises OSError when the checkpoint or the
    tensor is missing."""
    from safetensors import safe_open

    index = _checkpoint_file(llm_path, "model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        key = next((k for k in weight_map if k.endswith(EMBED_KEY_SUFFIXES)), None)
        files = [_checkpoint_file(llm_path, weight_map[key])] if key else []
    else:
        files, key = [_checkpoint_file(llm_path, "model.safetensors")], None
    for f in files:
        if f is None:
            continue
        with safe_open(str(f), framework="pt", device=device) as st:
            key = key or next((k for k in st.keys() if k.endswith(EMBED_KEY_SUFFIXES)), None)
            if key is not None:
                return st.get_tensor(key).to(dtype)
    raise OSError(f"no input-embedding tensor ({', '.join(EMBED_KEY_SUFFIXES)}) in the checkpoint {llm_path}")
