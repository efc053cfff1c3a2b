"""Evaluation: likelihood scoring equals the full-sequence log-probability, baselines, sharding, text-only KL."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from tests.graft_fixtures import train_config, write_tiny_graft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    from grafting.train.mcq import synth_items
    from grafting.train.checkpoint import load_graft

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny_eval")
    dirs = write_tiny_graft(root, model_dir)
    vlm, processor = load_graft(train_config(dirs, root / "run").model)
    return vlm, processor, synth_items(dirs["synth"] / "test.jsonl")


def choice_score_tolerance(num_tokens: int, max_abs_logit: float, seq_len: int, score: float) -> float:
    """Bound on |choice_logprobs score - full-sequence score| for the tiny graft in fp32, summed over the
    ``num_tokens`` scored tokens.

    Same function, two reduction orders on any CPU: the scorer runs the prompt once and then all choices as a
    batch on the repeated KV cache; the reference runs each whole sequence at batch 1 (the GEMM kernel's blocking
    differs with the shapes). As in ``tests/test_chat_api.py::logprob_tolerance``: fp32 unit roundoff u = 2**-24;
    a length-n reduction, in any order, carries a relative error of order sqrt(n)*u (Higham & Mary, SIAM J. Sci.
    Comput. 41(5), 2019), and S sequential reductions add in quadrature. Here S = 2 LLM layers x 8 reductions +
    final norm + lm_head, plus the tower (1 layer x 8) and the projector (2) = 28, each of length n <= max(hidden
    128 of the MLP, ``seq_len`` keys): logit error <= sqrt(S*n)*u*M with M the largest |logit| at the scored
    positions; a logprob moves by at most twice that (log_softmax's logsumexp moves by at most max|dz|), plus
    sqrt(V)*u per side for the logsumexp's own sum over V = 49152. The score adds ``num_tokens`` such logprobs,
    and those additions round by at most num_tokens*u*|score| per side. On this prompt (4 scored tokens, 59-token
    sequences, M about 8) the bound is 3.5e-4; measured differences are at most 3.8e-6 (one ulp of the score)."""
    u, S, V = 2.0**-24, 28, 49152
    n = max(128, seq_len)
    per_token = 2 * math.sqrt(S * n) * u * max_abs_logit + 2 * math.sqrt(V) * u
    return num_tokens * per_token + 2 * num_tokens * u * abs(score)


def test_choice_scores_equal_full_sequence_logprobs(tiny):
    from grafting.train.evaluate import choice_logprobs

    vlm, proc, items = tiny
    it = next(i for i in items if i.question_type == "position")  # multi-token choices ("Top left.")
    msgs = [{"role": "user", "content": [{"type": "image", "image": Image.open(it.images[0]).convert("RGB")},
                                         {"type": "text", "text": it.question}]}]
    got = choice_logprobs(vlm, proc, msgs, it.choices)
    n = proc(msgs).num_tokens
    for k, c in enumerate(it.choices):
        full = proc(msgs + [{"role": "assistant", "content": c}], add_generation_prompt=False)
        with torch.no_grad():
            lp = vlm(full.input_ids, pixel_values=full.pixel_values, image_grid_thw=full.image_grid_thw).logits[0]
        toks = full.input_ids[0, n:].tolist()[:-1]  # reply tokens + <|im_end|>, without the trailing newline
        assert proc.tokenizer.decode(toks).endswith("<|im_end|>")
        max_logit = float(lp[n - 1: n - 1 + len(toks)].abs().max())
        lp = lp.float().log_softmax(-1)
        ref = sum(lp[n - 1 + j, t] for j, t in enumerate(toks))
        tol = choice_score_tolerance(len(toks), max_logit, full.num_tokens, float(ref))
        assert abs(float(got[k]) - float(ref)) <= tol, (float(got[k]), float(ref), tol)


def test_blind_shuffled_and_sharded_predictions(tiny):
    from grafting.train.evaluate import choice_logprobs, derangement, predict, summarize

    vlm, proc, items = tiny
    items = items[:12]  # 4-5 questions per image
    blind = predict(vlm, proc, items, "blind")
    for i, it in enumerate(items):  # blind = the LLM alone on the question
        lp = choice_logprobs(vlm, proc, [{"role": "user", "content": it.question}], it.choices)
        assert blind[i] == int(lp.argmax())
    order = derangement(items, seed=0)
    assert sorted(order) == list(range(12)) and all(items[o].images != items[i].images for i, o in enumerate(order))
    shuffled = predict(vlm, proc, items, "shuffled")
    halves = {**predict(vlm, proc, items, "shuffled", shard=(0, 2)), **predict(vlm, proc, items, "shuffled", shard=(1, 2))}
    assert halves == shuffled
    s = summarize(items, shuffled, "shuffled")
    assert s["n"] == 12 and sum(s["by_type_n"].values()) == 12
    assert s["accuracy"] == pytest.approx(sum(shuffled[i] == it.answer_index for i, it in enumerate(items)) / 12)
    with pytest.raises(ValueError, match="condition"):
        predict(vlm, proc, items, "nope")
    with pytest.raises(ValueError, match="at least 2"):
        predict(vlm, proc, items[:1], "shuffled")
    with pytest.raises(ValueError, match="at most half"):
        derangement(items[:3])  # three questions about one image


def test_text_only_kl_is_exactly_zero_for_the_cpu_graft(profile, model_dir):
    from transformers import AutoModelForCausalLM

    from grafting.engine import VLMEngine
    from grafting.train.evaluate import TEXT_PROMPTS, text_kl

    torch.set_num_threads(1)
    eng = VLMEngine.from_config(profile.vlm.engine, model_dir)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir / profile.vlm.engine.llm), dtype=torch.float32).eval()
    vals = text_kl(eng.model, base, eng.processor)
    assert len(vals) == len(TEXT_PROMPTS) >= 20
    assert all(v == 0.0 for v in vals)
