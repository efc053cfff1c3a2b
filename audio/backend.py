"""Where the speech LM runs: the one place in ``audio/`` that tells the two backends apart.

- ``transformers``: the LM in this process, served by :class:`audio.local_client.TransformersSpeechClient`
  (the cpu profile's speech; the exact reference in tests).
- ``vllm``: the LM in a vLLM server that the serving layer starts, owns and hands in as a client
  (:class:`core.vllm_client.VLLMClient`, with the frame constraint loaded as a logits processor); nothing of the LM
  is loaded here but its config (the vocabulary size).

Either way the engine gets an :class:`core.llm_client.LLMClient` and reads it through
:class:`audio.lm_stream.SpeechLM`.
"""

from __future__ import annotations

import torch

from core.llm_client import LLMClient

from .layout import TokenLayout


def needs_engine_process(backend: str) -> bool:
    """Whether the serving layer must start an engine process (a vLLM server) and hand its client in."""
    return backend == "vllm"


def load_speech_lm(backend: str, lm_path: str, dtype: torch.dtype, device: str, layout: TokenLayout,
                   lm_client: LLMClient | None = None) -> tuple[LLMClient, int]:
    """``(client, vocab_size)`` of the speech LM at ``lm_path`` (a directory or hub id). ``transformers``:
    ``AutoModelForCausalLM.from_pretrained`` in ``dtype`` on ``device`` (eval mode) behind a
    :class:`~audio.local_client.TransformersSpeechClient` for ``layout``; ``vllm``: ``lm_client`` itself, the
    vocabulary read from the checkpoint's config. Raises ValueError for another backend or ``vllm`` without a
    client, OSError for a missing checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if backend == "vllm":
        if lm_client is None:
            raise ValueError("tts.engine.backend vllm needs the client of a vLLM server (lm_client)")
        return lm_client, AutoConfig.from_pretrained(lm_path).vocab_size
    if backend != "transformers":
        raise ValueError(f"unknown backend {backend!r} (transformers | vllm)")
    from .local_client import TransformersSpeechClient

    lm = AutoModelForCausalLM.from_pretrained(lm_path, dtype=dtype).to(device).eval()
    return TransformersSpeechClient(lm, layout), lm.config.vocab_size
