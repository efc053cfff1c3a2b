"""vLLM 0.32's marker token of a mixed prompt and the embedding rows an EAGLE-3 head needs for it: the one home of
that knowledge, read by the VLM's client (:mod:`core.vllm_client`), the server's check of a head
(:func:`services.engines.vllm_server.served_speculation`) and the speculator worker that writes one
(:mod:`core.spec.worker`, in ``.venv-spec``: this module imports nothing beyond the standard library until called,
then ``transformers``).

vLLM adds :data:`VLLM_EMBEDS_MARKER` to the served tokenizer as a special token (``vllm/renderers/hf.py:106``
``_ensure_prompt_embeds_placeholder_token``: the next id, ``len(tokenizer)``, unless the tokenizer has it) and puts
that id at the embeddings positions of a mixed prompt (``vllm/renderers/hf.py:191`` ``_build_mixed_prompt_embeds``).
The target model never embeds it (``vllm/v1/worker/gpu_model_runner.py:3336`` zeroes those ids), but an EAGLE
proposer does (``gpu_model_runner.py:4950-4988`` hands it the scheduled ids as they are;
``vllm/model_executor/models/llama_eagle3.py:259`` ``embed_input_ids``), so the marker id must be a row of the table
the draft embeds with: the target's, which vLLM shares with the draft when the head has no ``embed_tokens`` of its
own or one equal to the target's (``vllm/v1/spec_decode/llm_base_proposer.py:1416-1506``
``_maybe_share_embeddings``), or else the head's own, of ``transformer_layer_config.vocab_size`` rows
(``llama_eagle3.py:192``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# vLLM's own marker of a ``prompt_embeds`` content part in a rendered chat prompt (vllm/renderers/chat_utils.py:106
# ``PROMPT_EMBEDS_PLACEHOLDER_TOKEN``): a text part holding it is refused, so such text is sent as embeddings.
VLLM_EMBEDS_MARKER = "<prompt_embeds>"
ROW_MULTIPLE = 64  # a padded head table is rounded up to this many rows (as released checkpoints pad theirs)
EMBED_KEY = "embed_tokens.weight"  # the head's own table in speculators' checkpoint (saved unless ignored)


def marker_id(tokenizer) -> int:
    """The id vLLM 0.32 gives :data:`VLLM_EMBEDS_MARKER` for ``tokenizer`` (a transformers tokenizer of the served
    LLM): its own id when the vocabulary holds the text, else ``len(tokenizer)`` (the next id, what
    ``tokenizer.add_special_tokens`` gives it)."""
    vocab = tokenizer.get_vocab()
    return vocab[VLLM_EMBEDS_MARKER] if VLLM_EMBEDS_MARKER in vocab else len(tokenizer)


def embeds_marker(llm_path: str | Path) -> tuple[int, int]:
    """``(marker id, embedding rows)`` of the LLM at ``llm_path``: :func:`marker_id` of its tokenizer and the rows
    of its input-embedding table (its text config's ``vocab_size``). The marker needs a row of the table the
    draft embeds with (this module's docstring). Raises OSError or ValueError when the tokenizer or config cannot
    be read."""
    from transformers import AutoConfig, AutoTokenizer

    marker = marker_id(AutoTokenizer.from_pretrained(str(llm_path)))
    rows = AutoConfig.from_pretrained(str(llm_path)).get_text_config().vocab_size
    return marker, int(rows)


def padded_rows(rows: int, marker: int) -> int:
    """Rows of a head's own table for an LLM of ``rows`` embedding rows and vLLM marker id ``marker``: ``rows``
    when the marker is one of them, else ``marker + 1`` rounded up to a multiple of :data:`ROW_MULTIPLE`
    (SmolLM2-135M: 49152 rows, marker 49152 -> 49216)."""
    if marker < rows:
        return rows
    return -(-(marker + 1) // ROW_MULTIPLE) * ROW_MULTIPLE


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a ``.safetensors`` file's JSON header (no tensor is read). Raises ValueError for
    a file too short or a header that is not JSON."""
    with path.open("rb") as f:
        try:
            (n,) = struct.unpack("<Q", f.read(8))
        except struct.error:
            raise ValueError(f"{path} is not a safetensors file") from None
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def head_embed_rows(head_dir: str | Path) -> int | None:
    """Rows of the EAGLE-3 head's own input-embedding table (:data:`EMBED_KEY` in its ``*.safetensors``, shapes
    read from the headers), or None when the head carries none (vLLM then embeds with the target's). A head whose
    table differs in shape from the target's is never shared (``llm_base_proposer.py:1450`` ``torch.equal``), so
    vLLM embeds the draft's ids with it. Raises ValueError when the table's rows differ from the head config's
    ``transformer_layer_config.vocab_size`` (vLLM builds the table from that and could not load it)."""
    head_dir = Path(head_dir)
    rows = None
    for f in sorted(head_dir.glob("*.safetensors")):
        shape = _safetensors_shapes(f).get(EMBED_KEY)
        if shape is not None:
            rows = int(shape[0])
    if rows is None:
        return None
    cfg = json.loads((head_dir / "config.json").read_text())
    declared = (cfg.get("transformer_layer_config") or {}).get("vocab_size")
    if declared != rows:
        raise ValueError(f"{head_dir}: its {EMBED_KEY} has {rows} rows but its config.json's "
                         f"transformer_layer_config.vocab_size is {declared}")
    return rows
