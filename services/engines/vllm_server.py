"""vLLM's OpenAI-compatible server for a VLM or speech profile: its command line (:func:`server_spec`,
:func:`speech_server_spec`) and its start with a client for the engine (:func:`start_vllm_for`, one launcher for
both families), used by the VLM and speech deployments and by tests and benches without Ray.

The server runs in ``.venv-vllm`` under :class:`services.engines.process.ServerProcess`; the engine
(``grafting/backend.py``, ``audio/backend.py``) gets the :class:`core.vllm_client.VLLMClient` and never
this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from audio import vllm_ext
from audio.config import TTSConfig
from core.config import Speculation, VLLMOptions, in_project, resolve_path
from core.constants import SERVED_NAME
from core.vllm_client import MIXED_CHAT_TEMPLATE, VLLMClient
from core.vllm_marker import VLLM_EMBEDS_MARKER, embeds_marker, head_embed_rows
from grafting.config import VLMConfig

from .process import ServerProcess, ServerSpec

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SPEECH_EXT = str(Path(vllm_ext.__file__).resolve().parent)  # chimera_frame_constraint, importable in .venv-vllm
FRAME_PROCESSOR = "chimera_frame_constraint:FramePositionLogitsProcessor"
EAGLE_MARKER_REFUSAL = (
    "an EAGLE-3 head is not served for the VLM of {llm} with {head}: vLLM 0.32 gives the image positions of its "
    "mixed prompts the id {marker} of its own marker token {text!r}, and its EAGLE proposer embeds that id unmasked "
    "with the head's own embedding table, or the LLM's when the head has none or an equal one; the LLM's has {rows} "
    "rows and the head {own}, so the draft's embed_input_ids would raise IndexError and kill the engine; train the "
    "head again with `chimera speculator train` (it writes a table of its own with a row for that id), or use "
    "method ngram or none")
VLLM_PYTHON_ENV = "CHIMERA_VLLM_PYTHON"  # the vLLM environment's interpreter; overrides the profile
NO_AMX_ENV = "CHIMERA_ENGINE_NO_AMX"  # read by engine_site/sitecustomize.py (its own copy: it imports nothing of ours)


def vllm_python(python: str) -> str:
    """The vLLM environment's interpreter for the profile's ``vllm.python``: ``$CHIMERA_VLLM_PYTHON`` when set (it
    overrides the profile, as ``CHIMERA_MODEL_DIR`` does the model directory); else ``python`` when absolute; else
    under the project directory (:func:`core.config.in_project`; the default ``.venv-vllm/bin/python`` is what
    ``make install`` builds)."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return os.environ[VLLM_PYTHON_ENV]
    return str(in_project(python))


def server_spec(config: VLMConfig, llm_path: str) -> ServerSpec:
    """The vLLM OpenAI server command for ``config`` (``vlm.engine.vllm`` options) serving ``llm_path``.

    Context = ``max_prompt_tokens + max_new_tokens``; ``--max-num-seqs`` = ``max_batch_size``;
    ``--generation-config vllm`` so the checkpoint's sampling defaults never override a request (we send every
    sampling field); ``--enable-prompt-embeds`` for prompts with images; structured outputs emit compact JSON
    (xgrammar with ``disable_any_whitespace``, a server-wide setting): the grammar otherwise lets a small model emit
    newlines until ``max_tokens``, and an answer cut there does not parse. ``vllm.speculative`` becomes
    ``--speculative-config`` (its fields as JSON). The chat template is
    :data:`core.vllm_client.MIXED_CHAT_TEMPLATE` with content parts as OpenAI's list (``--chat-template-content-format
    openai``): the VLM's image prompts come to ``/v1/chat/completions`` as vLLM's mixed prompt, already rendered
    by the VLM's processor (:func:`core.vllm_client.request_body`); nothing else uses that endpoint of this server."""
    args = ["--enable-prompt-embeds", "--max-logprobs", "20",
            "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
            "--chat-template", MIXED_CHAT_TEMPLATE, "--chat-template-content-format", "openai"]
    return _spec(config.vllm, config.dtype, llm_path, config.max_prompt_tokens + config.max_new_tokens,
                 config.max_batch_size, args, {})


def speech_server_spec(config: TTSConfig, lm_path: str) -> ServerSpec:
    """The vLLM OpenAI server command for the speech LM of ``config`` (``tts.engine.vllm`` options).

    Context = :meth:`audio.config.TTSConfig.max_model_len`; ``--max-num-seqs`` = ``max_batch_size``; the frame
    constraint ``audio/vllm_ext/chimera_frame_constraint.py`` is loaded as a custom logits processor (that
    directory on the server's ``PYTHONPATH``; requests enable it with ``vllm_xargs``, ``audio/lm_stream.py``)."""
    env = {"PYTHONPATH": SPEECH_EXT}
    return _spec(config.vllm, config.dtype, lm_path, config.max_model_len(), config.max_batch_size,
                 ["--logits-processors", FRAME_PROCESSOR], env)


