"""``chimera speculator``'s worker (``.venv-spec``) on a tiny Llama, and its EAGLE-3 head served by vLLM
(``.venv-vllm``): greedy answers identical with and without speculation, for token-id prompts and for a VLM image
prompt sent as vLLM's mixed prompt (ids at the text, embeddings at the image: ``core/vllm_client.request_body``),
which also equal the in-process client's and leave the engine serving; vLLM's acceptance counters read; vLLM's
refusal of ``logit_bias`` while speculative decoding is on; and vLLM 0.32's engine failure on an embeddings-only
``prompt_embeds`` request with an EAGLE-3 head (why image prompts are sent mixed).

The model: ``tests/tiny_llama.py`` (a 4-layer random Llama with SmolLM2's tokenizer), its embedding table exactly
the tokenizer's 49152 ids, as SmolLM2-135M's (the cpu profile's LLM): vLLM's mixed-prompt marker id 49152 is no
row of it, so the worker writes the head with its own table of 49216 rows (``core.spec.worker.pad_head_table``,
``core.vllm_marker``), which vLLM keeps apart from the target's and the draft embeds every id with. The head
reads layers 1, 2, 3 (the residual stream after each) and trains 30 steps (about a minute with the worker's
start-up on 2 cores); what is checked is losslessness and the plumbing, not the acceptance it reaches. One server
with the head and one without are shared by the serving tests; the last test kills the first.
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

PLACEHOLDERS = ("<jupyter_start>", "<jupyter_code>", "<jupyter_output>")  # configs/cpu.yaml image_tokens

TEXTS = {"train": ["What is a cat?", "Name a colour.", "Tell me about rivers.", "What is 2 plus 2?",
                   "Describe the sea.", "Why do dogs bark?"],
         "chat": ["Why is the sky blue?", "Count to three."]}
K = 3
ANSWER = 16


@pytest.fixture(scope="module")
def head(tmp_path_factory, model_dir):
    """A 4-layer Llama saved as fp32 safetensors with SmolLM2's tokenizer and as many embedding rows as its ids,
    its prompt ids, and an EAGLE-3 head trained for it by the worker."""
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
    # no row for vLLM's marker id 49152 in the LLM's table: the head carries its own, with one
    assert cfg["transformer_layer_config"]["vocab_size"] == record["embed_rows"] == 49216
    assert any(line.startswith("embedding table: 49216 rows") for line in lines)


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req, timeout=300).read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode()}


@pytest.fixture(scope="module")
def servers(head):
    """``{"spec": client, "ref": client}``: vLLM with the head (accepted for the VLM by
    :func:`services.engines.vllm_server.served_speculation`: its own table has a row for vLLM's marker id; on the
    command line :func:`services.engines.vllm_server.server_spec` builds) and without it, each a
    :class:`core.vllm_client.VLLMClient` holding the model's tokenizer (so image prompts go as mixed prompts),
    ready."""
    from transformers import AutoTokenizer

    from core.config import DraftSpeculation, VLLMOptions
    from core.vllm_client import VLLMClient
    from grafting.config import VLMConfig
    from services.engines.process import ServerProcess
    from services.engines.vllm_server import server_spec, served_speculation

    root = head[0]
    opts = VLLMOptions(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26, cpu_threads=2,
                       speculative=DraftSpeculation(method="eagle3", model=str(root / "head"),
                                                    num_speculative_tokens=K))
    config = VLMConfig(backend="vllm", llm=str(root / "ref"), max_prompt_tokens=256, max_new_tokens=64,
                       default_max_new_tokens=16, max_batch_size=2, vllm=opts)
    assert served_speculation(config) == opts.speculative
    plain = config.model_copy(update={"vllm": opts.model_copy(update={"speculative": None})})
    tok = AutoTokenizer.from_pretrained(root / "ref")
    clients = {"spec": VLLMClient(ServerProcess(server_spec(config, config.llm)).start(), tokenizer=tok),
               "ref": VLLMClient(ServerProcess(server_spec(plain, plain.llm)).start(), tokenizer=tok)}
    try:
        for c in clients.values():
            assert c.server.wait_ready(600), c.server.log_tail()
        yield clients
    finally:
        for c in clients.values():
            c.close()


def test_vllm_serves_the_head_losslessly_and_counts_acceptance(head, servers):
    """Greedy answers to the held-out token-id prompts from the server with the head equal those of the server
    without it; vLLM's counters record drafts of K tokens."""
    prompts = head[3]
    answers = {}
    for name, c in servers.items():
        answers[name] = []
        for p in prompts["chat"]:
            r = _post(c.base_url, {"model": SERVED_NAME, "prompt": p.tolist(), "max_tokens": ANSWER,
                                   "temperature": 0, "return_token_ids": True})
            assert "choices" in r, (name, r)
            answers[name].append(r["choices"][0]["token_ids"])
    metrics = urllib.request.urlopen(f"{servers['spec'].base_url}/metrics", timeout=30).read().decode()
    assert answers["spec"] == answers["ref"]
    assert all(len(a) > 1 for a in answers["ref"])
    drafts, accepted, per_pos = counters_from_metrics(metrics)
    summary = from_vllm_counters(drafts, accepted, per_pos)
    assert drafts > 0 and len(per_pos) == K and 0 <= accepted <= K * drafts
    assert 1.0 <= summary["mean_acceptance_length"] <= 1.0 + K


