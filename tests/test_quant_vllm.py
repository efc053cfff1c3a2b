"""``chimera quantize``'s worker (``.venv-quant``) on a tiny Llama, and its checkpoint served by vLLM (``.venv-vllm``):
save -> load across the two environments, with the served log-probabilities equal to what the worker measured.

The model: a 2-layer Llama (hidden 128, head_dim 64: vLLM's CPU attention has no kernel for 16) with SmolLM2's tokenizer and random weights of standard deviation 0.2, so
its logits are large enough (|logit| of several units) that int8 rounding moves them measurably. The worker runs
the greedy search to half of its 8 units with every method compared at 0.5.

Log-probability tolerance (derived): the worker's fake quantization (:func:`core.quant.worker.int8_per_token`,
vLLM's activation numerics) and vLLM's oneDNN int8 kernel multiply the same int8 weights and int8 activations;
the products summed in int32 are exact in vLLM and in fp32 differ by about sqrt(K) * u relative (K <= 256,
u = 6e-8: 1e-6), which over 2 layers and |logits| under 10 moves a log-probability by well under 1e-3; an
activation within that of a rounding boundary may round to the neighbouring int8 level (one of K products moved
by one step, 1/127 of the row's largest input): rare at a 1e-6 distance, it would add up to about 1/127 /
sqrt(K) = 5e-4 relative. LOGPROB_TOL = 5e-3 nats. Measured: 1e-4 (compressed-tensors' own fake quantization,
which scales by max/127.5, is 0.07 away). The quantized checkpoint must also differ from the reference by more
than that somewhere (so the check tells the two apart), which the 0.2-scale weights ensure (0.05 measured).
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from core.constants import SERVED_NAME
from core.quant.fidelity import weights_sha256
from core.quant.prompts import PromptSet, write_prompts
from core.quant.runner import run_worker
from core.quant.units import UNIT_KINDS

LOGPROB_TOL = 5e-3
TEXTS = {"search": ["What is a cat?", "Name a colour."], "chat": ["Why is the sky blue?", "Count to three."]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    """A 2-layer Llama saved as fp32 safetensors with SmolLM2's tokenizer, and the token-id prompt file."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from core.smollm2 import smollm2_tokenizer

    root = tmp_path_factory.mktemp("quant")
    tok = smollm2_tokenizer(model_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "ref")
    tok.save_pretrained(root / "ref")

    def ids(text):
        r = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return torch.tensor(r["input_ids"] if isinstance(r, dict) or hasattr(r, "keys") else r, dtype=torch.int64)
    sets = {"search": PromptSet("search", "two text prompts", [ids(t) for t in TEXTS["search"]]),
            "chat": PromptSet("heldout", "two text prompts", [ids(t) for t in TEXTS["chat"]])}
    return root, write_prompts(root / "prompts.safetensors", sets)


@pytest.fixture(scope="module")
def quantized(tiny):
    root, prompts = tiny
    spec = {"model_dir": str(root / "ref"), "prompts": str(prompts), "out": str(root / "w8a8"),
            "scheme": "w8a8-int8", "select": "greedy", "fraction": 0.5, "seed": 0, "shortlist": None,
            "answer_tokens": 8, "compare_fractions": [0.5], "family": "vlm", "device": "cpu", "threads": 2}
    lines = []
    record = run_worker(spec, root / "spec.json", echo=lines.append)
    return root, record, lines


