"""The VLM's prompts for ``chimera quantize --family vlm`` and ``chimera speculator train``
(:mod:`core.quant.prompts`): the service's own kinds of traffic, as the service sends them to its LLM.

- ``scene`` (held-out): questions about rendered scenes of the ``test`` split with ``test`` phrasings (what
  ``chimera graft eval`` scores), each prompt the input embeddings the engine computes (tower, projector, chat
  template: :meth:`grafting.model.GraftedVLM.embed`, what the vLLM backend sends as ``prompt_embeds``).
- ``chat`` (held-out): the text-only prompts of :data:`grafting.train.evaluate.TEXT_PROMPTS` (chat template applied,
  token ids, as the service sends text prompts).
- ``search`` (selects units; never scored in the report), or ``train`` for the speculator (trains the draft head):
  ``train``-split scenes with ``train`` phrasings and other text prompts (:data:`SEARCH_CHAT_PROMPTS`).

The worker answers each greedily with the reference LLM and scores (or trains on) the answers' positions.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from core.quant.prompts import PromptSet

from ..config import VLMConfig
from ..traffic import Traffic
from .evaluate import TEXT_PROMPTS
from .scenes import SERVED_CANVAS, ask, render, sample_scene

SEARCH_CHAT_PROMPTS = [
    "What is the tallest mountain?", "Write a short poem about rain.", "What is 9 plus 16?",
    "Name a fruit that is yellow.", "How do birds fly?", "Give one tip for sleeping well.",
    "What is the capital of Italy?", "Describe a forest in one sentence.",
]

# More text prompts for the speculator's chat training set (templates x topics; none is a held-out TEXT_PROMPTS one)
CHAT_TEMPLATES = [
    "What is {}?", "Write a short poem about {}.", "Explain {} in one sentence.", "Give me two facts about {}.",
    "Describe {} in a few words.", "Why do people like {}?", "Write one sentence about {}.",
    "List three things related to {}.", "Tell me a fun fact about {}.", "How would you explain {} to a child?",
]
CHAT_TOPICS = [
    "the moon", "volcanoes", "chess", "bicycles", "honey", "the ocean", "rain", "pizza", "libraries", "winter",
    "elephants", "coffee", "the internet", "gardening", "music", "bridges", "clouds", "football", "bread",
    "the sun", "rivers", "owls", "mathematics", "painting", "deserts", "snow", "robots", "tea", "mountains",
    "friendship", "electricity", "the heart", "apples", "maps", "airplanes", "penguins", "history", "soap",
    "rainbows", "sleep", "lions", "glass", "the alphabet", "cheese", "wind", "computers", "bees", "summer",
    "dinosaurs", "the brain",
]


def train_chat_prompts(n: int) -> list[str]:
    """The first ``n`` text prompts of the speculator's chat training set: :data:`SEARCH_CHAT_PROMPTS`, then
    :data:`CHAT_TEMPLATES` x :data:`CHAT_TOPICS` (500) in a fixed shuffled order, each once, without any held-out
    :data:`~grafting.train.evaluate.TEXT_PROMPTS`. Raises ValueError when ``n`` exceeds the 507 there are."""
    made = [t.format(topic) for topic in CHAT_TOPICS for t in CHAT_TEMPLATES]
    random.Random(0).shuffle(made)
    held = set(TEXT_PROMPTS)
    pool = [p for p in dict.fromkeys(SEARCH_CHAT_PROMPTS + made) if p not in held]
    if n > len(pool):
        raise ValueError(f"{n} chat training prompts: there are {len(pool)}")
    return pool[:n]


def _scene_messages(rng: random.Random, split: str) -> list[dict]:
    scene = sample_scene(rng, split, SERVED_CANVAS)
    q = ask(rng, scene, rng.choice(scene.question_types()), phrasing=split)
    return [{"role": "user", "content": [{"type": "image", "image": render(scene, SERVED_CANVAS)},
                                         {"type": "text", "text": q["question"]}]}]


@torch.inference_mode()
def vlm_prompt_sets(config: VLMConfig, model_dir: str | Path | None, scene_heldout: int = 48,
                    scene_search: int = 8, chat_search: int = 8, chat_heldout: int = len(TEXT_PROMPTS),
                    seed: int = 0,
                    fit: str = "search", traffic: Traffic | None = None) -> dict[str, PromptSet]:
    """The ``search`` (``fit="train"``: ``train``, the speculator's training set), ``scene`` and ``chat`` sets for
    the VLM of ``config`` (its tower, projector and LLM loaded in-process from ``model_dir``: the transformers
    backend, no server). Counts as named; ``chat`` holds the first ``chat_heldout`` (all 24 by default) of
    :data:`TEXT_PROMPTS`; ``seed`` draws the scenes (with ``fit="train"`` the held-out ones from a stream of their own: the same whatever ``scene_search``).
    ``chat_search`` text prompts come from :func:`train_chat_prompts` (the first 8 are :data:`SEARCH_CHAT_PROMPTS`).
    ``traffic``: a captured dataset (:func:`grafting.traffic.read_traffic`), whose conversations are two more sets
    of role ``fit``, each present when not empty: ``traffic_text`` (as served: chat template, token ids) and
    ``traffic_image`` (as served: ``(T, H)`` input embeddings, the LLM's rows for the text and the stored image
    rows at the placeholders, :meth:`~grafting.processor.GraftProcessor.ids_with_image_rows` and
    :meth:`~grafting.model.GraftedVLM.embed_features`; its description names the lines skipped for missing
    embeddings); the ``fit`` set itself is then left out when empty. Raises ValueError for another ``fit``, too
    many chat training prompts, a ``chat_heldout`` outside 1-24 or a captured conversation the processor refuses (PromptError) or whose stored image rows
    are not of the LLM's width, OSError when a checkpoint is missing (run ``chimera prepare``)."""
    if fit not in ("search", "train"):
        raise ValueError(f"fit {fit!r}: search (chimera quantize) or train (chimera speculator train)")
    if not 1 <= chat_heldout <= len(TEXT_PROMPTS):
        raise ValueError(f"{chat_heldout} held-out chat prompts: 1 to {len(TEXT_PROMPTS)}")
    chat_texts = train_chat_prompts(chat_search)
    chat_held = TEXT_PROMPTS[:chat_heldout]
    from ..engine import VLMEngine

    engine = VLMEngine.from_config(config, model_dir)
    try:
        def embeds(messages: list[dict]) -> torch.Tensor:
            p = engine.prepare(messages)
            return engine.model.embed(p.input_ids, p.pixel_values, p.image_grid_thw)[0].float().cpu()

        def ids(text: str) -> torch.Tensor:
            return engine.prepare([{"role": "user", "content": text}]).input_ids[0].long().cpu()

        def stored(messages: list[dict], rows: list[torch.Tensor]) -> torch.Tensor:
            p_ids = engine.processor.ids_with_image_rows(messages, [r.shape[0] for r in rows])
            return engine.model.embed_features(p_ids, torch.cat(rows))[0].float().cpu()

        rng = random.Random(seed)
        search = [embeds(_scene_messages(rng, "train")) for _ in range(scene_search)]
        # the speculator's held-out scenes do not depend on how many training scenes were drawn (heads trained on
        # different kinds are scored on the same scenes); chimera quantize's continue the one stream, as before
        held_rng = random.Random(f"{seed}-heldout") if fit == "train" else rng
        search += [ids(t) for t in chat_texts]
        described = f"{scene_search} train-split scene questions (image embeddings) and {len(chat_texts)} text prompts"
        sets = {fit: PromptSet(fit, described, search)}
        if traffic is not None:
            if traffic.text:
                sets["traffic_text"] = PromptSet(fit, f"{len(traffic.text)} captured text conversations (token ids)",
                                                 [engine.prepare(m).input_ids[0].long().cpu() for m in traffic.text])
            if traffic.images:
                sets["traffic_image"] = PromptSet(
                    fit, f"{len(traffic.images)} captured conversations with images (input embeddings: the stored "
                         f"image rows; {traffic.missing} skipped, their embeddings missing)",
                    [stored(m, rows) for m, rows in traffic.images])
            if not search and len(sets) > 1:
                del sets[fit]
        return {
            **sets,
            "scene": PromptSet("heldout", f"{scene_heldout} test-split scene questions (image embeddings, as served)",
                               [embeds(_scene_messages(held_rng, "test")) for _ in range(scene_heldout)]),
            "chat": PromptSet("heldout", f"{len(chat_held)} text chat prompts (token ids)",
                              [ids(t) for t in chat_held]),
        }
    finally:
        engine.close()
