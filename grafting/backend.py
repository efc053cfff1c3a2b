"""Where the VLM's LLM runs: the one place in ``grafting/`` that tells the two backends apart.

- ``transformers``: the whole LLM in this process, served by :class:`grafting.local_client.TransformersClient`
  (continuous batching here; the exact reference that training, evaluation, notebooks and tests use).
- ``vllm``: the LLM's layers in a vLLM server that the serving layer starts, owns and hands in as a client
  (:class:`core.vllm_client.VLLMClient`); here only the LLM's input-embedding table is loaded
  (:class:`grafting.embedding_table.EmbeddingTable`), for the prompt embeddings of image prompts.

Either way the engine gets a ``(llm, client)`` pair and talks to the LLM only through the client protocol
(:class:`core.llm_client.LLMClient`).
"""

from __future__ import annotations

from typing import Any

import torch

from core.llm_client import LLMClient

BACKENDS = ("transformers", "vllm")


def check_backend(backend: str, llm_client: LLMClient | None) -> None:
    """Raise ValueError for a backend name not in :data:`BACKENDS`, for ``vllm`` without ``llm_client`` or for
    ``transformers`` with one."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (transformers | vllm)")
    if (backend == "vllm") != (llm_client is not None):
        raise ValueError("the vllm backend takes an llm_client (and only it does)")


def needs_engine_process(backend: str) -> bool:
    """Whether the serving layer must start an engine process (a vLLM server) and hand its client in."""
    return backend == "vllm"


def load_llm(backend: str, llm_path: str, dtype: torch.dtype, device: str, tokenizer, max_batch_size: int,
             llm_client: LLMClient | None = None) -> tuple[Any, LLMClient]:
    """The LLM module the :class:`~grafting.model.GraftedVLM` holds and the client the engine decodes through.

    ``transformers``: ``AutoModelForCausalLM.from_pretrained(llm_path)`` in ``dtype`` on ``device`` (``auto``: a
    device map over the GPUs) and a :class:`~grafting.local_client.TransformersClient` of it (``tokenizer``,
    ``max_batch_size`` rows). ``vllm``: the checkpoint's embedding table alone (on ``device``, ``cuda:0`` for
    ``auto``) with its generation config (EOS ids), and ``llm_client`` itself. Raises ValueError as
    :func:`check_backend`, OSError for a missing checkpoint or embedding tensor."""
    check_backend(backend, llm_client)
    if backend == "vllm":
        from transformers import GenerationConfig

        from .embedding_table import EmbeddingTable, load_input_embeddings

        try:
            gen = GenerationConfig.from_pretrained(llm_path)
        except OSError:
            gen = None
        table_device = "cuda:0" if device == "auto" else device
        return EmbeddingTable(load_input_embeddings(llm_path, dtype), gen).to(table_device), llm_client
    from transformers import AutoModelForCausalLM

    from .local_client import TransformersClient

    if device == "auto":
        llm = AutoModelForCausalLM.from_pretrained(llm_path, dtype=dtype, device_map="auto")
    else:
        llm = AutoModelForCausalLM.from_pretrained(llm_path, dtype=dtype).to(device)
    return llm, TransformersClient(llm, tokenizer, max_batch_size)
