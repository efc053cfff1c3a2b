"""A head trained on captured traffic, served: the cpu profile's VLM captures image chats (traffic capture on,
the openai SDK as client), ``chimera speculator train --traffic`` trains an EAGLE-3 head on them, and the cpu
profile's VLM on vLLM serves it losslessly (issue 28). One vLLM server of its own (``vllm`` layer); about 1.5 min
on 2 cores."""

from __future__ import annotations

import json

import torch

from core.spec.acceptance import spec_counters
from grafting.traffic import read_traffic

MAX_TOKENS = 16  # greedy tokens per chat: long enough that the head drafts several times


def test_a_head_trained_on_captured_image_chats_is_served_losslessly(profile, model_dir, astronaut, tmp_path):
    """The real VLM deployment (transformers backend) with capture on, behind the real app, the openai SDK as
    client: a text chat and three image chats (two of one picture) are answered and written, each image as its
    image-cache key and, once per key, the rows the LLM got for it; the prompt builder turns them back into the
    ids and embeddings the service sent; ``chimera speculator train --traffic`` trains a head (2 steps) whose
    report counts the captured image prompts as a training set of their own; the cpu profile's VLM on vLLM serves
    that head (``vlm.engine.vllm.speculative``), which drafts, and answers the four chats with the same greedy
    tokens as the in-process backend did when they were captured. SmolLM2's table has no row for vLLM's
    mixed-prompt marker id 49152, so the worker writes the head with a table of its own (49,216 rows), which vLLM
    keeps apart from the target's."""
    import asyncio

    import httpx
    import openai
    from typer.testing import CliRunner

    from core.smollm2 import SMOLLM2_DIR
    from core.spec.record import read_record
    from core.vllm_marker import embeds_marker, head_embed_rows
    from grafting.image_cache import image_keys
    from grafting.train.quant_prompts import vlm_prompt_sets
    from services.api.app import build_app
    from services.cli import app as cli
    from services.config.profiles import parse_profile
    from services.deployments.backends import LocalBackend
    from services.deployments.vlm import Deployment
    from tests.conftest import data_url

    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    data["vlm"]["engine"]["backend"] = "transformers"
    path = tmp_path / "traffic.jsonl"
    data["vlm"]["engine"]["traffic_capture"] = {"enabled": True, "path": str(path), "max_mb": 1}
    prof = parse_profile(data)
    dep = Deployment(prof.vlm.model_dump(mode="json"), str(model_dir))
    app = build_app(prof, {"vlm": LocalBackend(dep)})
    urls = [data_url(astronaut), data_url(astronaut.crop((0, 0, 256, 256)))]

    def image_chat(url: str, q: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": q}]}]

    chats = [[{"role": "user", "content": "Name a colour."}], image_chat(urls[0], "What is in this picture?"),
             image_chat(urls[1], "What colour is the sky?"), image_chat(urls[0], "Who is this?")]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
            for m in chats:
                r = await client.chat.completions.create(model="chimera-vlm", messages=m, max_tokens=MAX_TOKENS,
                                                         temperature=0, logprobs=True)
                assert r.choices[0].finish_reason in ("stop", "length")
                captured.append([t.token for t in r.choices[0].logprobs.content])
            return (await http.get("/metrics")).text

    captured: list[list[str]] = []  # the greedy tokens of each chat as captured (the in-process reference)
    text = asyncio.run(go())
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    keys = [image_keys(p.pixel_values, p.image_grid_thw)[0] for p in map(dep.engine.prepare, chats[1:])]
    assert lines[0]["messages"] == chats[0] and keys[0] == keys[2] != keys[1]
    assert [x["messages"][0]["content"][0] for x in lines[1:]] == [{"type": "image_ref", "key": k} for k in keys]
    assert not any(u in path.read_text() for u in urls)
    assert sorted(f.name for f in (tmp_path / "traffic.embeds").iterdir()) == sorted(
        f"{k}.safetensors" for k in set(keys))
    series = f'{{model="chimera-vlm",outcome="written",replica="{dep.replica_label()}"}}'
    assert f"chimera_vlm_traffic_capture_prompts_total{series} 4.0" in text
    # what the service sent its LLM for each image chat: ids with the image spans, and the input embeddings
    served = []
    for m in chats[1:]:
        p = dep.engine.prepare(m)
        served.append((p.input_ids[0].tolist(), dep.engine.model.embed(p.input_ids, p.pixel_values,
                                                                       p.image_grid_thw)[0].float()))
    traffic = read_traffic(path)
    assert traffic.text == [chats[0]] and traffic.missing == 0 and len(traffic.images) == 3
    for (m, rows), (ids, _) in zip(traffic.images, served):
        assert dep.engine.processor.ids_with_image_rows(m, [r.shape[0] for r in rows])[0].tolist() == ids
    dep.engine.close()
    sets = vlm_prompt_sets(prof.vlm.engine, model_dir, scene_heldout=1, scene_search=0, chat_search=0, fit="train",
                           traffic=traffic)
    assert "train" not in sets and sets["traffic_text"].prompts[0].tolist() == dep.engine.prepare(
        chats[0]).input_ids[0].tolist()
    image_id = dep.engine.model.image_token_ids.image
    for got, (ids, want) in zip(sets["traffic_image"].prompts, served):
        at_image = torch.tensor(ids) == image_id
        assert got.shape == want.shape and int(at_image.sum()) > 0
        assert torch.equal(got[~at_image], want[~at_image])  # the text rows: the LLM's own, exactly
        assert torch.equal(got[at_image], want[at_image].half().float())  # the image rows: as stored (float16)
    r = CliRunner().invoke(cli, ["speculator", "train", "--traffic", str(path), "--out", str(tmp_path / "head"),
                                 "--steps", "2", "--train-scenes", "0", "--train-chat", "0", "--heldout-scenes", "1",
                                 "--heldout-chat", "1",
                                 "--answer-tokens", "4", "--pack-tokens", "256", "--draft-vocab", "64"])
    assert r.exit_code == 0, r.output
    assert f"traffic: 1 text and 3 image conversations from {path}; 0 with images skipped" in r.output
    record = read_record(tmp_path / "head")
    assert embeds_marker(model_dir / SMOLLM2_DIR) == (49152, 49152)  # no row of SmolLM2's table: the head has one
    assert head_embed_rows(tmp_path / "head") == record["embed_rows"] == 49216
    assert {n: (s["role"], s["prompts"]) for n, s in record["sets"].items()} == {
        "traffic_text": ("train", 1), "traffic_image": ("train", 3), "scene": ("heldout", 1), "chat": ("heldout", 1)}
    assert record["acceptance"]["traffic_image"]["drafts"] > 0
    assert "| traffic_image | train |" in r.output
    # served: the cpu profile's VLM (vLLM backend, as shipped) with the head, capture off
    data["vlm"]["engine"]["backend"] = "vllm"
    data["vlm"]["engine"]["traffic_capture"] = {"enabled": False}
    data["vlm"]["engine"]["vllm"]["speculative"] = {"method": "eagle3", "model": str(tmp_path / "head"),
                                                    "num_speculative_tokens": 3}
    prof = parse_profile(data)
    served_dep = Deployment(prof.vlm.model_dump(mode="json"), str(model_dir))
    try:
        assert served_dep.engine.wait_ready(600), served_dep.server.log_tail()
        app = build_app(prof, {"vlm": LocalBackend(served_dep)})

        async def answers():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=600) as http:
                client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
                out = []
                for m in chats:
                    r = await client.chat.completions.create(model="chimera-vlm", messages=m, max_tokens=MAX_TOKENS,
                                                             temperature=0, logprobs=True)
                    out.append([t.token for t in r.choices[0].logprobs.content])
                return out

        assert asyncio.run(answers()) == captured
        metrics = httpx.get(f"{served_dep.server.base_url}/metrics", timeout=10).text
        counters = spec_counters(metrics)
        assert counters is not None and counters["drafts"] > 0, metrics[-2000:]
        # the head's own embedding table (SmolLM2's has no row for the mixed-prompt marker id; core.vllm_marker)
        assert "Detected EAGLE model with distinct embed_tokens weights" in served_dep.server.log_tail(200_000)
    finally:
        served_dep.engine.close()
