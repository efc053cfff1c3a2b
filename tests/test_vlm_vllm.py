"""The VLM's ``vllm`` backend against the ``transformers`` reference, both through HTTP with the openai SDK.

Three VLM deployments of the cpu profile run in this process (no Ray, so no e2e lock): one with ``backend: vllm``
(the cpu profile's own: vLLM's server in .venv-vllm, fp32, eager), one with ``backend: transformers``, and one on
vLLM with n-gram speculation (its server starts beside the first, for the speculation test). Each sits
behind the real ingress app (``services.api.app.build_app``) driven over ``httpx.ASGITransport`` by
``openai.AsyncOpenAI``. Greedy fp32 answers must agree token for token, with and without images, streamed and
not; logprobs agree within :data:`LOGPROB_TOL`; structured outputs always parse and match their schema.

Logprob tolerance (derived, then checked against what is measured): both engines compute in fp32 (unit roundoff
u = 2**-24 = 6e-8) but with different kernels, so sums are ordered differently. A K-term dot product then differs
by about sqrt(K) * u relative (rounding errors add like a random walk): K = 1536 (SmolLM2's MLP width) gives
2.3e-6 per sub-layer; 30 layers x 2 sub-layers add up, again like a random walk, to sqrt(60) * 2.3e-6 = 1.8e-5
relative on the final hidden state; SmolLM2's logits are below 40 in magnitude, so a logit moves by at most
about 40 * 1.8e-5 = 7e-4, and a log-probability (logit minus logsumexp, both moved) by twice that: 1.4e-3.
LOGPROB_TOL = 2e-3 nats (0.2% in probability). Measured: at most 7.1e-5 (444 tokens of 24 prompts, top-20 alternatives
included, bench/vllm_kl.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random

import httpx
import jsonschema
import openai
import pytest

from grafting.train.synth import render, sample_scene
from services.api.app import build_app
from services.deployments.backends import LocalBackend
from services.deployments.vlm import Deployment
from services.config.profiles import parse_profile
from tests.conftest import data_url

LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def vlm_profile(profile):
    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    return parse_profile(data)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def servers(vlm_profile, model_dir):
    """The module's three VLM deployments of the cpu profile's VLM section: ``vllm`` (as shipped), ``transformers``
    (the reference) and ``ngram`` (vLLM with n-gram speculation, :data:`NGRAM`). Both vLLM servers start at once
    (constructing a deployment starts its server; waiting is up to the fixtures below), so the second start overlaps
    the first instead of following it."""
    section = vlm_profile.vlm.model_dump(mode="json")
    assert section["engine"]["backend"] == "vllm"  # what the cpu profile serves with
    ref, spec = copy.deepcopy(section), copy.deepcopy(section)
    ref["engine"]["backend"] = "transformers"
    spec["engine"]["vllm"]["speculative"] = NGRAM
    deps = {"vllm": Deployment(section, str(model_dir)), "ngram": Deployment(spec, str(model_dir)),
            "transformers": Deployment(ref, str(model_dir))}
    yield deps
    deps["vllm"].engine.close()
    deps["ngram"].engine.close()


@pytest.fixture(scope="module")
def deployments(servers):
    """``{"vllm": Deployment, "transformers": Deployment}``, vLLM's server ready."""
    assert servers["vllm"].engine.wait_ready(600), servers["vllm"].server.log_tail()
    return {"vllm": servers["vllm"], "transformers": servers["transformers"]}


def run(deployments, vlm_profile, fn):
    """Run ``await fn(clients)`` with an ``openai.AsyncOpenAI`` per backend, each over the ingress app."""
    async def main():
        clients = {}
        for name, dep in deployments.items():
            app = build_app(vlm_profile, {"vlm": LocalBackend(dep)})
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=600)
            clients[name] = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http,
                                               max_retries=0)
        try:
            return await fn(clients)
        finally:
            for c in clients.values():
                await c.close()
    return asyncio.run(main())


def image_part(img) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(img)}}


def shape_image(seed: int):
    return render(sample_scene(random.Random(seed), "test"), "test")


