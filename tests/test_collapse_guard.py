"""Text collapse guard (grafting/collapse_guard.py) on a scripted stand-in LLM run through the real decode loop.

The stand-in misbehaves on purpose (the one place a scripted model is allowed): it writes a fixed script, greedy,
but after its "sticky" token it prefers that token again (logit 5.5 against 5.0 for the script's next token), so
without a repetition penalty it collapses into "the the the ...". With CTRL's penalty 1.3 on seen ids the sticky
logit becomes 5.5 / 1.3 = 4.23 < 5.0 and the script goes on: the retry's recovery comes from the real penalty in
``SequenceState``, not from the stand-in looking at its settings. It runs through the real in-process client
(``grafting.local_client.TransformersClient``: batcher, sampling, stop strings, detokenisation) and the real
answer pipeline of ``VLMEngine.stream`` (``grafting.llm_stream.answer``) with the real SmolLM2 tokenizer.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer, RepetitionPenaltyLogitsProcessor

from core.llm_client import CompletionChunk
from grafting.collapse_guard import GuardReport, RunDetector
from grafting.config import CollapseGuardConfig
from grafting.generate import SamplingParams, apply_repetition_penalty
from grafting.llm_stream import answer
from grafting.local_client import TransformersClient
from grafting.model import GraftedVLM, ImageTokenIds
from grafting.processor import Prompt

TABLE = ("| Name | Age |\n|------|-----|\n| Ann | 31 |\n| Bob | 1000000 |\n\n|---|---|\n\n"
         "Wait.......... done    \n\n\n\n    x = 1")


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir / "vlm" / "llm"))


class ScriptedLM(nn.Module):
    """Scripted stand-in causal LM. ``script``: the answer's token ids; ``sticky``: a token it likes to repeat
    (None: never). The next-token logits (vocabulary ``vocab``) follow the answer so far: the script's next id
    gets 5.0; right after ``sticky`` the sticky id gets ``sticky_logit``; past the script (or off it) EOS gets
    5.0. The "KV cache" it returns is just the ids seen so far."""

    def __init__(self, vocab: int, prompt_len: int, script: list[int], eos: int, sticky: int | None = None,
                 sticky_logit: float = 5.5):
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.vocab, self.prompt_len, self.script, self.eos = vocab, prompt_len, script, eos
        self.sticky, self.sticky_logit = sticky, sticky_logit

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def _next(self, ids: list[int]) -> torch.Tensor:
        answer, j, prev = ids[self.prompt_len:], 0, None
        for t in answer:  # follow the script, skipping repeats of the sticky token
            if j < len(self.script) and t == self.script[j]:
                j += 1
            elif not (t == self.sticky and prev == self.sticky):
                j = len(self.script)  # off script: end
            prev = t
        logits = torch.zeros(self.vocab)
        logits[self.script[j] if j < len(self.script) else self.eos] = 5.0
        if self.sticky is not None and prev == self.sticky:
            logits[self.sticky] = self.sticky_logit
        return logits

    def forward(self, input_ids=None, cache=None, use_cache=True, **_):
        ids = list(cache or []) + input_ids[0].tolist()
        return SimpleNamespace(logits=self._next(ids).view(1, 1, -1), cache=ids)


class Setup:
    """The stand-in behind the real client: ``model`` (a GraftedVLM holding only the stand-in LLM), ``client``
    (a TransformersClient of it), ``prompt``, the answer's ``script`` ids, the prompt ``ids``."""

    def __init__(self, tok, answer_text: str, sticky: str | None = None, sticky_logit: float = 5.5):
        ids = tok.apply_chat_template([{"role": "user", "content": "Describe a pet."}], add_generation_prompt=True,
                                      tokenize=True)
        self.ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        self.script = tok(answer_text, add_special_tokens=False).input_ids
        sticky_id = tok(sticky, add_special_tokens=False).input_ids[0] if sticky else None
        lm = ScriptedLM(len(tok), len(self.ids), self.script, tok.eos_token_id, sticky_id, sticky_logit)
        self.model = GraftedVLM(None, None, lm, ImageTokenIds(0, 1, 2, ("<s0>", "<s1>", "<s2>")))
        self.client = TransformersClient(lm, tok, max_batch_size=1)
        self.prompt = Prompt(torch.tensor([self.ids]))


@pytest.fixture
def setup(tok):
    made = []

    def make(*args, **kwargs) -> Setup:
        made.append(Setup(tok, *args, **kwargs))
        return made[-1]
    yield make
    for m in made:
        m.client.close()