def test_worker_writes_a_compressed_checkpoint_and_its_fidelity(quantized):
    root, record, lines = quantized
    assert record["units_total"] == 8 and len(record["quantized_units"]) == 4
    assert record["reference"]["sha256"] == weights_sha256(root / "ref")
    cfg = json.loads((root / "w8a8" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    assert set(cfg["ignore"]) == set(record["ignore"])
    kind = {rest: k for k, rests in UNIT_KINDS.items() for rest in rests}
    left = {f"{m.split('.')[2]}.{kind[m.split('.', 3)[3]]}" for m in record["ignore"] if m != "lm_head"}
    assert left.isdisjoint(record["quantized_units"]) and len(left) == 4  # the 4 units not chosen, all of them
    rows = {(r["select"], r["fraction"]): r for r in record["compare"]}
    assert set(rows) == {("none", 0.0), ("all", 1.0), ("sensitivity", 0.5), ("greedy", 0.5), ("random", 0.5)}
    # nothing quantized is the reference, bit for bit: the toggles restore its weights and skip all quantization
    assert rows[("none", 0.0)]["heldout"]["all"]["kld_mean"] == 0.0
    assert rows[("all", 1.0)]["heldout"]["all"]["kld_mean"] > 0.0
    assert rows[("greedy", 0.5)]["search_kl"] == pytest.approx(record["search_kl"])
    assert record["heldout"]["chat"]["n"] == record["heldout"]["all"]["n"] > 0
    assert any(line.startswith("wrote ") for line in lines)


def _reference_logprobs(model_dir, prompt_ids: list[int], answer_ids: list[int]) -> list[float]:
    """Log-probabilities of ``answer_ids`` after ``prompt_ids`` under the fp32 reference model in this process
    (transformers), one per answer id, in nats."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids)
    return [float(logp[start - 1 + j, t]) for j, t in enumerate(answer_ids)]


def test_vllm_serves_the_checkpoint_as_measured(quantized):
    """vLLM's ``prompt_logprobs`` of the probe (a held-out prompt and its reference answer) under the served
    checkpoint equal the worker's fake-quantized ones within LOGPROB_TOL, and the reference model's (fp32, in
    this process) differ from them by more: the check tells a quantized checkpoint from a full-precision one
    (vLLM serving fp32 equals transformers to 2e-3 nats: tests/test_vlm_vllm.py)."""
    from core.config import VLLMOptions
    from grafting.config import VLMConfig
    from services.engines.vllm_server import start_vllm_for

    root, record, _ = quantized
    probe = record["probe"]
    opts = VLLMOptions(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 26, cpu_threads=2,
                       quantized=str(root / "w8a8"))
    config = VLMConfig(backend="vllm", llm=str(root / "ref"), max_prompt_tokens=256, max_new_tokens=64,
                       default_max_new_tokens=16, max_batch_size=2, vllm=opts)
    client = start_vllm_for(config)
    try:
        assert client.server.wait_ready(600), client.server.log_tail()
        sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none")
        r = sdk.completions.create(model=SERVED_NAME, prompt=probe["prompt_ids"] + probe["answer_ids"],
                                   max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    finally:
        client.close()
    plp, start = r.choices[0].prompt_logprobs, len(probe["prompt_ids"])
    served = [plp[start + j][str(t)]["logprob"] for j, t in enumerate(probe["answer_ids"])]
    worst = max(abs(a - b) for a, b in zip(served, probe["logp_q"]))
    assert worst < LOGPROB_TOL, (served, probe["logp_q"])
    ref = _reference_logprobs(root / "ref", probe["prompt_ids"], probe["answer_ids"])
    apart = max(abs(a - b) for a, b in zip(ref, probe["logp_q"]))
    assert apart > LOGPROB_TOL, (ref, probe["logp_q"])


def test_cpu_profile_serves_a_quantized_smollm2(profile, model_dir, tmp_path_factory):
    """``chimera quantize --select all`` on the cpu profile's own SmolLM2 (small prompt sets: 2 held-out scenes, 1
    search scene, 4-token answers), then the cpu profile's VLM deployment with ``vllm.quantized`` set answers a
    text and an image question through the openai SDK (the same API as full precision), and ``chimera quantize
    report`` lists the checkpoint's fidelity."""
    import asyncio
    import random

    import httpx
    from typer.testing import CliRunner

    from grafting.train.synth import render, sample_scene
    from services.api.app import build_app
    from services.cli import app
    from services.config.profiles import parse_profile
    from services.deployments.backends import LocalBackend
    from services.deployments.vlm import Deployment
    from tests.conftest import data_url

    out = tmp_path_factory.mktemp("smollm2") / "llm-w8a8-int8-all"
    r = CliRunner().invoke(app, ["quantize", "--select", "all", "--scene-prompts", "2", "--search-prompts", "1",
                                 "--answer-tokens", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "| all | 1 | 120/120 |" in r.output
    rep = CliRunner().invoke(app, ["quantize", "report", str(out)])
    assert rep.exit_code == 0 and "Same top p:" in rep.output and "### chat" in rep.output, rep.output

    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    data["vlm"]["engine"]["vllm"]["quantized"] = str(out)
    prof = parse_profile(data)
    dep = Deployment(data["vlm"], str(model_dir))
    try:
        assert dep.engine.wait_ready(600), dep.server.log_tail()
        image = render(sample_scene(random.Random(3), "test"), "test")

        async def ask():
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(prof, {"vlm": LocalBackend(dep)})),
                                     base_url="http://test", timeout=600)
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
            try:
                text = await client.chat.completions.create(
                    model="chimera-vlm", messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=8, temperature=0)
                img = await client.chat.completions.create(model="chimera-vlm", max_tokens=8, temperature=0, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                 {"type": "text", "text": "What colour is the shape?"}]}])
                return text, img
            finally:
                await client.close()
        text, img = asyncio.run(ask())
    finally:
        dep.engine.close()
    assert text.usage.completion_tokens >= 1 and text.choices[0].message.content
    assert img.usage.completion_tokens >= 1 and img.choices[0].message.content
    assert img.usage.prompt_tokens > text.usage.prompt_tokens  # the image's tokens went in


