"""The ``vllm`` backend of :class:`grafting.engine.VLMEngine`: the LLM's decode runs in vLLM's OpenAI server.

Tower and projector run here (our environment); vLLM, in its own venv and process (started and owned by the serving
layer, which hands the engine an :class:`~core.llm_client.LLMClient`: model code never imports it), gets
the prompt as token ids when there is no image (so a text-only answer is the base LLM's, and prefix caching and
n-gram lookup see the ids), or as prompt embeddings when there are images: the LLM's own embedding rows for the
text tokens and the projected image features at the placeholder positions (``GraftedVLM.embed``, bit-identical
to what the ``transformers`` backend prefills with), sent as base64 ``torch.save`` in ``prompt_embeds``.
Continuous batching, paged KV cache, prefix caching, stop strings, incremental detokenisation and structured
outputs (``response_format``) are vLLM's: the service uses no batcher of its own with this backend.

Only the LLM's input-embedding table is loaded here (:class:`EmbeddingTable`), not its layers: the engine
process owns those.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.constants import SERVED_NAME
from core.llm_client import EngineRequestError, EngineUnavailableError, LLMClient

from .config import VLMConfig
from .generate import Delta, SamplingParams
from .model import GraftedVLM
from .processor import Prompt

EMBED_KEY_SUFFIXES = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight")
SUPPRESS_BIAS = -100.0  # OpenAI's most negative logit_bias: a suppressed id is never sampled


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


@dataclass
class CompletionRequest:
    """One vLLM ``/v1/completions`` request. Exactly one of ``prompt`` (token ids) and ``prompt_embeds`` (base64
    ``torch.save`` of a ``(T, H)`` float tensor) is set. ``logprobs``: None for none, else the number of top
    alternatives (0-20) besides the sampled token. ``logit_bias``: token id (as a string) -> additive bias.
    ``structured_outputs``: vLLM's ``StructuredOutputsParams`` as a dict, e.g. ``{"json": schema}`` or
    ``{"json_object": true}``.
    """

    model: str
    max_tokens: int
    prompt: list[int] | None = None
    prompt_embeds: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body (streaming, token ids returned, logprob tokens as ``token_id:<id>``, usage in the last
        chunk, special tokens skipped in the text). Raises ValueError unless exactly one prompt form is set."""
        if (self.prompt is None) == (self.prompt_embeds is None):
            raise ValueError("exactly one of prompt and prompt_embeds must be given")
        b = {k: v for k, v in asdict(self).items() if v is not None}
        b.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True,
                 return_tokens_as_token_ids=True, skip_special_tokens=True)
        return b


def structured_outputs(response_format: dict | None) -> dict | None:
    """An OpenAI ``response_format`` (as validated by ``VLMEngine.response_format``) -> vLLM's structured outputs:
    ``{"json": schema}`` or ``{"json_object": True}``. The server runs them without optional whitespace
    (``services/engines/vllm_server.py``)."""
    if response_format is None:
        return None
    if response_format["type"] == "json_object":
        return {"json_object": True}
    return {"json": response_format["json_schema"]["schema"]}


