"""An EAGLE-3 head for the cpu profile's own LLM (SmolLM2-135M-Instruct, ``<model_dir>/vlm/llm``) served by the
cpu profile's VLM deployment on vLLM for image prompts.

SmolLM2-135M's embedding table has exactly its tokenizer's 49152 ids, so vLLM's mixed-prompt marker id 49152 is
no row of it (``core.vllm_marker``); ``chimera speculator train``'s worker writes the head with its own table of
49216 rows (``core.spec.worker.pad_head_table``), which vLLM keeps apart from the target's. The head trains 8
steps on six text prompts (its acceptance is not the point: losslessness and the engine's survival are). Three VLM
deployments run in this process (no Ray): ``eagle3`` (vLLM with the head), ``vllm`` (vLLM without it; both servers
start at once) and ``transformers`` (the in-process reference); greedy answers to image and text chats must be the
same tokens on all three, the head must draft for the image prompt, and the engine must answer again afterwards.
About 90 s on 2 quiet cores (2026-12-04: 63 s of set-up, the worker's distillation and 8 steps and both
servers' start-up; 17 s for the chats); 4 to 5 minutes with 30 steps beside a training job.
"""

from __future__ import annotations

import asyncio
import copy
import random

import httpx
import openai
import pytest

from core.spec.acceptance import spec_counters
from grafting.train.synth import render, sample_scene
from services.api.app import build_app
from services.config.profiles import parse_profile
from services.deployments.backends import LocalBackend
from services.deployments.vlm import Deployment
from tests.conftest import SMOLLM2_HEAD_K as K
from tests.conftest import data_url


@pytest.fixture(scope="module")
def head(smollm2_head):
    """The EAGLE-3 head of ``conftest.smollm2_head`` (trained once per session)."""
    return smollm2_head


@pytest.fixture(scope="module")
def deployments(profile, model_dir, head):
    """``{"eagle3", "vllm", "transformers"}``: the cpu profile's VLM section with the head, as shipped, and on the
    in-process backend; the vLLM servers ready."""
    data = profile.model_dump(mode="json")
    data["video"] = data["tts"] = None
    section = parse_profile(data).vlm.model_dump(mode="json")
    assert section["engine"]["backend"] == "vllm"
    spec, ref = copy.deepcopy(section), copy.deepcopy(section)
    spec["engine"]["vllm"]["speculative"] = {"method": "eagle3", "model": str(head[0]), "num_speculative_tokens": K}
    ref["engine"]["backend"] = "transformers"
    deps = {"eagle3": Deployment(spec, str(model_dir)), "vllm": Deployment(section, str(model_dir)),
            "transformers": Deployment(ref, str(model_dir))}
    try:
        for name in ("eagle3", "vllm"):
            assert deps[name].engine.wait_ready(600), deps[name].server.log_tail()
        yield deps, parse_profile(data)
    finally:
        deps["eagle3"].engine.close()
        deps["vllm"].engine.close()


def _answers(deps, profile, messages: list[list[dict]]) -> dict[str, list[str]]:
    """Greedy (24 tokens) answers of each deployment to each chat, through the ingress app, as token strings."""
    async def main():
        out = {}
        for name, dep in deps.items():
            app = build_app(profile, {"vlm": LocalBackend(dep)})
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=600)
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
            try:
                out[name] = []
                for m in messages:
                    r = await client.chat.completions.create(model="chimera-vlm", messages=m, max_tokens=24,
                                                             temperature=0, logprobs=True)
                    out[name].append([t.token for t in r.choices[0].logprobs.content])
            finally:
                await client.close()
        return out
    return asyncio.run(main())


def _drafts(dep) -> float:
    """Drafts proposed so far by ``dep``'s vLLM server (its ``/metrics``, read by
    :func:`core.spec.acceptance.spec_counters`)."""
    counters = spec_counters(httpx.get(f"{dep.server.base_url}/metrics", timeout=10).text)
    return counters["drafts"] if counters else 0.0


def _image_chat(img, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                         {"type": "text", "text": question}]}]


def test_the_profile_llm_serves_its_head_for_image_prompts(head, deployments, model_dir, astronaut):
    """The head carries 49216 embedding rows (SmolLM2's 49152 and one for vLLM's marker id 49152), vLLM keeps them
    apart from the target's; two image chats (a rendered shape scene, then the astronaut photograph with a longer
    answer; sent as mixed prompts) and a text chat get the same greedy tokens from vLLM with the head, vLLM without
    it and the in-process backend; the head drafted during the first image chat; the engine answers the next two
    after it."""
    from core.smollm2 import SMOLLM2_DIR
    from core.vllm_marker import embeds_marker, head_embed_rows

    deps, profile = deployments
    assert embeds_marker(model_dir / SMOLLM2_DIR) == (49152, 49152)
    assert head_embed_rows(head[0]) == head[1]["embed_rows"] == 49216
    before = _drafts(deps["eagle3"])
    shape = render(sample_scene(random.Random(7), "test"), "test")
    images = _answers(deps, profile, [_image_chat(shape, "What colour is the shape?")])
    after = _drafts(deps["eagle3"])
    more = _answers(deps, profile, [_image_chat(astronaut, "Describe this."),
                                    [{"role": "user", "content": "Why is the sky blue?"}]])
    assert len(images["transformers"][0]) > 1 and len(more["transformers"][0]) >= 8
    assert images["eagle3"] == images["vllm"] == images["transformers"], images
    assert more["eagle3"] == more["vllm"] == more["transformers"], more
    assert after > before, (before, after)
    assert "Detected EAGLE model with distinct embed_tokens weights" in deps["eagle3"].server.log_tail(200_000)