def _spec(o: VLLMOptions, dtype: str, path: str, max_model_len: int, max_num_seqs: int, family_args: list[str],
          family_env: dict[str, str]) -> ServerSpec:
    python = vllm_python(o.python)
    args = ["--model", path, "--served-model-name", SERVED_NAME, "--dtype", o.dtype or dtype,
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--tensor-parallel-size", str(o.tensor_parallel_size), "--generation-config", "vllm",
            "--enable-prefix-caching" if o.enable_prefix_caching else "--no-enable-prefix-caching",
            *family_args, "--disable-uvicorn-access-log"]
    if o.enforce_eager:
        args.append("--enforce-eager")
    if o.block_size is not None:
        args += ["--block-size", str(o.block_size)]
    if o.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(o.kv_cache_memory_bytes)]
    if o.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)]
    if o.speculative is not None:
        args += ["--speculative-config", o.speculative.model_dump_json()]
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", **family_env}
    if o.cpu_threads is not None:  # share the host's cores: no pinning, a bounded OpenMP pool
        env.update(OMP_NUM_THREADS=str(o.cpu_threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    if o.quantized is not None and (o.dtype or dtype) == "float32":
        # vLLM 0.32's CPU int8 linear picks its AMX kernel (int8_scaled_mm_with_quant) on AMX CPUs whatever the
        # activations' dtype, and that kernel takes only bf16/fp16: a float32 model dies at its first request
        # ("expect A to be bfloat16 or half"). Float32 cannot use AMX anyway, so the engine is told there is none
        # and runs oneDNN's int8 GEMM, as on every CPU without AMX (engine_site/sitecustomize.py).
        env[NO_AMX_ENV] = "1"
    return ServerSpec(python=python, module=VLLM_MODULE, args=args + list(o.extra_args), env=env,
                      startup_timeout_s=o.startup_timeout_s)


def served_checkpoint(config: VLMConfig | TTSConfig, model_dir: str | Path | None = None) -> str:
    """The folder vLLM serves for ``config``: its LM (``llm`` or ``lm``, relative to ``model_dir``), or the quantized
    checkpoint ``vllm.quantized`` once :func:`core.quant.fidelity.verify_checkpoint` accepts it against that LM
    (its ``fidelity.json`` names the LM's weights; the scheme runs on this host). Raises
    QuantizedCheckpointError (a ValueError) naming the failed check."""
    reference = resolve_path(model_dir, config.lm if isinstance(config, TTSConfig) else config.llm)
    if config.vllm.quantized is None:
        return reference
    import torch

    from core.quant.fidelity import verify_checkpoint

    path = resolve_path(model_dir, config.vllm.quantized)
    verify_checkpoint(path, reference, "cuda" if torch.cuda.is_available() else "cpu")
    return path


def served_speculation(config: VLMConfig | TTSConfig, model_dir: str | Path | None = None) -> Speculation | None:
    """The ``vllm.speculative`` block vLLM gets for ``config``: unchanged for none, n-gram or a ``draft_model`` /
    ``eagle`` draft; for ``eagle3`` the head's folder resolved against ``model_dir`` (like the engine's
    checkpoints) once :func:`core.spec.record.verify_head` accepts it for the LM (its ``speculator.json``, written
    by ``chimera speculator train``, names the LM's own weights: a head trained for other weights would stay
    lossless but propose garbage). The speech LM's config refuses any speculation (:class:`audio.config.TTSConfig`:
    vLLM refuses its frame-constraint logits processor then). For the VLM, whose image prompts vLLM gets as mixed
    prompts (token ids at the text, embeddings at the image: :func:`core.vllm_client.request_body`; an
    embeddings-only prompt would kill the engine, ``vllm/v1/worker/gpu_input_batch.py:78``), an ``eagle3`` head is
    also refused when vLLM's marker id is not a row of the LLM's embedding table
    (:func:`core.vllm_marker.embeds_marker`; SmolLM2-135M, the cpu profile's LLM, has exactly as many rows as
    tokenizer ids) and the head carries no table of its own that has it (:func:`core.vllm_marker.head_embed_rows`):
    the proposer would index past the table, killing the engine. ``chimera speculator train`` writes such a table
    for such an LLM (:func:`core.spec.worker.pad_head_table`). Raises SpeculatorError (a ValueError) naming the
    failed check."""
    s = config.vllm.speculative
    if s is None or s.method != "eagle3":
        return s
    from core.spec.record import SpeculatorError, verify_head

    reference = resolve_path(model_dir, config.lm if isinstance(config, TTSConfig) else config.llm)
    head = resolve_path(model_dir, s.model)
    verify_head(head, reference)
    if isinstance(config, VLMConfig):
        try:
            marker, rows = embeds_marker(reference)
        except (OSError, ValueError) as exc:
            raise SpeculatorError(f"the LLM's tokenizer or config in {reference} cannot be read: {exc}") from None
        own = head_embed_rows(head)  # verify_head has checked it against the head's config
        if marker >= rows and (own is None or own <= marker):
            raise SpeculatorError(EAGLE_MARKER_REFUSAL.format(
                llm=reference, head=head, marker=marker, text=VLLM_EMBEDS_MARKER, rows=rows,
                own="none of its own" if own is None else f"{own}"))
    return s.model_copy(update={"model": head})


def start_vllm_for(config: VLMConfig | TTSConfig, model_dir: str | Path | None = None) -> VLLMClient:
    """Start (not await) the vLLM server for ``config`` (a VLM's LLM or the speech LM, paths relative to
    ``model_dir``) under supervision and return a client of it (``client.server`` is the :class:`ServerProcess`;
    ``client.close()`` stops it; a VLM's client holds the served LLM's tokenizer, for mixed prompts). Raises
    FileNotFoundError when the engine interpreter is missing (run ``make install``); QuantizedCheckpointError for
    a ``vllm.quantized`` checkpoint that must not be served (:func:`served_checkpoint`); SpeculatorError for an
    ``eagle3`` head that must not be served (:func:`served_speculation`)."""
    path = served_checkpoint(config, model_dir)
    config = config.model_copy(update={"vllm": config.vllm.model_copy(
        update={"speculative": served_speculation(config, model_dir)})})
    if isinstance(config, TTSConfig):
        return VLLMClient(ServerProcess(speech_server_spec(config, path)).start())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)  # the server's: mixed prompts are rendered with it
    return VLLMClient(ServerProcess(server_spec(config, path)).start(), tokenizer=tokenizer)