def embeds_payload(embeds: torch.Tensor) -> str:
    """``(T, H)`` prompt embeddings -> base64 of ``torch.save`` (what vLLM's ``prompt_embeds`` takes)."""
    buf = io.BytesIO()
    torch.save(embeds.detach().cpu().contiguous(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class VLLMBackend:
    """Runs the LLM's decode in a vLLM server through ``client`` (an :class:`~core.llm_client.LLMClient`, see
    the module docstring).

    ``ready()`` tells whether the engine serves now, ``generate(...)`` streams :class:`~grafting.generate.Delta`
    events like the ``transformers`` backend (same text, token ids, logprob layout, finish reasons ``stop`` |
    ``length``), ``close()`` releases the client.
    Raises EngineUnavailableError (HTTP 503) when the server is down or dies mid-request, EngineRequestError
    (HTTP 400) when vLLM refuses a request.
    """

    def __init__(self, config: VLMConfig, model: GraftedVLM, eos_token_ids: set[int], client: LLMClient):
        self.config = config
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.client = client

    def ready(self) -> bool:
        """True while the engine is up and healthy (False while starting, restarting, failed or stopped)."""
        return self.client.state == "ready"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until :meth:`ready` or ``timeout`` seconds; returns :meth:`ready`."""
        return self.client.wait_ready(timeout)

    def close(self) -> None:
        """Release the client (its engine process stops)."""
        self.client.close()

    @torch.inference_mode()
    def prompt_embeddings(self, prompt: Prompt) -> torch.Tensor:
        """``(T, H)`` input embeddings of a prompt with images (image features spliced in), the LLM dtype."""
        return self.model.embed(prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw)[0]

    async def request(self, prompt: Prompt, params: SamplingParams,
                      response_format: dict | None = None) -> CompletionRequest:
        """The vLLM request for a prepared prompt: token ids without images, embeddings with images (the image
        placeholder ids then get the most negative logit bias, as the ``transformers`` backend masks them)."""
        req = CompletionRequest(
            model=SERVED_NAME, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            seed=params.seed, stop=list(params.stop), stop_token_ids=sorted(self.eos_token_ids),
            repetition_penalty=params.repetition_penalty,  # issue 11 hook: raised by the collapse guard's retry
            logprobs=params.top_logprobs if params.logprobs else None,
            structured_outputs=structured_outputs(response_format))
        if prompt.pixel_values is None:
            req.prompt = prompt.input_ids[0].tolist()
        else:
            embeds = await asyncio.to_thread(self.prompt_embeddings, prompt)
            req.prompt_embeds = await asyncio.to_thread(embeds_payload, embeds)
            req.logit_bias = {str(i): SUPPRESS_BIAS for i in self.model.image_token_ids.all()}
        return req

    async def _stream(self, req: CompletionRequest, structured: bool):
        """The client's chunks; vLLM compiles a request's grammar after the response has begun, so a refusal then
        is a schema it cannot compile: it names ``response_format``."""
        try:
            async for chunk in self.client.stream(req.body()):
                yield chunk
        except EngineRequestError as exc:
            if structured and exc.param is None:
                exc.param = "response_format"
            raise

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       response_format: dict | None = None) -> AsyncIterator[Delta]:
        """Stream the answer as :class:`Delta` events: one per generated token (the text a chunk brings is on
        its first token), then a final event with ``finish_reason`` and ``completion_tokens``. The EOS token
        ends the stream without an event of its own (as in the ``transformers`` backend), but is counted.
        Closing the iterator closes the HTTP stream, which aborts the request in vLLM."""
        if not self.ready():
            raise EngineUnavailableError(f"the language-model engine is {self.client.state}; retry shortly")
        req = await self.request(prompt, params, response_format)
        n, finish, usage_n = 0, None, None
        async for chunk in self._stream(req, response_format is not None):
            if chunk.completion_tokens is not None:
                usage_n = chunk.completion_tokens
                continue
            text = chunk.text
            for i, tok in enumerate(chunk.token_ids):
                n += 1
                last = i == len(chunk.token_ids) - 1
                if last and chunk.finish_reason == "stop" and tok in self.eos_token_ids:
                    if text:
                        yield Delta(text, None, None, n - 1, time.perf_counter())
                    break
                lp = chunk.logprobs[i] if chunk.logprobs else None
                yield Delta(text, tok, None, n, time.perf_counter(), lp.logprob if lp else None,
                            lp.top if lp else None)
                text = ""
            else:
                if text:  # text with no new token (a flushed tail)
                    yield Delta(text, None, None, n, time.perf_counter())
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
        if finish not in ("stop", "length"):
            raise EngineUnavailableError(f"the language-model engine ended the request with {finish!r}")
        yield Delta("", None, finish, usage_n if usage_n is not None else n, time.perf_counter())
