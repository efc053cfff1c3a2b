"""Frame-position constraint of Orpheus-layout speech LMs as a vLLM v1 custom logits processor.

Loaded by vLLM's OpenAI server with ``--logits-processors chimera_frame_constraint:FramePositionLogitsProcessor``
(this directory on the server's ``PYTHONPATH``) and enabled per request by ``vllm_xargs`` (``SamplingParams.
extra_args``) key :data:`ARG`, a list of 6 ints ``[audio_start, codebook_size, positions, end_of_speech, offset,
allow_end]``. For such a request, with ``n = offset + len(output_token_ids)`` audio tokens already generated
(``offset``: audio tokens resubmitted in the prompt, a multiple of ``positions``), every logit is set to -inf
except the ``codebook_size`` audio ids of frame position ``p = n % positions`` (ids ``audio_start + p *
codebook_size`` .. ``+ codebook_size``) and, only when ``allow_end`` and ``n`` is a positive multiple of
``positions`` (a frame boundary after at least one frame), ``end_of_speech``. These are exactly the allowed sets of
``audio.generate.AudioPositionLogitsProcessor`` (the transformers reference). Requests without the key are left
alone. vLLM applies it before penalties, temperature and top-p, so a masked id keeps probability 0 and the
sampled distribution is the reference's (repetition penalty, temperature, top-p over the allowed ids).

Imports torch only (and vLLM's base class where vLLM is installed), so the class also runs directly on logits
tensors outside vLLM (the tests do that in the service's venv). Method: vLLM v1 ``LogitsProcessor`` interface
(``vllm/v1/sample/logits_processor/interface.py``), state kept as in vLLM's ``process_dict_updates``.
"""

from __future__ import annotations

import torch

try:  # inside .venv-vllm: vLLM loads only subclasses of its base class
    from vllm.v1.sample.logits_processor import LogitsProcessor as _Base
except ImportError:  # the service's venv has no vLLM: the same class, usable directly on tensors
    _Base = object

ARG = "chimera_audio_frame"


def parse_arg(value) -> tuple[int, int, int, int, int, bool]:
    """Validate the per-request :data:`ARG` value; returns ``(audio_start, codebook_size, positions,
    end_of_speech, offset, allow_end)``. Raises ValueError (vLLM answers it as HTTP 400) when it is not a list of 6
    ints with ``codebook_size, positions > 0``, ``audio_start, end_of_speech, offset >= 0`` and ``offset`` a
    multiple of ``positions``."""
    if not (isinstance(value, list) and len(value) == 6 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                 for v in value)):
        raise ValueError(f"{ARG} must be a list of 6 integers "
                         "[audio_start, codebook_size, positions, end_of_speech, offset, allow_end]")
    start, size, positions, eos, offset, allow_end = value
    if size <= 0 or positions <= 0 or start < 0 or eos < 0 or offset < 0 or offset % positions:
        raise ValueError(f"{ARG}: sizes must be positive, ids and offset non-negative, offset a multiple of "
                         "positions")
    return start, size, positions, eos, offset, bool(allow_end)


class FramePositionLogitsProcessor(_Base):
    """vLLM v1 logits processor of the frame-position constraint (see the module docstring).

    ``apply(logits)``: float ``(batch, vocab)`` logits of the persistent batch, masked in place for the rows of
    constrained requests and returned. ``update_state(batch_update)`` tracks which batch row holds which
    constrained request and a reference to its running output token list."""

    def __init__(self, vllm_config=None, device: torch.device | None = None, is_pin_memory: bool = False):
        self.rows: dict[int, tuple[tuple[int, int, int, int, int, bool], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Reject a malformed :data:`ARG` at the engine boundary (ValueError -> HTTP 400)."""
        extra = getattr(sampling_params, "extra_args", None) or {}
        if ARG in extra:
            parse_arg(extra[ARG])

    def is_argmax_invariant(self) -> bool:
        """False: masking changes the argmax (greedy sampling must see it too)."""
        return False

    def update_state(self, batch_update) -> None:
        """Apply vLLM's batch changes: added rows (index, params, prompt ids, output ids), then removed, then
        moved (one-way or swap), in the order of vLLM's ``process_dict_updates``."""
        if not batch_update:
            return
        for index, params, _prompt, output in batch_update.added:
            extra = getattr(params, "extra_args", None) or {}
            if ARG in extra:
                self.rows[index] = (parse_arg(extra[ARG]), output)
            else:
                self.rows.pop(index, None)
        if not self.rows:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            ea, eb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ea is not None:
                self.rows[b] = ea
            if eb is not None and getattr(direction, "name", "") == "SWAP":
                self.rows[a] = eb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask every constrained row to its allowed ids (module docstring); other rows are untouched."""
        if not self.rows:
            return logits
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        rows = []
        for index, ((start, size, positions, eos, offset, allow_end), output) in self.rows.items():
            if index >= logits.shape[0]:
                continue
            n = offset + len(output)
            lo = start + (n % positions) * size
            keep[index, lo:lo + size] = True
            if allow_end and n > 0 and n % positions == 0:
                keep[index, eos] = True
            rows.append(index)
        if rows:
            r = torch.tensor(rows, device=logits.device)
            logits[r] = logits[r].masked_fill(~keep[r], float("-inf"))
        return logits
