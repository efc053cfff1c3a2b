"""The training YAML (``configs/graft/*.yaml``): what is grafted, the stages, the optimizer, optional LoRA.

Strict pydantic models (unknown keys are refused); :meth:`TrainConfig.from_yaml` reads one file.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field

from core.config import Strict as _Strict
from core.constants import DTYPE_PATTERN

from ..config import ImageTokens


class GraftModelConfig(_Strict):
    """What is grafted: ``tower`` (MoonViT directory / hub id, or a full VLM checkpoint with
    ``tower_key_prefix``), ``llm`` (causal LM directory / hub id), the image placeholder tokens, the image size
    cap in pixels, backbone dtypes, the projector's middle width, whether each image token also sees its image's
    mean (``projector_image_context``, :class:`~grafting.projector.GraftProjectorConfig`) and an optional projector
    to start from.
    ``meta_llm_config``/``meta_tower_config``: config kwargs used only by ``--dry-run`` (no download)."""

    tower: str
    llm: str
    tower_key_prefix: str | None = None
    image_tokens: ImageTokens = ImageTokens()
    max_image_side: int = Field(224, ge=28)
    max_prompt_tokens: int = 1024
    llm_dtype: str = Field("bfloat16", pattern=DTYPE_PATTERN)
    tower_dtype: str = Field("float32", pattern=DTYPE_PATTERN)
    projector_mid_size: int | None = None
    projector_image_context: bool = False
    init_projector: str | None = None
    meta_llm_config: dict | None = None
    meta_tower_config: dict | None = None


class Stage(_Strict):
    """One training stage: a LLaVA JSONL file and a number of optimizer steps."""

    name: str
    data: str
    steps: int = Field(gt=0)


class OptimConfig(_Strict):
    """AdamW (peak ``lr``) with ``warmup_ratio`` of all steps linear warmup, then cosine decay to 0.
    ``batch_size`` rows per process per micro-step; ``grad_accum`` micro-steps per optimizer step."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_ratio: float = 0.05
    batch_size: int = 8
    grad_accum: int = 1
    max_grad_norm: float = 1.0


class LoraOptions(_Strict):
    """Optional peft LoRA adapters on the LLM (off by default: the LLM stays exactly the base model)."""

    enabled: bool = False
    r: int = 8
    alpha: int = 16
    target_modules: list[str] = ["q_proj", "v_proj"]


class TrainConfig(_Strict):
    """A training run (one YAML file under ``configs/graft``). ``mixed_precision``: ``no`` (fp32) or ``bf16``
    autocast. ``resume``: ``auto`` (latest checkpoint in ``output_dir`` if any), a checkpoint path, or null."""

    output_dir: str
    model: GraftModelConfig
    stages: list[Stage]
    optim: OptimConfig = OptimConfig()
    mixed_precision: str = Field("bf16", pattern="^(no|bf16|fp16)$")
    gradient_checkpointing: bool = False
    lora: LoraOptions = LoraOptions()
    seed: int = 0
    save_every: int = 100
    log_every: int = 10
    resume: str | None = "auto"

    @property
    def total_steps(self) -> int:
        """Optimizer steps over all stages."""
        return sum(s.steps for s in self.stages)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> "TrainConfig":
        """Load a YAML config; ``overrides`` replace top-level keys. Raises pydantic.ValidationError."""
        data = yaml.safe_load(Path(path).read_text())
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)