def conversations(astronaut) -> dict[str, list[dict]]:
    return {
        "capital": [{"role": "user", "content": "What is the capital of France?"}],
        "animal": [{"role": "user", "content": "Name a large animal."}],
        "system+multi-turn": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "List three colours."},
            {"role": "assistant", "content": "Red, green, blue."},
            {"role": "user", "content": "And two more?"}],
        "photo": [{"role": "user", "content": [image_part(astronaut), {"type": "text", "text": "Describe this."}]}],
        "shape colour": [{"role": "user", "content": [image_part(shape_image(7)),
                                                      {"type": "text", "text": "What colour is the shape?"}]}],
        "two images, two turns": [
            {"role": "user", "content": [image_part(shape_image(1)), {"type": "text", "text": "What shape is shown?"}]},
            {"role": "assistant", "content": "Circle."},
            {"role": "user", "content": [image_part(shape_image(2)), {"type": "text", "text": "And here?"}]}],
    }


async def answer(client, messages, stream: bool, **kw) -> dict:
    """One greedy answer as plain data: text, finish reason, usage, per-token (token, logprob, top)."""
    kw = dict(model="chimera-vlm", messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5,
              **kw)
    if not stream:
        r = await client.chat.completions.create(**kw)
        c = r.choices[0]
        toks = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in c.logprobs.content]
        return {"text": c.message.content, "finish": c.finish_reason, "tokens": toks,
                "usage": (r.usage.prompt_tokens, r.usage.completion_tokens)}
    text, finish, toks, usage = "", None, [], None
    async for ch in await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = (ch.usage.prompt_tokens, ch.usage.completion_tokens)
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            for t in (c.logprobs.content if c.logprobs else None) or []:
                toks.append((t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]))
    return {"text": text, "finish": finish, "tokens": toks, "usage": usage}


def assert_same_answer(got: dict, ref: dict, name: str) -> None:
    """Token for token equal; logprobs within LOGPROB_TOL; the top-5 lists equal up to swaps of alternatives
    whose reference logprobs are within 2 * LOGPROB_TOL of each other (a near tie may order either way)."""
    assert got["text"] == ref["text"], name
    assert got["finish"] == ref["finish"] and got["usage"] == ref["usage"], name
    assert [t[0] for t in got["tokens"]] == [t[0] for t in ref["tokens"]], name
    for (tok, lp, top), (_, ref_lp, ref_top) in zip(got["tokens"], ref["tokens"]):
        assert abs(lp - ref_lp) <= LOGPROB_TOL, (name, tok, lp, ref_lp)
        assert len(top) == len(ref_top) == 5, name
        ref_of = dict(ref_top)
        for j, ((t, v), (rt, rv)) in enumerate(zip(top, ref_top)):
            assert abs(v - rv) <= LOGPROB_TOL, (name, tok, j, v, rv)
            if t != rt:
                assert t in ref_of and abs(ref_of[t] - rv) <= 2 * LOGPROB_TOL, (name, tok, j, t, rt)


def test_cpu_profile_serves_with_vllm(vlm_profile):
    e = vlm_profile.vlm.engine
    assert e.backend == "vllm" and e.vllm.python == ".venv-vllm/bin/python"
    assert e.dtype == "float32" and e.vllm.dtype == "float32" and e.vllm.enforce_eager


