"""Evaluating a graft: multiple-choice accuracy by answer likelihood, blind and shuffled-image baselines, and
text-only fidelity (KL divergence from the base LLM).

Each choice is scored by the summed log-probability of its tokens as the assistant's reply (text and
end-of-turn token) after the prompt, as in lm-evaluation-harness' multiple-choice tasks; the prompt is run once
and its KV cache re-used by all choices in one batch. Nothing is parsed out of generated text. Baselines:
``blind`` drops the image (the LLM answers from the question alone, exactly the base LLM), ``shuffled`` gives
each question another item's image (a derangement). Items come from the synthetic test split or from
MMStar/MMMU-Pro files (:mod:`grafting.train.mcq`).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import torch

from ..model import GraftedVLM
from ..processor import GraftProcessor
from .mcq import MCItem

CONDITIONS = ("image", "blind", "shuffled")

TEXT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis in one sentence.",
    "What is 12 times 7?", "Name three primary colours.", "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?", "Give me a synonym for happy.", "What does a CPU do?",
    "How many legs does a spider have?", "Describe the sea in five words.", "What is the boiling point of water?",
    "Suggest a name for a cat.", "What is a prime number?", "List two uses of a hammer.",
    "Why is the sky blue?", "What is the opposite of cold?", "Write one sentence about trains.",
    "What shape has three sides?", "Is a tomato a fruit?", "What colour is grass?", "Count from one to five.",
    "What is the largest planet?", "Say hello in French.",
]


def _messages(item: MCItem, images) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": item.question}]
    return [{"role": "user", "content": parts}]


@torch.inference_mode()
def choice_logprobs(vlm: GraftedVLM, processor: GraftProcessor, messages: list[dict], choices: list[str]) -> torch.Tensor:
    """Summed log-probability of each choice as the assistant's reply: ``(len(choices),)`` float32.

    The choice tokens are the chat template's rendering of the reply (text + end of turn), found by the same
    prefix difference as training labels. Raises PromptError/ImageInputError for bad messages.
    """
    prompt = processor(messages)
    conv, _ = processor.normalize(messages)
    prefix = processor.template_ids(conv, add_generation_prompt=True)
    embeds = vlm.embed(prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw)
    out = vlm.llm(inputs_embeds=embeds, use_cache=True, logits_to_keep=1)
    first = out.logits[0, -1].float().log_softmax(-1)
    seqs = []
    for c in choices:
        full = processor.template_ids(conv + [{"role": "assistant", "content": c}], add_generation_prompt=False)
        ids = full[len(prefix):]
        while len(ids) > 1 and processor.tokenizer.decode(ids[-1:]).strip() == "":
            ids = ids[:-1]  # the template's trailing newline
        seqs.append(ids)
    scores = torch.stack([first[s[0]] for s in seqs])
    L = max(len(s) for s in seqs) - 1
    if L > 0:
        # all choices in one batch on the shared prompt cache; right padding cannot affect earlier positions
        cache = out.cache
        cache.batch_repeat_interleave(len(seqs))
        x = torch.tensor([s[:-1] + [s[0]] * (L - len(s) + 1) for s in seqs], device=vlm.device)
        lp = vlm.llm(input_ids=x, cache=cache, use_cache=True).logits.float().log_softmax(-1)
        for i, s in enumerate(seqs):
            if len(s) > 1:
                scores[i] += lp[i, : len(s) - 1].gather(1, torch.tensor(s[1:], device=lp.device)[:, None]).sum()
    return scores


def predict(vlm: GraftedVLM, processor: GraftProcessor, items: list[MCItem], condition: str = "image",
            seed: int = 0, shard: tuple[int, int] = (0, 1), progress: bool = False) -> dict[int, int]:
    """Predicted choice index per item under ``condition`` (image | blind | shuffled), for the items of this
    ``shard`` = (rank, world size) only (every world-th item), so several processes split one evaluation.

    Raises ValueError for an unknown condition or a shuffled baseline with fewer than 2 items.
    """
    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {CONDITIONS}")
    order = list(range(len(items)))
    if condition == "shuffled":
        if len(items) < 2:
            raise ValueError("the shuffled baseline needs at least 2 items")
        order = derangement(items, seed)
    mine = list(range(shard[0], len(items), shard[1]))
    if progress:
        from tqdm.auto import tqdm

        mine = tqdm(mine, desc=f"eval {condition}")
    preds, cache = {}, {}
    for i in mine:
        item = items[i]
        images = [] if condition == "blind" else [_open(p, cache) for p in items[order[i]].images]
        preds[i] = int(choice_logprobs(vlm, processor, _messages(item, images), item.choices).argmax())
        if len(cache) > 256:
            cache.clear()
    return preds


def summarize(items: list[MCItem], preds: dict[int, int], condition: str = "image") -> dict:
    """Accuracy overall, per question type and on held-out (unseen colour/shape) items.

    Returns ``{"condition", "accuracy", "n", "by_type": {qtype: acc}, "by_type_n", "held_out"}`` (None where a
    group is empty)."""
    hits, by_type, held = [], defaultdict(list), []
    for i, pred in sorted(preds.items()):
        ok = pred == items[i].answer_index
        hits.append(ok)
        by_type[items[i].question_type].append(ok)
        if items[i].held_out:
            held.append(ok)
    acc = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return {"condition": condition, "accuracy": acc(hits), "n": len(hits),
            "by_type": {k: acc(v) for k, v in sorted(by_type.items())},
            "by_type_n": {k: len(v) for k, v in sorted(by_type.items())}, "held_out": acc(held)}


def evaluate_mc(vlm: GraftedVLM, processor: GraftProcessor, items: list[MCItem], condition: str = "image",
                seed: int = 0, progress: bool = False) -> dict:
    """:func:`predict` on all items, then :func:`summarize`."""
    return summarize(items, predict(vlm, processor, items, condition, seed, progress=progress), condition)


def derangement(items: list[MCItem], seed: int = 0) -> list[int]:
    """A seeded permutation that gives every item another image: items are grouped by image (groups in random
    order), then each takes the image ``m`` places further round the cycle, ``m`` being the largest group.

    Raises ValueError when one image is shared by more than half of the items (no such permutation exists)."""
    rng = random.Random(seed)
    n = len(items)
    keys = [tuple(str(p) for p in it.images) for it in items]
    group_rank = {k: rng.random() for k in sorted(set(keys))}
    idx = sorted(range(n), key=lambda i: (group_rank[keys[i]], rng.random()))
    m = max(Counter(keys).values())
    if 2 * m > n:
        raise ValueError("the shuffled baseline needs every image to be used by at most half of the items")
    order = [0] * n
    for k in range(n):
        order[idx[k]] = idx[(k + m) % n]
    return order


def _open(p, cache: dict):
    from PIL import Image

    if not isinstance(p, str):
        return p
    if p not in cache:
        cache[p] = Image.open(p).convert("RGB")
    return cache[p]


@torch.inference_mode()
def text_kl(vlm: GraftedVLM, base_llm, processor: GraftProcessor, prompts: list[str] = TEXT_PROMPTS) -> list[float]:
    """KL(base || graft) of the next-token distributions, averaged over positions, for each text-only prompt
    (chat template applied). The graft calls its LLM on ``input_ids`` when there is no image, so every value
    must be exactly 0.0. Returns one float per prompt."""
    out = []
    for text in prompts:
        p = processor([{"role": "user", "content": text}])
        g = vlm(p.input_ids).logits[0].double().log_softmax(-1)
        b = base_llm(input_ids=p.input_ids.to(base_llm.device)).logits[0].double().log_softmax(-1)
        out.append(float((b.exp() * (b - g)).sum(-1).mean()))
    return out


def random_chance(items: list[MCItem]) -> dict[str, float]:
    """Expected accuracy of uniform guessing per question type (1 / number of choices, averaged)."""
    by = defaultdict(list)
    for it in items:
        by[it.question_type].append(1 / len(it.choices))
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}
