"""The ``vllm`` backend of :class:`grafting.engine.VLMEngine`: the LLM's decode runs in vLLM's OpenAI server.

Tower and projector run here (our environment); vLLM, in its own venv and process (``llmproc.process``), gets
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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmproc.client import CompletionRequest, CompletionsClient, EngineRequestError, EngineUnavailableError
from llmproc.process import ServerProcess, ServerSpec

from .config import VLMConfig
from .generate import Delta, SamplingParams
from .model import GraftedVLM
from .processor import Prompt

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "chimera-llm"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
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


def server_spec(config: VLMConfig, llm_path: str) -> ServerSpec:
    """The vLLM OpenAI server command for ``config`` (``vlm.engine.vllm`` options) serving ``llm_path``.

    Context = ``max_prompt_tokens + max_new_tokens``; ``--max-num-seqs`` = ``max_batch_size``;
    ``--generation-config vllm`` so the checkpoint's sampling defaults never override a request (we send every
    sampling field); ``--enable-prompt-embeds`` for prompts with images; structured outputs emit compact JSON
    (xgrammar with ``disable_any_whitespace``, a server-wide setting): the grammar otherwise lets a small model emit
    newlines until ``max_tokens``, and an answer cut there does not parse."""
    o = config.vllm
    python = o.python if Path(o.python).is_absolute() else str(REPO_ROOT / o.python)
    args = ["--model", llm_path, "--served-model-name", SERVED_NAME, "--dtype", o.dtype or config.dtype,
            "--max-model-len", str(config.max_prompt_tokens + config.max_new_tokens),
            "--max-num-seqs", str(config.max_batch_size), "--tensor-parallel-size", str(o.tensor_parallel_size),
            "--enable-prompt-embeds", "--generation-config", "vllm", "--max-logprobs", "20",
            "--enable-prefix-caching" if o.enable_prefix_caching else "--no-enable-prefix-caching",
            "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
            "--disable-uvicorn-access-log"]
    if o.enforce_eager:
        args.append("--enforce-eager")
    if o.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)]
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    if o.cpu_kvcache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(o.cpu_kvcache_space_gib)
    if o.cpu_threads is not None:  # share the host's cores: no pinning, a bounded OpenMP pool
        env.update(OMP_NUM_THREADS=str(o.cpu_threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    return ServerSpec(python=python, module=VLLM_MODULE, args=args + list(o.extra_args), env=env,
                      startup_timeout_s=o.startup_timeout_s)


def structured_outputs(response_format: dict | None) -> dict | None:
    """An OpenAI ``response_format`` (as validated by ``VLMEngine.response_format``) -> vLLM's structured outputs:
    ``{"json": schema}`` or ``{"json_object": True}``. The server runs them without optional whitespace
    (:func:`server_spec`)."""
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
    """Runs the LLM's decode in a supervised vLLM server (see the module docstring).

    ``start()`` spawns the server (non-blocking), ``ready()`` tells whether it serves now, ``generate(...)``
    streams :class:`~grafting.generate.Delta` events like the ``transformers`` backend (same text, token ids,
    logprob layout, finish reasons ``stop`` | ``length``), ``close()`` stops the server.
    Raises EngineUnavailableError (HTTP 503) when the server is down or dies mid-request, EngineRequestError
    (HTTP 400) when vLLM refuses a request.
    """

    def __init__(self, config: VLMConfig, llm_path: str, model: GraftedVLM, eos_token_ids: set[int]):
        self.config = config
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.server = ServerProcess(server_spec(config, llm_path))

    @property
    def client(self) -> CompletionsClient:
        """A client of the server's current address (it moves after a failed start)."""
        return CompletionsClient(self.server.base_url)

    def start(self) -> "VLLMBackend":
        """Spawn the server under supervision (returns at once; see :meth:`ready`)."""
        self.server.start()
        return self

    def ready(self) -> bool:
        """True while the server is up and healthy (False while starting, restarting, failed or stopped)."""
        return self.server.state == "ready"

    def close(self) -> None:
        """Stop the server and its supervision."""
        self.server.stop()

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
            async for chunk in self.client.stream(req):
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
            raise EngineUnavailableError(f"the language-model engine is {self.server.state}; retry shortly")
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