def test_prepare_writes_an_llm_config_vllm_accepts(model_dir, tmp_path):
    """vLLM refuses the GGUF ``quantization_config`` transformers copies into the saved config; prepare drops it
    (the weights are plain fp32 safetensors) and cleans folders prepared before, leaving every other key."""
    from core.smollm2 import clean_llm_config

    cfg = json.loads((model_dir / "vlm" / "llm" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    old = dict(cfg, quantization_config={"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False})
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert clean_llm_config(tmp_path) is True
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    assert clean_llm_config(tmp_path) is False  # idempotent


def test_a_vllm_server_that_cannot_start_fails_the_replica_health_check(vlm_profile, model_dir):
    """An engine interpreter without vLLM (this venv's own python) exits at every start: the supervisor gives up,
    readiness stays False, and Ray's health check fails so that Ray replaces the replica."""
    import sys

    section = copy.deepcopy(vlm_profile.vlm.model_dump(mode="json"))
    section["engine"]["vllm"]["python"] = sys.executable
    dep = Deployment(section, str(model_dir))
    try:
        dep.check_health()  # starting: healthy
        assert not dep.engine.wait_ready(120) and dep.server.state == "failed"
        assert not asyncio.run(dep.ready())
        with pytest.raises(RuntimeError, match="the vLLM server failed: engine process exited with code 1; gave up"):
            dep.check_health()
    finally:
        dep.engine.close()


def test_greedy_answers_equal_transformers_token_for_token(deployments, vlm_profile, astronaut):
    convs = conversations(astronaut)

    async def go(clients):
        out = {}
        for name, msgs in convs.items():
            for stream in (False, True):
                out[name, stream] = [await answer(clients[b], msgs, stream) for b in ("vllm", "transformers")]
        return out

    results = run(deployments, vlm_profile, go)
    for (name, stream), (got, ref) in results.items():
        assert ref["tokens"] and ref["usage"][1] >= 1, name
        assert_same_answer(got, ref, f"{name} stream={stream}")
    for name in convs:  # streamed == not streamed, per backend
        assert results[name, True][0]["text"] == results[name, False][0]["text"]
    assert results["photo", False][0]["usage"][0] > 64  # the image's 64 tokens are in the prompt


def test_seeded_sampling_is_reproducible_and_stop_strings_end_the_answer(deployments, vlm_profile):
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]

    async def go(clients):
        c = clients["vllm"]
        a = await c.chat.completions.create(model="chimera-vlm", messages=msgs, max_tokens=16, seed=3, temperature=1)
        b = await c.chat.completions.create(model="chimera-vlm", messages=msgs, max_tokens=16, seed=3, temperature=1)
        q = [{"role": "user", "content": "What is the capital of France?"}]
        s = await c.chat.completions.create(model="chimera-vlm", messages=q, max_tokens=20, temperature=0,
                                            stop=["Paris"])
        return a, b, s

    a, b, s = run(deployments, vlm_profile, go)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert s.choices[0].message.content == "The capital of France is " and s.choices[0].finish_reason == "stop"


SCHEMAS = {
    "animal": {"type": "object", "additionalProperties": False, "required": ["animal", "legs"],
               "properties": {"animal": {"type": "string", "minLength": 1, "maxLength": 20},
                              "legs": {"type": "integer", "minimum": 0, "maximum": 100}}},
    "colour": {"type": "object", "additionalProperties": False, "required": ["colour", "confident"],
               "properties": {"colour": {"enum": ["red", "green", "blue", "yellow"]}, "confident": {"type": "boolean"}}},
    "list": {"type": "object", "additionalProperties": False, "required": ["items"],
             "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": {"type": "string", "minLength": 1, "maxLength": 12}}}},
    "city": {"type": "object", "additionalProperties": False, "required": ["city"],
             "properties": {"city": {"type": "object", "additionalProperties": False, "required": ["name", "big"],
                                     "properties": {"name": {"type": "string", "maxLength": 30},
                                                    "big": {"type": "boolean"}}}}},
}


def test_structured_outputs_always_parse_and_match_the_schema(deployments, vlm_profile):
    prompts = [
        [{"role": "user", "content": "Describe a dog."}],
        [{"role": "user", "content": "Answer in JSON: what is the capital of Italy?"}],
        [{"role": "user", "content": [image_part(shape_image(5)), {"type": "text", "text": "What is shown?"}]}],
    ]
    cases = [(name, p, stream, temp) for name in SCHEMAS for p in prompts for stream, temp in ((False, 0), (True, 1))]

    async def one(client, name, msgs, stream, temp):
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        kw = dict(model="chimera-vlm", messages=msgs, max_tokens=160, temperature=temp, seed=11, response_format=rf)
        if not stream:
            r = await client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, finish = "", None
        async for ch in await client.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                text, finish = text + (c.delta.content or ""), c.finish_reason or finish
        return text, finish

    async def go(clients):
        # all at once: vLLM batches them (each request's grammar constrains only its own rows)
        outs = await asyncio.gather(*(one(clients["vllm"], *case) for case in cases))

        async def json_object(msgs):
            r = await clients["vllm"].chat.completions.create(
                model="chimera-vlm", messages=msgs, max_tokens=160, temperature=0,
                response_format={"type": "json_object"})
            return r.choices[0].message.content, r.choices[0].finish_reason

        return outs, await asyncio.gather(*(json_object(m) for m in prompts))

    outs, objs = run(deployments, vlm_profile, go)
    for (name, _, stream, _), (text, finish) in zip(cases, outs):
        assert finish == "stop", (name, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    for text, finish in objs:
        assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_response_format_errors(deployments, vlm_profile):
    msgs = [{"role": "user", "content": "hi"}]
    bad = {
        "unknown type": ({"type": "xml"}, "invalid_value"),
        "json_schema without schema": ({"type": "json_schema", "json_schema": {"name": "x"}}, "invalid_value"),
        "extra key": ({"type": "json_object", "schema": {}}, "invalid_value"),
        "strict not a boolean": ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
                                 "invalid_value"),
        "a schema the grammar compiler refuses": (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "string", "pattern": "(("}}}}}, "invalid_value"),
    }

    async def status(client, rf):
        try:
            await client.chat.completions.create(model="chimera-vlm", messages=msgs, max_tokens=4, response_format=rf)
        except openai.APIStatusError as err:
            return err.status_code, err.response.json()["error"]
        return 200, None

    async def go(clients):
        out = {name: await status(clients["vllm"], rf) for name, (rf, _) in bad.items()}
        out["transformers json_object"] = await status(clients["transformers"], {"type": "json_object"})
        out["transformers text"] = await status(clients["transformers"], {"type": "text"})
        out["vllm text"] = await status(clients["vllm"], {"type": "text"})
        return out

    out = run(deployments, vlm_profile, go)
    for name, (_, code) in bad.items():
        assert out[name][0] == 400 and out[name][1]["code"] == code and out[name][1]["param"] == "response_format", \
            (name, out[name])
    assert out["transformers json_object"][0] == 400
    assert out["transformers json_object"][1]["code"] == "unsupported_parameter"
    assert out["transformers text"][0] == 200 and out["vllm text"][0] == 200


