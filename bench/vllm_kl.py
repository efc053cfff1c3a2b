"""Per-token KL(transformers || vllm) of the grafted VLM's greedy answers on 24 prompts (16 text, 8 with images).

Both backends of the cpu profile, fp32, in this process (no Ray): the ``vllm`` backend answers greedily with the
top-20 logprobs of every step (vLLM's ``--max-logprobs`` cap); the ``transformers`` reference scores the same
tokens teacher-forced (one forward over prompt + answer), giving its full next-token distribution p at each step.
vLLM's q is known on its top-20 set S only, so KL is computed on the partition {each id in S} + {the rest}:
KL_S(p||q) = sum_{i in S} p_i log(p_i / q_i) + p_rest log(p_rest / q_rest), a lower bound of the full KL (merging
outcomes never increases KL); the mass p(S) it covers is printed too. Also printed: whether the greedy tokens equal
the transformers backend's own greedy decode, and the largest |logprob difference| on S.

Run: ``.venv/bin/python bench/vllm_kl.py`` (starts vLLM's server: about 1-2 minutes on 2 busy cores).
"""

from __future__ import annotations

import asyncio
import math
import random

import torch
from PIL import Image
from skimage import data

from grafting.engine import VLMEngine
from grafting.train.synth import render, sample_scene
from services.config.profiles import load_profile
from services.engines.vllm_server import start_vllm_for

TEXT = ["What is the capital of France?", "Name a large animal.", "What is 2 plus 2?", "Say hello in Spanish.",
        "Give me a synonym for happy.", "What colour is the sky?", "Name a planet.", "Who wrote Hamlet?",
        "List three fruits.", "What is water made of?", "Describe a cat in one sentence.", "How many days in a week?",
        "What is the opposite of cold?", "Name a musical instrument.", "What do bees make?", "Tell me a short joke."]
QUESTIONS = ["What colour is the shape?", "What shape is shown?", "What is in this picture?", "Describe this image."]
MAX_TOKENS = 32
TOP = 20


def data_url(img: Image.Image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def prompts() -> list[list[dict]]:
    """16 text conversations and 8 with an image (6 synthetic shapes, the astronaut photo twice)."""
    out = [[{"role": "user", "content": t}] for t in TEXT]
    rng = random.Random(0)
    images = [render(sample_scene(rng, "test"), "test") for _ in range(6)] + [Image.fromarray(data.astronaut())] * 2
    for i, img in enumerate(images):
        out.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                                 {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}])
    return out


def kl_on_partition(logp: torch.Tensor, top: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(KL_S(p||q), p(S), max |log p_i - log q_i| on S) for full reference log-probs ``logp`` ``(V,)`` and vLLM's
    ``top`` ``[(id, log q)]``."""
    ids = torch.tensor([i for i, _ in top])
    lq = torch.tensor([v for _, v in top], dtype=torch.float64)
    lp = logp.double()[ids]
    p, q = lp.exp(), lq.exp()
    p_rest, q_rest = max(1.0 - float(p.sum()), 1e-300), max(1.0 - float(q.sum()), 1e-300)
    kl = float((p * (lp - lq)).sum()) + p_rest * (math.log(p_rest) - math.log(q_rest))
    return kl, float(p.sum()), float((lp - lq).abs().max())


async def vllm_answer(engine: VLMEngine, msgs):
    prompt = engine.prepare(msgs)
    params = engine.sampling_params(max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=TOP)
    return prompt, [d async for d in engine.stream(prompt, params, guard=False) if d.token_id is not None]


async def reference_ids(engine: VLMEngine, prompt) -> list[int]:
    params = engine.sampling_params(max_tokens=MAX_TOKENS, temperature=0)
    return [d.token_id async for d in engine.stream(prompt, params, guard=False) if d.token_id is not None]


@torch.inference_mode()
def main() -> None:
    prof = load_profile("cpu")
    cfg, model_dir = prof.vlm.engine, prof.resolved_model_dir()
    ref = VLMEngine.from_config(cfg, model_dir)
    client = start_vllm_for(cfg, model_dir)
    try:
        vl = VLMEngine.from_config(cfg, model_dir, backend="vllm", llm_client=client)
        assert vl.wait_ready(900), client.server.log_tail()
        kls, masses, worst, same, n_tok = [], [], 0.0, 0, 0
        for msgs in prompts():
            prompt, deltas = asyncio.run(vllm_answer(vl, msgs))
            ids = [d.token_id for d in deltas]
            greedy = asyncio.run(reference_ids(ref, prompt))
            same += ids == greedy
            full = torch.cat([prompt.input_ids, torch.tensor([ids])], dim=1)
            logits = ref.model(full, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw).logits[0]
            T = prompt.num_tokens
            for step, d in enumerate(deltas):
                kl, mass, diff = kl_on_partition(torch.log_softmax(logits[T - 1 + step].float(), -1), d.top_logprobs)
                kls.append(kl)
                masses.append(mass)
                worst = max(worst, diff)
            n_tok += len(deltas)
        print(f"prompts 24 (16 text, 8 with images), tokens scored {n_tok}, greedy answers equal to transformers' "
              f"own greedy decode: {same}/24")
        print(f"per-token KL(transformers || vllm) on top-{TOP} + rest: mean {sum(kls) / len(kls):.3e} nats, "
              f"max {max(kls):.3e} nats; mass covered p(S) mean {sum(masses) / len(masses):.4f}, "
              f"min {min(masses):.4f}; max |logprob diff| on S {worst:.3e}")
    finally:
        client.close()


if __name__ == "__main__":
    main()