def _run(s: Setup, params, config, tok, client=None):
    report = GuardReport()

    async def collect():
        return [d async for d in answer(s.model, client or s.client, tok, s.prompt, params, {tok.eos_token_id},
                                        config, None, report)]

    return asyncio.run(collect()), report


GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


def test_stand_in_collapses_without_the_guard(tok, setup):
    s = setup("The cat sat on the mat.", sticky=" the")
    assert tok.convert_tokens_to_ids("Ġmat") not in s.ids  # unpenalised on the retry: 5.0 beats 5.5 / 1.3
    out, report = _run(s, GREEDY, CollapseGuardConfig(enabled=False), tok)
    text = "".join(d.text for d in out)
    assert text == "The cat sat on" + " the" * 36 and out[-1].finish_reason == "length"
    assert report.collapses == 0


def test_guard_fires_and_the_retry_gives_a_clean_answer(tok, setup):
    s = setup("The cat sat on the mat.", sticky=" the")
    script = s.script
    out, report = _run(s, GREEDY, CollapseGuardConfig(), tok)
    texts = [d.text for d in out]
    assert "".join(texts) == "The cat sat on the mat."
    assert all(" the" not in t for t in texts[5:])  # the repeats were held back, never streamed
    assert out[-1].finish_reason == "stop"
    assert out[-1].completion_tokens == len(script) + 1  # the 7 kept tokens + EOS; the 3 repeats are dropped
    assert [d.token_id for d in out[:-1]] == script
    assert (report.collapses, report.retries, report.cut_short, report.dropped_tokens) == (1, 1, False, 3)


def test_min_run_is_configurable(tok, setup):
    s = setup("The cat sat on the mat.", sticky=" the")
    out, report = _run(s, GREEDY, CollapseGuardConfig(min_run=6), tok)
    assert "".join(d.text for d in out) == "The cat sat on the mat."
    assert (report.collapses, report.dropped_tokens) == (1, 5)


def test_collapsing_again_ends_the_answer_there(tok, setup):
    """A stand-in that repeats even under the raised penalty (sticky logit 50: 50 / 1.3 > 5): one retry, then
    the answer stops before the repeats."""
    s = setup("The cat sat on the mat.", sticky=" the", sticky_logit=50.0)
    out, report = _run(s, GREEDY, CollapseGuardConfig(), tok)
    assert "".join(d.text for d in out) == "The cat sat on the"
    assert out[-1].finish_reason == "stop" and out[-1].completion_tokens == 5
    assert (report.collapses, report.retries, report.cut_short, report.dropped_tokens) == (2, 1, True, 6)
    out0, report0 = _run(s, GREEDY, CollapseGuardConfig(max_retries=0), tok)
    assert "".join(d.text for d in out0) == "The cat sat on the" and (report0.collapses, report0.retries) == (1, 0)


def test_stop_string_across_the_resume_point_is_honoured(tok, setup):
    """" the mat" starts before the rollback point and ends after it: only the guard's own detokeniser over the
    whole kept answer can see it (the resumed attempt sees just " mat.")."""
    s = setup("The cat sat on the mat.", sticky=" the")
    params = SamplingParams(max_new_tokens=40, temperature=0.0, stop=[" the mat"])
    out, report = _run(s, params, CollapseGuardConfig(), tok)
    assert "".join(d.text for d in out) == "The cat sat on" and out[-1].finish_reason == "stop"
    assert report.retries == 1


class SpyClient:
    """The real client, recording each request's (seed, repetition penalty, max tokens, prompt length)."""

    def __init__(self, client):
        self.client, self.seen = client, []

    def stream(self, req):
        self.seen.append((req.seed, req.repetition_penalty, req.max_tokens, len(req.prompt)))
        return self.client.stream(req)


def test_sampled_retry_uses_another_seed_and_a_higher_penalty(tok, setup):
    s = setup("The cat sat on the mat.", sticky=" the")
    spy = SpyClient(s.client)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, seed=7)
    _run(s, params, CollapseGuardConfig(penalty_step=0.5), tok, client=spy)
    seen = spy.seen
    n = s.prompt.num_tokens
    assert seen == [(7, 1.0, 40, n), (8, 1.5, 35, n + 5)]  # resumed after the 5 kept tokens