def test_closing_the_stream_aborts_the_request_in_vllm(deployments, vlm_profile):
    """A client gone (the deployment's event stream closed) closes the HTTP stream to vLLM, which aborts the
    request: vLLM then runs nothing, having generated fewer tokens than the whole (deterministic, greedy) answer."""
    import re

    server = deployments["vllm"].server
    request = {"messages": [{"role": "user", "content": "Write a long essay about the sea."}], "max_tokens": 200,
               "temperature": 0}

    def metric(name: str) -> float:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))

    async def go():
        whole = [ev async for ev in deployments["vllm"].chat_stream(dict(request))][-1]
        generated = metric("vllm:generation_tokens_total")
        events = deployments["vllm"].chat_stream(dict(request))
        seen = [await events.__anext__() for _ in range(3)]
        during = metric("vllm:num_requests_running")
        await events.aclose()
        t0 = asyncio.get_running_loop().time()
        while metric("vllm:num_requests_running") > 0 and asyncio.get_running_loop().time() - t0 < 60:
            await asyncio.sleep(0.1)
        return whole, seen, during, metric("vllm:num_requests_running"), \
            metric("vllm:generation_tokens_total") - generated

    whole, seen, during, running, tokens = asyncio.run(go())
    assert whole["type"] == "end" and whole["completion_tokens"] >= 20, whole
    assert seen[0]["type"] == "start" and during == 1 and running == 0
    assert 2 <= tokens < whole["completion_tokens"], (tokens, whole)


def test_a_repeated_image_prompt_recomputes_at_most_one_kv_block(deployments, vlm_profile, astronaut):
    """Prefix caching reuses whole KV-cache blocks, and the cpu profile pages vLLM's KV cache in blocks of 32 tokens
    (``block_size``; vLLM's CPU default, 128, left up to 127 tokens of a repeated prompt to prefill again): the second
    of two equal image prompts finds all but its last 1 to 32 tokens cached (vLLM's token counters
    ``prefix_cache_queries`` / ``prefix_cache_hits``). That is what makes a repeated image's time to first token
    short (bench/vlm_serving.py)."""
    import re

    block = vlm_profile.vlm.engine.vllm.block_size
    assert block == 32
    assert "--block-size" in deployments["vllm"].server.spec.args
    server = deployments["vllm"].server
    request = {"messages": [{"role": "user", "content": [image_part(astronaut), {"type": "text", "text":
               "Describe this picture in detail, please, for a catalogue of photographs."}]}], "max_tokens": 1,
               "temperature": 0}

    def counters() -> tuple[float, float]:
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        return tuple(sum(float(v) for v in re.findall(rf"^vllm:prefix_cache_{n}_total(?:{{[^}}]*}})? ([0-9.e+-]+)$",
                                                      text, re.M)) for n in ("queries", "hits"))

    async def once():
        return [ev async for ev in deployments["vllm"].chat_stream(dict(request))][-1]

    asyncio.run(once())
    q0, h0 = counters()
    end = asyncio.run(once())
    q1, h1 = counters()
    assert end["type"] == "end", end
    prompt_tokens = q1 - q0
    assert prompt_tokens > 2 * block  # an image (64 tokens) and the text: several blocks
    assert 1 <= prompt_tokens - (h1 - h0) <= block, (prompt_tokens, h1 - h0)


