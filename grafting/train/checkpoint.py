"""Loading a graft (tower + LLM frozen, the projector fresh or from a checkpoint) and its checkpoints on disk.

A checkpoint folder holds ``projector/`` (safetensors + config), ``graft.json`` naming the tower and the LLM,
``trainer_state.pt`` (optimizer and scheduler, for resuming) and ``lora/`` when LoRA is on.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.memory import DTYPES

from ..config import ImageTokens
from ..model import GraftedVLM
from ..processor import GraftProcessor
from ..projector import GraftProjector, GraftProjectorConfig
from .config import GraftModelConfig, TrainConfig


# -- loading ----------------------------------------------------------------------------------------
def load_graft(mc: GraftModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> tuple[GraftedVLM, GraftProcessor]:
    """Load tower, LLM and tokenizer with ``from_pretrained``; the projector from ``init_projector`` or freshly
    initialised (seeded). Tower and LLM come back frozen. Raises OSError when a checkpoint is missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Kimi_K25ImageProcessor

    from ..tower import load_tower

    llm = AutoModelForCausalLM.from_pretrained(mc.llm, dtype=DTYPES[mc.llm_dtype]).to(device)
    tower = load_tower(mc.tower, dtype=DTYPES[mc.tower_dtype], device=str(device), key_prefix=mc.tower_key_prefix)
    tokenizer = AutoTokenizer.from_pretrained(mc.llm)
    side = mc.max_image_side // 14
    try:
        image_processor = Kimi_K25ImageProcessor.from_pretrained(mc.tower, size={"max_height": side, "max_width": side})
    except OSError:
        image_processor = Kimi_K25ImageProcessor(size={"max_height": side, "max_width": side})
    if mc.init_projector:
        projector = GraftProjector.from_pretrained(mc.init_projector, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        projector = GraftProjector(GraftProjectorConfig(
            vision_hidden_size=tower.config.hidden_size, merge_size=4, mid_size=mc.projector_mid_size,
            llm_hidden_size=llm.config.hidden_size, image_context=mc.projector_image_context))
    t = mc.image_tokens
    processor = GraftProcessor(tokenizer, image_processor, (t.start, t.image, t.end),
                               max_prompt_tokens=mc.max_prompt_tokens)
    vlm = GraftedVLM(tower, projector.to(device), llm, processor.image_token_ids)
    vlm.freeze_backbones()
    return vlm, processor


# -- checkpoints ----------------------------------------------------------------------------------
def save_checkpoint(path: Path, vlm: GraftedVLM, cfg: TrainConfig, step: int, stage: str,
                    optimizer=None, scheduler=None) -> None:
    """Write ``projector/`` (safetensors + config), ``graft.json`` (tower, LLM, image tokens, step) and, with an
    optimizer, ``trainer_state.pt``; ``lora/`` when LoRA is on."""
    path.mkdir(parents=True, exist_ok=True)
    vlm.projector.save_pretrained(path / "projector")
    if cfg.lora.enabled:
        vlm.llm.save_pretrained(path / "lora")
    mc = cfg.model
    graft = {"tower": mc.tower, "tower_key_prefix": mc.tower_key_prefix, "llm": mc.llm,
             "image_tokens": mc.image_tokens.model_dump(), "max_image_side": mc.max_image_side,
             "projector": "projector", "step": step, "stage": stage, "lora": cfg.lora.enabled}
    (path / "graft.json").write_text(json.dumps(graft, indent=2))
    if optimizer is not None:
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   path / "trainer_state.pt")


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The ``checkpoint-<step>`` folder with the highest step that has a ``trainer_state.pt``, or None."""
    ckpts = [p for p in Path(output_dir).glob("checkpoint-*") if (p / "trainer_state.pt").exists()]
    return max(ckpts, key=lambda p: int(p.name.split("-")[1])) if ckpts else None


def load_checkpoint_config(path: str | Path) -> GraftModelConfig:
    """The :class:`GraftModelConfig` that loads a saved checkpoint (``graft.json`` + ``projector/``); a tower
    named relative to the checkpoint folder (an exported graft) is found there."""
    path = Path(path)
    g = json.loads((path / "graft.json").read_text())
    tower = str(path / g["tower"]) if (path / g["tower"]).is_dir() else g["tower"]  # exported grafts: relative
    return GraftModelConfig(tower=tower, llm=g["llm"], tower_key_prefix=g.get("tower_key_prefix"),
                            image_tokens=ImageTokens(**g["image_tokens"]), max_image_side=g["max_image_side"],
                            init_projector=str(path / g.get("projector", "projector")))
