"""The speech LM's prompts for ``chimera quantize --family tts`` (:mod:`core.quant.prompts`): utterances as the
engine prompts its LM (:meth:`audio.layout.TokenLayout.speech_prompt`, token ids), each in a voice of the profile.

The statistics are taken over the audio ids only (``score_vocab``: the layout's audio range; the served LM's frame
constraint allows nothing else where it speaks), and the reference's greedy answers are drawn from that range
too: the report is the KL of the SNAC-code distributions.

- ``speech`` (held-out): :data:`HELDOUT_TEXTS`, voices in turn.
- ``search``: :data:`SEARCH_TEXTS`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.config import resolve_path
from core.quant.prompts import PromptSet

from .config import TTSConfig
from .layout import TokenLayout

HELDOUT_TEXTS = [
    "Hello there.", "The train leaves at nine in the morning.", "Could you pass me the salt, please?",
    "It rained all night, and the streets are still wet.", "Thank you for calling; how can I help?",
    "The meeting moved to Thursday afternoon.", "I have never seen so many stars.", "Turn left at the bakery.",
    "Your order will arrive tomorrow.", "What a wonderful surprise!", "Please keep the door closed.",
    "The museum opens at ten.", "She sang the whole song from memory.", "Two coffees and a tea, please.",
    "The battery is almost empty.", "We walked along the river until sunset.", "Is this seat taken?",
    "The results will be ready next week.", "He laughed so hard he cried.", "Remember to water the plants.",
    "The bridge is closed for repairs.", "Good night, and sleep well.", "Let me think about it.",
    "The soup needs a little more salt.",
]
SEARCH_TEXTS = [
    "The weather today is sunny and warm.", "Please call me back when you can.", "I will see you at the station.",
    "The library is quiet in the evening.", "Where did you put the keys?", "The cat sleeps on the sofa.",
    "We need more paper for the printer.", "That was the best film of the year.",
]


def tts_prompt_sets(cfg: TTSConfig, model_dir: str | Path | None, heldout: int = 24,
                    search: int = 8) -> tuple[dict[str, PromptSet], tuple[int, int]]:
    """The ``search`` and ``speech`` sets (token ids) for the speech LM of ``cfg`` and the score vocabulary
    ``(audio_start, audio_end)``. Raises OSError when the tokenizer is missing (run ``chimera prepare``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_path(model_dir, cfg.tokenizer or cfg.lm))
    layout = TokenLayout(cfg.layout)
    voices = list(cfg.voices)

    def ids(i: int, text: str) -> torch.Tensor:
        return torch.tensor(layout.speech_prompt(tok, voices[i % len(voices)], text), dtype=torch.int64)

    sets = {"search": PromptSet("search", f"{min(search, len(SEARCH_TEXTS))} utterances",
                                [ids(i, t) for i, t in enumerate(SEARCH_TEXTS[:search])]),
            "speech": PromptSet("heldout", f"{min(heldout, len(HELDOUT_TEXTS))} utterances, voices in turn",
                                [ids(i, t) for i, t in enumerate(HELDOUT_TEXTS[:heldout])])}
    return sets, (layout.audio_start, layout.audio_end)