def test_ngram_speculative_decoding_gives_the_same_greedy_tokens(deployments, servers, vlm_profile):
    """``vlm.engine.vllm.speculative`` (n-gram, k=4) reaches vLLM, proposes and has drafts accepted, and the greedy
    answers equal the plain vllm deployment's token for token: verification keeps exactly the target's argmax
    tokens, so speculative decoding is lossless under greedy sampling. Logprobs are not compared: the verify pass
    scores several positions in one forward, so its sums are ordered differently (rounding only)."""
    import re

    spec = servers["ngram"]
    assert "--speculative-config" in spec.server.spec.args
    assert spec.engine.wait_ready(600), spec.server.log_tail()
    passage = ("The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the warm sun. "
               "The warm sun shines on the quiet river.")
    prompts = {"copy": [{"role": "user", "content": f"Repeat this text exactly, twice:\n{passage}"}],
               "capital": [{"role": "user", "content": "What is the capital of France?"}],
               "colours": [{"role": "user", "content": "List three colours."}]}

    async def go(clients):
        # not streamed: streamed and one-shot answers are the same tokens (test_greedy_answers_equal_...)
        return {(name, False): [await answer(clients[b], msgs, False) for b in ("spec", "vllm")]
                for name, msgs in prompts.items()}

    results = run({"spec": spec, "vllm": deployments["vllm"]}, vlm_profile, go)
    text = httpx.get(f"{spec.server.base_url}/metrics", timeout=10).text

    def metric(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))

    for (name, stream), (got, ref) in results.items():
        assert ref["usage"][1] >= 8, (name, ref)
        assert [t[0] for t in got["tokens"]] == [t[0] for t in ref["tokens"]], (name, stream)
        assert (got["text"], got["finish"], got["usage"]) == (ref["text"], ref["finish"], ref["usage"]), name
    assert metric("vllm:spec_decode_num_draft_tokens_total") > 0
    assert metric("vllm:spec_decode_num_accepted_tokens_total") > 0


def test_both_clients_give_the_same_greedy_tokens_for_ids_and_for_embeddings(deployments, astronaut):
    """The client protocol itself (``core.llm_client``), below the engine: one ``CompletionRequest`` sent to the
    in-process ``TransformersClient`` and to vLLM's ``VLLMClient`` gives the same greedy token ids and the same
    text, for a token-id prompt and for a ``(T, H)`` embedding prompt (an image's features spliced in, its
    placeholder ids banned), and each stream ends with a usage chunk counting them."""
    from core.llm_client import CompletionRequest
    from grafting.llm_stream import completion_request

    ref, vl = deployments["transformers"].engine, deployments["vllm"].engine
    params = ref.sampling_params(max_tokens=24, temperature=0)
    text_prompt = ref.prepare([{"role": "user", "content": "Name three colours."}])
    image_prompt = ref.prepare([{"role": "user", "content": [image_part(astronaut),
                                                              {"type": "text", "text": "Describe this."}]}])
    ids_req = completion_request(ref.model, text_prompt, params, ref.eos_token_ids)
    emb_req = completion_request(ref.model, image_prompt, params, ref.eos_token_ids)
    assert isinstance(ids_req.prompt, list) and emb_req.prompt.ndim == 2 and emb_req.banned_tokens
    assert isinstance(ids_req, CompletionRequest)

    async def collect(client, req):
        ids, text, usage = [], "", None
        async for c in client.stream(req):
            ids += c.token_ids
            text += c.text
            if c.completion_tokens is not None:
                usage = c.completion_tokens
        return ids, text, usage

    async def go():
        return {(name, kind): await collect(e.client, req) for name, e in (("transformers", ref), ("vllm", vl))
                for kind, req in (("ids", ids_req), ("embeds", emb_req))}

    out = asyncio.run(go())
    for kind in ("ids", "embeds"):
        got, want = out["vllm", kind], out["transformers", kind]
        assert want[0] and got == want, (kind, got, want)
        assert want[2] == len(want[0])
