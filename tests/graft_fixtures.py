"""Small real-architecture random-weight grafts for the grafting tests (no mocks).

``tiny_graft_dirs``: a 2-layer Llama with SmolLM2's tokenizer and vocabulary, a 1-layer MoonViT and a small
synthetic dataset, written with ``save_pretrained`` under a temporary folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_TOKENS = {"start": "<jupyter_start>", "image": "<jupyter_code>", "end": "<jupyter_output>"}


def write_tiny_graft(root: Path, model_dir: Path) -> dict[str, Path]:
    """Write ``llm/`` (Llama, hidden 64, 2 layers, init std 0.2 so that image features move its output,
    SmolLM2 vocabulary + tokenizer), ``tower/`` (MoonViT, hidden
    32, 1 layer + its image processor) and ``synth/`` (16 train images, 4 test images) under ``root``."""
    from transformers import Kimi_K25ImageProcessor, LlamaConfig, LlamaForCausalLM

    from core.smollm2 import smollm2_tokenizer
    from grafting.train.synth import write_dataset
    from grafting.tower import build_random_tower, build_tower_config

    tok = smollm2_tokenizer(model_dir)
    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.2,
                                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    llm.save_pretrained(root / "llm")
    tok.save_pretrained(root / "llm")
    tower = build_random_tower(build_tower_config(32, 1, 2, 64, 16, 16), seed=0)
    tower.save_pretrained(root / "tower")
    Kimi_K25ImageProcessor(size={"max_height": 16, "max_width": 16}).save_pretrained(root / "tower")
    write_dataset(root / "synth", n_train=16, n_test=4, seed=0)
    return {"llm": root / "llm", "tower": root / "tower", "synth": root / "synth"}


def train_config(dirs: dict[str, Path], out: Path, steps=(3, 3), **overrides):
    """A :class:`~grafting.train.config.TrainConfig` on the tiny models: captions then QA, fp32, batch 4."""
    from grafting.train.config import TrainConfig

    data = {"output_dir": str(out),
            "model": {"tower": str(dirs["tower"]), "llm": str(dirs["llm"]), "image_tokens": IMAGE_TOKENS,
                      "llm_dtype": "float32", "max_prompt_tokens": 512},
            "stages": [{"name": "captions", "data": str(dirs["synth"] / "captions.jsonl"), "steps": steps[0]},
                       {"name": "qa", "data": str(dirs["synth"] / "qa.jsonl"), "steps": steps[1]}],
            "optim": {"lr": 3e-3, "batch_size": 4, "warmup_ratio": 0.0},
            "mixed_precision": "no", "save_every": 2, "log_every": 1}
    data.update(overrides)
    return TrainConfig.model_validate(data)
