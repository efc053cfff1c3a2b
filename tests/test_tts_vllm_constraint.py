"""The frame-position constraint as a vLLM v1 logits processor, run directly on logits tensors (no vLLM here:
the module imports only torch in this venv; ``tests/test_tts_vllm.py`` runs it inside vLLM).

A scripted stand-in prefers wrong-position ids: its logits put +50 on every id the constraint must forbid (other
frame positions, end_of_speech off a boundary or before the first frame, text ids) and 0 on the allowed ones.
Greedy decoding through the processor must still pick only allowed ids, for batches whose rows vLLM adds,
removes, moves and swaps, with the allowed sets equal to the transformers reference's
(``audio.generate.AudioPositionLogitsProcessor``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from audio.config import TokenLayoutConfig
from audio.generate import AudioPositionLogitsProcessor
from audio.layout import TokenLayout
from audio.vllm_ext.chimera_frame_constraint import ARG, FramePositionLogitsProcessor, parse_arg

LAYOUT = TokenLayout(TokenLayoutConfig(start_of_speech=49153, end_of_speech=49154, start_of_human=49155,
                                       end_of_human=49156, start_of_ai=49157, end_of_ai=49158, pad=49159,
                                       end_of_text=2, audio_start=49162))
VOCAB = LAYOUT.vocab_size_needed + 10
C = LAYOUT.cfg


def arg(offset=0, allow_end=1):
    return [C.audio_start, C.codebook_size, C.positions, C.end_of_speech, offset, allow_end]


def params(extra):
    return SimpleNamespace(extra_args=extra)


def update(batch_size, added=(), removed=(), moved=()):
    return SimpleNamespace(batch_size=batch_size, added=list(added), removed=list(removed), moved=list(moved))


SWAP, ONE_WAY = SimpleNamespace(name="SWAP"), SimpleNamespace(name="UNIDIRECTIONAL")


GEN = torch.Generator().manual_seed(0)


def adversarial_logits(outputs: list[list[int] | None], offsets: list[int]) -> torch.Tensor:
    """(batch, VOCAB) logits: +50 on every id the reference forbids for each row, seeded uniform [0, 1) noise on
    the allowed ones (so picks vary; None rows: 0 everywhere)."""
    logits = torch.rand(len(outputs), VOCAB, generator=GEN)
    for i, out in enumerate(outputs):
        if out is None:
            logits[i] = 0.0
            continue
        prompt_len = 5
        ids = torch.zeros(1, prompt_len + offsets[i] + len(out), dtype=torch.long)
        allowed = AudioPositionLogitsProcessor(LAYOUT, prompt_len)(ids, torch.zeros(1, VOCAB))[0] == 0
        logits[i, ~allowed] = 50.0
    return logits


def reference_allowed(n_generated: int) -> set[int]:
    ids = torch.zeros(1, 3 + n_generated, dtype=torch.long)
    row = AudioPositionLogitsProcessor(LAYOUT, 3)(ids, torch.zeros(1, VOCAB))[0]
    return set(torch.nonzero(row == 0).flatten().tolist())


@pytest.mark.parametrize("n", [0, 1, 6, 7, 8, 13, 14, 21])
def test_allowed_sets_equal_the_reference(n):
    proc = FramePositionLogitsProcessor()
    out = [0] * (n % 7)
    proc.update_state(update(1, added=[(0, params({ARG: arg(offset=n - n % 7)}), [1, 2], out)]))
    row = proc.apply(torch.zeros(1, VOCAB))[0]
    assert set(torch.nonzero(row == 0).flatten().tolist()) == reference_allowed(n)
    assert torch.isinf(row[row != 0]).all() and (row[row != 0] < 0).all()


def test_wrong_position_ids_never_get_through_a_changing_batch():
    """Greedy decoding of 3 constrained requests (and one unconstrained) for 60 steps through adds, a removal, a
    one-way move and a swap: every constrained row's pick is allowed; the unconstrained row is untouched."""
    proc = FramePositionLogitsProcessor()
    outs = {name: [] for name in "abcd"}
    proc.update_state(update(3, added=[(0, params({ARG: arg()}), [1], outs["a"]),
                                       (1, params({"other": 1}), [1], outs["b"]),
                                       (2, params({ARG: arg(offset=7, allow_end=0)}), [1], outs["c"])]))
    where = {0: "a", 1: "b", 2: "c"}
    offsets = {"a": 0, "b": 0, "c": 7, "d": 14}
    for step in range(60):
        if step == 10:
            proc.update_state(update(4, added=[(3, params({ARG: arg(offset=14)}), [1], outs["d"])]))
            where[3] = "d"
        elif step == 20:  # a leaves; d moves into its row
            proc.update_state(update(3, removed=[0], moved=[(3, 0, ONE_WAY)]))
            where = {0: "d", 1: "b", 2: "c"}
        elif step == 30:
            proc.update_state(update(3, moved=[(0, 2, SWAP)]))
            where = {0: "c", 1: "b", 2: "d"}
        else:
            proc.update_state(None)
        rows = [where[i] for i in range(len(where))]
        logits = adversarial_logits([outs[r] if r != "b" else None for r in rows], [offsets[r] for r in rows])
        logits[[i for i, r in enumerate(rows) if r == "b"], 7] = 1.0  # the unconstrained row prefers id 7
        picks = proc.apply(logits).argmax(dim=-1).tolist()
        for i, r in enumerate(rows):
            if r == "b":
                assert picks[i] == 7
                continue
            n = offsets[r] + len(outs[r])
            allowed = reference_allowed(n) - ({C.end_of_speech} if r == "c" else set())
            assert picks[i] in allowed, (step, r, picks[i])
            if picks[i] != C.end_of_speech:
                outs[r].append(picks[i])
    assert len(outs["a"]) == 20 and len(outs["c"]) == 60 and len(outs["d"]) == 50


def test_end_of_speech_only_at_a_boundary_after_the_first_frame():
    proc = FramePositionLogitsProcessor()
    out: list[int] = []
    proc.update_state(update(1, added=[(0, params({ARG: arg()}), [1], out)]))
    seen_end = []
    for n in range(22):
        logits = torch.zeros(1, VOCAB)
        logits[0, C.end_of_speech] = 100.0  # a model that always wants to stop
        pick = int(proc.apply(logits).argmax())
        seen_end.append(pick == C.end_of_speech)
        out.append(LAYOUT.audio_id(n % 7, 0) if pick != C.end_of_speech else LAYOUT.audio_id(n % 7, 1))
    assert [i for i, e in enumerate(seen_end) if e] == [7, 14, 21]


@pytest.mark.parametrize("bad", [None, [1, 2, 3], [C.audio_start, 4096, 7, C.end_of_speech, 3, 1],
                                 [C.audio_start, 0, 7, C.end_of_speech, 0, 1], ["a", 1, 2, 3, 4, 5],
                                 [True, 4096, 7, 1, 0, 1]])
def test_malformed_args_are_refused(bad):
    with pytest.raises(ValueError):
        parse_arg(bad)
    with pytest.raises(ValueError):
        FramePositionLogitsProcessor.validate_params(params({ARG: bad}))
    FramePositionLogitsProcessor.validate_params(params({}))  # requests without the key are fine
