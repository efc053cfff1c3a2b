"""vLLM's OpenAI-compatible server for a VLM profile: its command line (:func:`server_spec`) and its start with a
client for the engine (:func:`start_vllm_for`), used by the VLM deployment and by tests and benches without Ray.

The server runs in ``.venv-vllm`` under :class:`services.engine_process.ServerProcess`; the engine
(``grafting/vllm_backend.py``) gets the :class:`services.engine_client.VLLMClient` and never this module.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafting.config import VLMConfig
from grafting.engine import resolve_path
from grafting.vllm_backend import SERVED_NAME

from .engine_client import VLLMClient
from .engine_process import ServerProcess, ServerSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def server_spec(config: VLMConfig, llm_path: str) -> ServerSpec:
    """The vLLM OpenAI server command for ``config`` (``vlm.engine.vllm`` options) serving ``llm_path``.

    Context = ``max_prompt_tokens + max_new_tokens``; ``--max-num-seqs`` = ``max_batch_size``;
    ``--generation-config vllm`` so the checkpoint's sampling defaults never override a request (we send every
    sampling field); ``--enable-prompt-embeds`` for prompts with images; structured outputs emit compact JSON
    (xgrammar with ``disable_any_whitespace``, a server-wide setting): the grammar otherwise lets a small model emit
    newlines until ``max_tokens``, and an answer cut there does not parse. ``vllm.speculative`` becomes
    ``--speculative-config`` (its fields as JSON)."""
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
    if o.speculative is not None:
        args += ["--speculative-config", o.speculative.model_dump_json()]
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    if o.cpu_kvcache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(o.cpu_kvcache_space_gib)
    if o.cpu_threads is not None:  # share the host's cores: no pinning, a bounded OpenMP pool
        env.update(OMP_NUM_THREADS=str(o.cpu_threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    return ServerSpec(python=python, module=VLLM_MODULE, args=args + list(o.extra_args), env=env,
                      startup_timeout_s=o.startup_timeout_s)


def start_vllm_for(config: VLMConfig, model_dir: str | Path | None = None) -> VLLMClient:
    """Start (not await) the vLLM server for ``config`` (its LLM, paths relative to ``model_dir``) under
    supervision and return a client of it (``client.server`` is the :class:`ServerProcess`; ``client.close()``
    stops it). Raises FileNotFoundError when the engine interpreter is missing (run ``make install``)."""
    server = ServerProcess(server_spec(config, resolve_path(model_dir, config.llm)))
    return VLLMClient(server.start())