def test_a_vlm_image_prompt_is_served_with_the_head_as_a_mixed_prompt(head, servers, model_dir):
    """A VLM image prompt as :func:`grafting.llm_stream.completion_request` builds it (the processor's ids for a
    user turn with an image and a question, ``(T, H)`` embeddings: the LLM's rows, seeded random features at the
    image positions; ``prompt_token_ids`` None there; the placeholders banned), greedy: answered by the server
    with the head (as a mixed prompt to ``/v1/chat/completions``, whose prompt ids vLLM returns equal ours at
    every text position: the client checks), the same ids as the server without it and the in-process client;
    the head drafted for it (vLLM's drafts counter moved); both servers answer a token-id prompt afterwards. The
    LLM, like the cpu profile's SmolLM2-135M, has no embedding row for vLLM's marker id; the head's own table has
    (:mod:`core.vllm_marker`)."""
    import asyncio

    from PIL import Image, ImageDraw
    from transformers import AutoModelForCausalLM, AutoTokenizer, Kimi_K25ImageProcessor

    from core.llm_client import CompletionRequest
    from core.smollm2 import SMOLLM2_DIR
    from core.vllm_client import request_body
    from grafting.local_client import TransformersClient
    from grafting.processor import GraftProcessor
    from core.vllm_marker import embeds_marker, head_embed_rows

    root = head[0]
    tok = servers["spec"].tokenizer
    processor = GraftProcessor(tok, Kimi_K25ImageProcessor(size={"max_height": 8, "max_width": 8}), PLACEHOLDERS)
    img = Image.new("RGB", (112, 112), "white")
    ImageDraw.Draw(img).ellipse([62, 6, 110, 54], fill=(215, 40, 40))
    prompt = processor([{"role": "user", "content": [{"type": "image", "image": img},
                                                     {"type": "text", "text": "What colour is the shape?"}]}])
    ids = prompt.input_ids[0].tolist()
    image = processor.image_token_ids.image
    llm = AutoModelForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).eval()
    with torch.no_grad():
        embeds = llm.get_input_embeddings()(prompt.input_ids)[0]
        at_image = prompt.input_ids[0] == image
        features = torch.randn(int(at_image.sum()), embeds.shape[1], generator=torch.Generator().manual_seed(0))
        embeds[at_image] = 0.2 * features
    req = CompletionRequest(prompt=embeds, max_tokens=ANSWER, temperature=0.0, stop_token_ids=[tok.eos_token_id],
                            banned_tokens=processor.image_token_ids.banned(),
                            prompt_token_ids=[None if i == image else i for i in ids])
    body = request_body(req, tokenizer=tok)
    assert [p["type"] for p in body["messages"][0]["content"]] == ["text", "prompt_embeds", "text"]
    assert body["_expected_prompt_ids"] == req.prompt_token_ids  # every text run is sent as text

    async def collect(client, request):
        out = []
        async for c in client.stream(request):
            out += c.token_ids
        return out

    before = asyncio.run(servers["spec"].spec_decode())
    answers = {name: asyncio.run(collect(c, req)) for name, c in servers.items()}
    answers["local"] = asyncio.run(collect(TransformersClient(llm, tok, max_batch_size=1), req))
    after = asyncio.run(servers["spec"].spec_decode())
    again = {name: asyncio.run(collect(c, CompletionRequest(prompt=head[3]["chat"][0].tolist(), max_tokens=4,
                                                              temperature=0.0))) for name, c in servers.items()}
    assert len(answers["local"]) > 1 and not set(answers["local"]) & set(req.banned_tokens)
    assert answers["spec"] == answers["ref"] == answers["local"], answers
    assert after["drafts"] > before["drafts"], (before, after)
    assert all(len(a) == 4 for a in again.values()) and again["spec"] == again["ref"]
    marker, rows = embeds_marker(root / "ref")
    assert marker == len(tok) == rows < head_embed_rows(root / "head")
    assert "Detected EAGLE model with distinct embed_tokens weights" in servers["spec"].server.log_tail(200_000)
    assert embeds_marker(model_dir / SMOLLM2_DIR) == (len(AutoTokenizer.from_pretrained(model_dir / SMOLLM2_DIR)),
                                                      49152)


def test_an_embeddings_only_prompt_kills_the_engine_with_the_head(head, servers):
    """``logit_bias`` (which the VLM no longer sends) is refused while speculation is on; an embeddings-only
    ``prompt_embeds`` request (no token ids at all) is answered without the head and kills the engine with it
    (vLLM 0.32: ``gpu_input_batch.get_token_id``), which is why image prompts go as mixed prompts. Runs last:
    the server with the head is dead afterwards."""
    from transformers import AutoModelForCausalLM

    from core.vllm_client import embeds_payload

    root, prompts = head[0], head[3]
    spec, ref = servers["spec"], servers["ref"]
    embed = AutoModelForCausalLM.from_pretrained(root / "ref", dtype=torch.float32).get_input_embeddings()
    with torch.no_grad():
        embeds = embeds_payload(embed(prompts["chat"][0]))
    refused = _post(spec.base_url, {"model": SERVED_NAME, "prompt": prompts["chat"][0].tolist(), "max_tokens": 2,
                                    "temperature": 0, "logit_bias": {"5": -100}})
    plain_embeds = _post(ref.base_url, {"model": SERVED_NAME, "prompt_embeds": embeds, "max_tokens": 4,
                                        "temperature": 0})
    spec_embeds = _post(spec.base_url, {"model": SERVED_NAME, "prompt_embeds": embeds, "max_tokens": 4,
                                        "temperature": 0})
    log = spec.server.log_tail(200_000)
    assert refused.get("status") == 400 and "not yet supported with speculative decoding" in refused["error"]
    assert "choices" in plain_embeds, plain_embeds
    assert spec_embeds.get("status") == 500, spec_embeds
    assert "provided via prompt_embeds, and its ID is unknown" in log
