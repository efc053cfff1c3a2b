"""Image prompts with speculative decoding on (issue 28): the VLM's ban of its image placeholder ids, sent to vLLM as
``bad_words`` (``core/vllm_client.request_body``), is accepted together with n-gram speculation on a
``prompt_embeds`` request (vLLM 0.32 refuses the ``logit_bias`` it replaced), never lets a banned id out, and
gives the greedy answer of the in-process client (which bans the ids themselves) with and without speculation.
The same server's ``/metrics`` text is checked against the spec-decode counters the service reads.

The model: the cpu profile's LLM (SmolLM2-135M, fp32; a random tiny Llama never repeats a token in its answer, so
n-gram lookup would never draft), its output rows for the profile's three placeholder tokens set to twice those
of the first three tokens of its unbanned answer: unbanned, its greedy answer contains placeholder ids (checked),
so the ban is what keeps them out.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import generate_latest

from core.llm_client import CompletionRequest
from core.spec.acceptance import counters_from_metrics, from_vllm_counters
from services.api import metrics as metrics_module
from tests.tiny_llama import chat_ids

PLACEHOLDERS = ("<jupyter_start>", "<jupyter_code>", "<jupyter_output>")  # configs/cpu.yaml image_tokens
ANSWER = 40
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _greedy(llm, embeds: torch.Tensor, n: int) -> list[int]:
    """``n`` greedy ids after the ``(T, H)`` prompt embeddings (no cache: the model is tiny)."""
    out: list[int] = []
    x = embeds[None]
    with torch.no_grad():
        for _ in range(n):
            tok = int(llm(inputs_embeds=x).logits[0, -1].argmax())
            out.append(tok)
            x = torch.cat([x, llm.get_input_embeddings()(torch.tensor([[tok]]))], dim=1)
    return out


@pytest.fixture(scope="module")
def banned_model(tmp_path_factory, model_dir):
    """``(folder, llm, tok, banned, embeds)``: the saved model, the model in this process, ``{id: text}`` of the
    placeholders, the ``(T, H)`` embeddings of a chat prompt."""
    from transformers import AutoModelForCausalLM

    from core.smollm2 import SMOLLM2_DIR, smollm2_tokenizer

    root = tmp_path_factory.mktemp("ban")
    tok = smollm2_tokenizer(model_dir)
    llm = AutoModelForCausalLM.from_pretrained(model_dir / SMOLLM2_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        embeds = llm.get_input_embeddings()(chat_ids(tok, "Describe a red ball on a table."))
        first = _greedy(llm, embeds, 3)
        banned = {tok.convert_tokens_to_ids(s): s for s in PLACEHOLDERS}
        w = llm.get_output_embeddings().weight  # tied: the placeholders' input rows too, never in the prompt
        for i, b in enumerate(banned):
            w[b] = 2 * w[first[i]]
    llm.save_pretrained(root / "llm")
    tok.save_pretrained(root / "llm")
    return root / "llm", llm, tok, banned, embeds


def test_placeholder_texts_are_single_tokens_as_vllm_tokenizes_bad_words(banned_model):
    """vLLM turns each ``bad_words`` entry into ids with ``add_special_tokens=False``, and adds its space-prefixed
    form only when that is as many ids as the bare one (``SamplingParams.update_from_tokenizer``): for each
    placeholder the bare text is exactly its id and the prefixed one is two ids, so exactly the id is banned."""
    _, _, tok, banned, _ = banned_model
    for i, s in banned.items():
        assert tok.encode(s, add_special_tokens=False) == [i]
        assert len(tok.encode(" " + s, add_special_tokens=False)) == 2


def test_image_prompt_with_ngram_speculation_keeps_the_ban_and_the_greedy_answer(banned_model):
    """One ``CompletionRequest`` (embeddings prompt, the placeholders banned, greedy) to the in-process client and
    to vLLM with and without n-gram speculation: answered by all three (not refused), the same ids, none banned,
    while the unbanned greedy answer has placeholder ids; the speculating server drafted tokens for it, its
    client's ``spec_decode()`` counters are those of its ``/metrics`` (None for the plain server and the in-process
    client) and fold into the service's per-replica series."""
    from core.config import NgramSpeculation, VLLMOptions
    from core.vllm_client import VLLMClient
    from grafting.config import VLMConfig
    from grafting.local_client import TransformersClient
    from services.engines.process import ServerProcess
    from services.engines.vllm_server import server_spec

    path, llm, tok, banned, embeds = banned_model
    assert set(_greedy(llm, embeds, ANSWER)) & set(banned)
    opts = VLLMOptions(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26, cpu_threads=2,
                       speculative=NgramSpeculation(**NGRAM))
    config = VLMConfig(backend="vllm", llm=str(path), max_prompt_tokens=256, max_new_tokens=64,
                       default_max_new_tokens=16, max_batch_size=2, vllm=opts)
    plain = config.model_copy(update={"vllm": opts.model_copy(update={"speculative": None})})
    clients = {"spec": VLLMClient(ServerProcess(server_spec(config, config.llm)).start()),
               "plain": VLLMClient(ServerProcess(server_spec(plain, plain.llm)).start()),
               "local": TransformersClient(llm, tok, max_batch_size=1)}
    req = CompletionRequest(prompt=embeds, max_tokens=ANSWER, temperature=0.0, banned_tokens=banned)

    async def collect(client):
        ids = []
        async for c in client.stream(req):
            ids += c.token_ids
        return ids

    try:
        for c in clients.values():
            assert c.wait_ready(600), getattr(c, "server", None) and c.server.log_tail()
        answers = {name: asyncio.run(collect(c)) for name, c in clients.items()}
        metrics = asyncio.run(clients["spec"].metrics_text())
        counters = {name: asyncio.run(clients[name].spec_decode()) for name in ("spec", "plain", "local")}
    finally:
        for c in clients.values():
            c.close()
    assert len(answers["local"]) == ANSWER and not set(answers["local"]) & set(banned)
    assert answers["spec"] == answers["plain"] == answers["local"], answers
    drafts, accepted, per_pos = counters_from_metrics(metrics)
    assert drafts > 0 and len(per_pos) == NGRAM["num_speculative_tokens"], metrics
    assert 1.0 <= from_vllm_counters(drafts, accepted, per_pos)["mean_acceptance_length"] <= 4.0
    assert counters["plain"] is None and counters["local"] is None
    spec = counters["spec"]
    assert (spec["drafts"], spec["accepted"], spec["accepted_per_pos"]) == (drafts, accepted, per_pos)
    assert drafts <= spec["draft_tokens"] <= NGRAM["num_speculative_tokens"] * drafts
    metrics_module.observe_vlm_end_event("test-ban", {"spec_decode": {"replica": "r", "counters": spec}})
    exposed = generate_latest(metrics_module.REGISTRY).decode()
    assert f'chimera_vlm_spec_decode_drafts_total{{model="test-ban",replica="r"}} {drafts}' in exposed

