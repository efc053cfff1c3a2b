"""``chimera speculator``'s worker (``.venv-spec``) on a tiny Llama, and its EAGLE-3 head served by vLLM
(``.venv-vllm``): greedy answers identical with and without speculation (token-id prompts), vLLM's acceptance
counters read, vLLM's refusal of ``logit_bias`` while speculative decoding is on, and vLLM 0.32's engine failure on
a ``prompt_embeds`` request with an EAGLE-3 head (why the VLM profile refuses one for now).

The model: ``tests/tiny_llama.py`` (a 4-layer random Llama with SmolLM2's tokenizer). The head reads layers 1, 2,
3 (the residual stream after each) and trains 30 steps (about a minute with the worker's start-up on 2 cores); what is
checked is losslessness and the plumbing, not the acceptance it reaches.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from core.constants import SERVED_NAME
from core.quant.fidelity import weights_sha256
from core.quant.prompts import PromptSet, write_prompts
from core.spec.acceptance import counters_from_metrics, from_vllm_counters
from core.spec.runner import train_head
from tests.tiny_llama import chat_ids, tiny_llama

TEXTS = {"train": ["What is a cat?", "Name a colour.", "Tell me about rivers.", "What is 2 plus 2?",
                   "Describe the sea.", "Why do dogs bark?"],
         "chat": ["Why is the sky blue?", "Count to three."]}
K = 3
ANSWER = 16


@pytest.fixture(scope="module")
def head(tmp_path_factory, model_dir):
    """A 4-layer Llama saved as fp32 safetensors with SmolLM2's tokenizer, its prompt ids, and an EAGLE-3 head
    trained for it by the worker."""
    from core.smollm2 import smollm2_tokenizer

    root = tmp_path_factory.mktemp("spec")
    tok = smollm2_tokenizer(model_dir)
    tiny_llama(tok).save_pretrained(root / "ref")
    tok.save_pretrained(root / "ref")
    prompts = {name: [chat_ids(tok, t) for t in texts] for name, texts in TEXTS.items()}
    sets = {"train": PromptSet("train", "six text prompts", prompts["train"]),
            "chat": PromptSet("heldout", "two text prompts", prompts["chat"])}
    spec = {"verifier": str(root / "ref"), "prompts": str(write_prompts(root / "prompts.safetensors", sets)),
            "out": str(root / "head"), "layer_ids": [1, 2, 3], "answer_tokens": ANSWER, "draft_vocab": 512,
            "steps": 30, "lr": 3e-3, "ttt_steps": K, "pack_tokens": 512, "batch": 4, "seed": 0, "threads": 2}
    lines: list[str] = []
    record = train_head(spec, root / "spec.json", echo=lines.append)
    return root, record, lines, prompts


def test_worker_writes_a_head_in_speculators_format(head):
    root, record, lines, _ = head
    cfg = json.loads((root / "head" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draft_vocab_size"] == 512 and cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert record["verifier_sha256"] == weights_sha256(root / "ref")
    assert record["num_speculative_tokens"] == K and record["layer_ids"] == [1, 2, 3]
    for name in ("train", "chat"):
        a = record["acceptance"][name]
        assert a["drafts"] > 0 and 1.0 <= a["mean_acceptance_length"] <= 1.0 + K
    assert any(line.startswith("wrote ") for line in lines)


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req, timeout=300).read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode()}


def test_vllm_serves_the_head_losslessly_and_counts_acceptance(head):
    """vLLM with the head (checked by :func:`core.spec.record.verify_head`, on the command line
    :func:`services.engines.vllm_server.server_spec` builds): greedy answers to the held-out token-id prompts equal
    those of the same server without speculation; vLLM's counters record drafts of K tokens; ``logit_bias`` (which
    the VLM sends to ban its image tokens) is refused while speculation is on; and a ``prompt_embeds`` request (the
    form of the VLM's image prompts) kills the engine (vLLM 0.32: ``gpu_input_batch.get_token_id``), which is why
    the profile refuses an EAGLE-3 head for the VLM (:func:`services.engines.vllm_server.served_speculation`)."""
    from core.config import DraftSpeculation, VLLMOptions
    from core.spec.record import verify_head
    from core.vllm_client import VLLMClient, embeds_payload
    from grafting.config import VLMConfig
    from services.engines.process import ServerProcess
    from services.engines.vllm_server import server_spec
    from transformers import AutoModelForCausalLM

    root, _, _, prompts = head
    verify_head(root / "head", root / "ref")
    opts = VLLMOptions(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26, cpu_threads=2,
                       speculative=DraftSpeculation(method="eagle3", model=str(root / "head"),
                                                    num_speculative_tokens=K))
    config = VLMConfig(backend="vllm", llm=str(root / "ref"), max_prompt_tokens=256, max_new_tokens=64,
                       default_max_new_tokens=16, max_batch_size=2, vllm=opts)
    plain = config.model_copy(update={"vllm": opts.model_copy(update={"speculative": None})})
    spec_client = VLLMClient(ServerProcess(server_spec(config, config.llm)).start())
    ref_client = VLLMClient(ServerProcess(server_spec(plain, plain.llm)).start())
    embed = AutoModelForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).get_input_embeddings()
    with torch.no_grad():
        embeds = embeds_payload(embed(prompts["chat"][0]))
    try:
        answers = {}
        for name, c in (("spec", spec_client), ("ref", ref_client)):
            assert c.server.wait_ready(600), c.server.log_tail()
            answers[name] = []
            for p in prompts["chat"]:
                r = _post(c.base_url, {"model": SERVED_NAME, "prompt": p.tolist(), "max_tokens": ANSWER,
                                       "temperature": 0, "return_token_ids": True})
                assert "choices" in r, (name, r)
                answers[name].append(r["choices"][0]["token_ids"])
        metrics = urllib.request.urlopen(f"{spec_client.base_url}/metrics", timeout=30).read().decode()
        refused = _post(spec_client.base_url, {"model": SERVED_NAME, "prompt": prompts["chat"][0].tolist(),
                                               "max_tokens": 2, "temperature": 0, "logit_bias": {"5": -100}})
        plain_embeds = _post(ref_client.base_url, {"model": SERVED_NAME, "prompt_embeds": embeds, "max_tokens": 4,
                                                   "temperature": 0})
        spec_embeds = _post(spec_client.base_url, {"model": SERVED_NAME, "prompt_embeds": embeds, "max_tokens": 4,
                                                   "temperature": 0})
        log = spec_client.server.log_tail(200_000)
    finally:
        spec_client.close()
        ref_client.close()
    assert answers["spec"] == answers["ref"]
    assert all(len(a) > 1 for a in answers["ref"])
    drafts, accepted, per_pos = counters_from_metrics(metrics)
    summary = from_vllm_counters(drafts, accepted, per_pos)
    assert drafts > 0 and len(per_pos) == K and 0 <= accepted <= K * drafts
    assert 1.0 <= summary["mean_acceptance_length"] <= 1.0 + K
    assert refused.get("status") == 400 and "not yet supported with speculative decoding" in refused["error"]
    assert "choices" in plain_embeds, plain_embeds
    assert spec_embeds.get("status") == 500, spec_embeds
    assert "provided via prompt_embeds, and its ID is unknown" in log