def test_speech_lm_quantized_and_served_as_measured(profile, model_dir, tmp_path_factory):
    """``chimera quantize --family tts`` on the cpu profile's speech LM (2 layers, 8 units: greedy to half, every
    method compared at 0.5; statistics over the audio ids), then vLLM serving it (``tts.engine.vllm.quantized``)
    reproduces the worker's log-probabilities of the probe utterance's audio ids within LOGPROB_TOL."""
    from typer.testing import CliRunner

    from audio.config import TTSConfig
    from services.cli import app
    from services.engines.vllm_server import start_vllm_for

    out = tmp_path_factory.mktemp("speech") / "lm-w8a8"
    r = CliRunner().invoke(app, ["quantize", "--family", "tts", "--select", "greedy", "--fraction", "0.5",
                                 "--compare", "0.5", "--search-prompts", "2", "--answer-tokens", "14",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    record = json.loads((out / "fidelity.json").read_text())
    layout = profile.tts.engine.layout
    audio_end = layout.audio_start + layout.positions * layout.codebook_size
    assert record["family"] == "tts" and record["score_vocab"] == [layout.audio_start, audio_end]
    assert len(record["quantized_units"]) == 4 and record["heldout"]["speech"]["n"] == 24 * 14
    probe = record["probe"]
    assert all(layout.audio_start <= t < audio_end for t in probe["answer_ids"])

    data = profile.tts.engine.model_dump(mode="json")
    data.update(backend="vllm")
    data["vllm"].update(quantized=str(out), kv_cache_memory_bytes=1 << 26)
    client = start_vllm_for(TTSConfig(**data), model_dir)
    try:
        assert client.server.wait_ready(600), client.server.log_tail()
        sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none")
        res = sdk.completions.create(model=SERVED_NAME, prompt=probe["prompt_ids"] + probe["answer_ids"],
                                     max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    finally:
        client.close()
    plp, start = res.choices[0].prompt_logprobs, len(probe["prompt_ids"])
    got = [plp[start + j][str(t)]["logprob"] for j, t in enumerate(probe["answer_ids"])]
    assert max(abs(a - b) for a, b in zip(got, probe["logp_q"])) < LOGPROB_TOL, (got, probe["logp_q"])