def test_markdown_table_digits_and_punctuation_runs_never_fire(tok, setup):
    s = setup(TABLE)
    script = s.script
    runs = [sum(1 for _ in g) for _, g in itertools.groupby(script)]
    assert max(runs) >= 6  # the answer really has long runs of one token (the zeros of 1000000)
    params = SamplingParams(max_new_tokens=len(script) + 1, temperature=0.0)
    raw, _ = _run(s, params, CollapseGuardConfig(enabled=False), tok)
    out, report = _run(s, params, CollapseGuardConfig(), tok)
    assert "".join(d.text for d in out) == TABLE and out[-1].finish_reason == "stop" and report.collapses == 0
    # with no collapse the guard passes every event through unchanged
    assert [(d.text, d.token_id, d.finish_reason, d.completion_tokens) for d in out] == \
        [(d.text, d.token_id, d.finish_reason, d.completion_tokens) for d in raw]
    # the exemption is configurable: with nothing exempt, the run of zeros fires
    _, strict = _run(s, params, CollapseGuardConfig(exempt_regex=""), tok)
    assert strict.collapses >= 1


def test_run_detector_exemptions(tok):
    det = RunDetector(CollapseGuardConfig(), lambda i: tok.decode([i]))
    ids = {s: tok(s, add_special_tokens=False).input_ids[0] for s in ("|", "---", "\n", "0", ".", " the", "The")}
    assert all(det.exempt(ids[s]) for s in ("|", "---", "\n", "0", "."))
    assert not det.exempt(ids[" the"]) and not det.exempt(ids["The"])
    assert [det.push(ids[" the"]) for _ in range(3)] == [1, 2, 3]
    assert det.push(ids["|"]) == 0 and det.push(ids[" the"]) == 1


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 3
    seen = torch.tensor([3, 7, 7, 11, 40, 3])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits[None].clone())[0]
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.3), ref)
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_guard_passes_a_real_answer_through_unchanged(profile, model_dir):
    """The real cpu VLM (transformers backend), greedy: ``VLMEngine.stream`` guarded and unguarded give identical
    events."""
    from grafting.engine import VLMEngine

    cfg = profile.vlm.engine.model_copy(update={"backend": "transformers"})
    eng = VLMEngine.from_config(cfg, model_dir)
    prompt = eng.prepare([{"role": "user", "content": "Write a markdown table of two fruits and their colours."}])
    params = eng.sampling_params(max_tokens=48, temperature=0)
    report = GuardReport()

    async def collect(guard):
        return [d async for d in eng.stream(prompt, params, report=report, guard=guard)]

    try:
        raw, out = asyncio.run(collect(False)), asyncio.run(collect(True))
    finally:
        eng.close()
    assert [(d.text, d.token_id, d.finish_reason, d.completion_tokens) for d in out] == \
        [(d.text, d.token_id, d.finish_reason, d.completion_tokens) for d in raw]
    assert report.collapses == 0


class ChunkingClient:
    """The real client's chunks merged three by three, as vLLM sends them with speculative decoding (the ids
    together, the text joined, the last one's finish reason); the usage chunk as it is."""

    def __init__(self, client):
        self.client = client

    async def stream(self, req):
        pending = []

        def merged():
            return CompletionChunk("".join(c.text for c in pending), [t for c in pending for t in c.token_ids],
                                   None, pending[-1].finish_reason)

        async for c in self.client.stream(req):
            if c.completion_tokens is not None:
                if pending:
                    yield merged()
                    pending = []
                yield c
                continue
            pending.append(c)
            if len(pending) == 3 or c.finish_reason is not None:
                yield merged()
                pending = []


def test_multi_token_chunks_never_leak_a_repeat_and_drop_whole(tok, setup):
    """Chunks of several tokens: [The cat sat] [on the the] [the the the]: the second leaves a run open (held),
    the third completes it; both are rolled back whole, the answer resumes after "The cat sat" and the text
    the reader gets is exact."""
    s = setup("The cat sat on the mat.", sticky=" the")
    out, report = _run(s, GREEDY, CollapseGuardConfig(), tok, client=ChunkingClient(s.client))
    texts = [d.text for d in out]
    assert "".join(texts) == "The cat sat on the mat." and report.retries == 1
    assert report.dropped_tokens == 6
    assert all(" the" not in t for t in texts[5:])


def test_a_stop_string_completing_token_is_its_own_delta(tok, setup):
    """The token that completes a stop string is a delta of its own (the text before the stop string), then the
    final event: the same on both backends (vLLM reports that token in its own chunk)."""
    s = setup("The cat sat on the mat.")
    params = SamplingParams(max_new_tokens=40, temperature=0.0, stop=[" sat"])
    out, _ = _run(s, params, CollapseGuardConfig(), tok)
    assert [(d.text, d.token_id is not None, d.finish_reason) for d in out] == \
        [("The", True, None), (" cat", True, None), ("", True, None), ("", False, "stop")]
    assert out[-1].completion_tokens == 3
