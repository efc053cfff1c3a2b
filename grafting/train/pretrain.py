"""Pretraining the cpu profile's small MoonViT on synthetic shape/colour classification (``chimera graft
pretrain-tower``).

The real graft starts from a pretrained encoder (MoonViT). The cpu profile's tower is a small
``Kimi_K25VisionModel`` of the same architecture; a random one carries colour but barely shape, so it is first
trained here as a plain multi-task classifier (colour, shape, count, size, position heads on the mean of its
merged patch features), then saved and frozen. The heads are thrown away; grafting never updates the tower.
With ``source: scenes`` and ``token_weight > 0`` every merged token also gets dense targets
(:func:`grafting.train.scenes.token_targets`: background or the object's shape / colour under it), since the
projector reads the tokens, not their mean; with ``centre_weight > 0`` every merged token also learns how many
object centres it holds (:func:`grafting.train.scenes.centre_targets`), and with ``density_weight > 0`` what share
of the objects' area it holds (:func:`grafting.train.scenes.density_targets`, regressed): per-region count
targets. Seeded and deterministic on one thread (same seed, same weights).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ..config import TowerBuild
from ..model import image_token_counts
from ..tower import build_random_tower, build_tower_config, tower_class
from .synth import COLOURS, COUNTS, POSITIONS, SHAPES, SIZES, render, sample_scene

HEADS = {"colour": list(COLOURS), "shape": list(SHAPES), "count": list(COUNTS), "size": list(SIZES),
         "position": list(POSITIONS) + [None]}
SOURCES = ("synth", "scenes")  # grafting.train.synth (the seed's generator) or grafting.train.scenes (varied, issue 15)


class PretrainTowerConfig(BaseModel):
    """Tower sizes and patch stem (:class:`~grafting.config.TowerBuild`; ``patch_stem: conv`` trains a
    :class:`~grafting.tower.MoonViTConvStem`), optimisation (steps, batch of images, AdamW peak lr
    with 5% warmup then cosine), image canvas in pixels, the processor's longest side in pixels, the synthetic
    split drawn from (``pretrain``: broad; ``train``: the graft's training ranges; with ``source: scenes`` the
    :mod:`grafting.train.scenes` train split, whatever ``split`` says, and its
    :data:`~grafting.train.scenes.TOWER_HEADS`) an optional tower folder to continue from (``init``; its sizes win
    over ``tower``), the weight of the per-token shape and colour losses (``token_weight``; scenes only, 0 = off) and
    of the per-token object-centre count loss (``centre_weight``) and density loss (``density_weight``, mean squared
    error; both scenes only, 0 = off)."""

    model_config = ConfigDict(extra="forbid")
    tower: TowerBuild = TowerBuild(hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
                                   intermediate_size=512)
    steps: int = 1800
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    canvas: int = 112
    max_image_side: int = 224
    eval_images: int = 256
    seed: int = 0
    split: str = "pretrain"
    init: str | None = None
    source: str = Field("synth", pattern="^(synth|scenes)$")
    token_weight: float = Field(0.0, ge=0.0)
    centre_weight: float = Field(0.0, ge=0.0)
    density_weight: float = Field(0.0, ge=0.0)

    def token_heads(self) -> tuple[str, ...]:
        """The :data:`TOKEN_HEADS` this config trains (those whose weight is above 0)."""
        return (("token_shape", "token_colour") if self.token_weight else ()) + \
            (("token_centres",) if self.centre_weight else ()) + (("token_density",) if self.density_weight else ())

    def token_loss_weight(self, head: str) -> float:
        """The loss weight of one of :data:`TOKEN_HEADS`."""
        return {"token_centres": self.centre_weight, "token_density": self.density_weight}.get(head, self.token_weight)


def _labels(scenes) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([HEADS[k].index(getattr(s, k)) for s in scenes]) for k in HEADS}


def heads_of(source: str) -> dict[str, list]:
    """The classification heads (name -> classes) of a data source (:data:`SOURCES`)."""
    if source == "scenes":
        from .scenes import TOWER_HEADS

        return TOWER_HEADS
    return HEADS


# background + grafting.train.scenes SHAPES / COLOURS; centres: 0..max(grafting.train.scenes COUNTS) per token
# density: one regressed value per token
TOKEN_HEADS = {"token_shape": 1 + 3, "token_colour": 1 + 4, "token_centres": 1 + 3, "token_density": 1}


class TowerClassifier(nn.Module):
    """The tower plus one linear head per attribute on the mean of its merged patch features, and the named
    ``token_heads`` (of :data:`TOKEN_HEADS`) on each merged token (the mean of its 2x2 patches).

    forward(pixel_values ``(P, 3, 14, 14)`` float, grid ``(B, 3)`` long) -> ``{head: (B, classes)}`` logits,
    token heads ``(B, T, classes)`` (T merged tokens per image; every image of a batch the same size)."""

    def __init__(self, tower: nn.Module, heads: dict[str, list] = HEADS, token_heads: tuple[str, ...] = ()):
        super().__init__()
        self.tower = tower
        c = tower.config.hidden_size
        self.norm = nn.LayerNorm(c)
        self.heads = nn.ModuleDict({k: nn.Linear(c, len(v)) for k, v in heads.items()})
        self.token_norm = nn.LayerNorm(c) if token_heads else None
        self.token_heads = nn.ModuleDict({k: nn.Linear(c, TOKEN_HEADS[k]) for k in token_heads})

    def forward(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logits per head, ``{name: (B, classes)}`` float (token heads ``(B, T, classes)``)."""
        groups = self.tower(pixel_values, grid_thw=grid).pooler_output  # (N, 4, C), images in order
        per_image = image_token_counts(grid)
        pooled = torch.stack([g.mean(dim=(0, 1)) for g in groups.split(per_image)])
        pooled = self.norm(pooled)
        out = {k: h(pooled) for k, h in self.heads.items()}
        if self.token_heads:
            tokens = self.token_norm(torch.stack([g.mean(dim=1) for g in groups.split(per_image)]))
            out.update({k: h(tokens) for k, h in self.token_heads.items()})
        return out


def _batch(processor, rng: random.Random, n: int, split: str, canvas: int, source: str = "synth",
           token_heads: tuple[str, ...] = ()):
    if source == "scenes":
        from . import scenes as sc

        drawn = [sc.sample_scene(rng, "test" if split == "test" else "train", canvas) for _ in range(n)]
        images = [sc.render(s, canvas) for s in drawn]
        labels = [sc.tower_labels(s) for s in drawn]
        labels = {k: torch.tensor([lab[k] for lab in labels]) for k in sc.TOWER_HEADS}
        dense = [sc.token_targets(s, canvas) for s in drawn]
        labels["token_shape"] = torch.from_numpy(np.stack([d[0] for d in dense]))
        labels["token_colour"] = torch.from_numpy(np.stack([d[1] for d in dense]))
        for k, targets in (("token_centres", sc.centre_targets), ("token_density", sc.density_targets)):
            if k in token_heads:  # drawn only for a head that trains on them
                labels[k] = torch.from_numpy(np.stack([targets(s, canvas) for s in drawn]))
    else:
        drawn = [sample_scene(rng, split, canvas) for _ in range(n)]
        images, labels = [render(s, split, canvas) for s in drawn], _labels(drawn)
    feats = processor(images=images, return_tensors="pt")
    return feats["pixel_values"], feats["image_grid_thw"], labels


@torch.no_grad()
def probe_accuracy(model: TowerClassifier, processor, cfg: PretrainTowerConfig, split: str = "test") -> dict:
    """Head accuracy on ``cfg.eval_images`` fresh images of ``split`` (test: drawn differently, held-out pairs;
    with ``source: scenes`` the held-out renderings); token shape and colour heads: accuracy over the tokens an
    object covers; ``token_centres``: accuracy over all tokens, and ``centre_count``: the share of images whose
    per-token centre counts (argmax) sum to the scene's count; ``density_count``: the share whose per-token
    densities sum, rounded, to it."""
    model.eval()
    rng = random.Random(cfg.seed + 7)
    counts = {"token_centres": "centre_count", "token_density": "density_count"}  # whole-image count from tokens
    correct = {k: 0 for k in [*model.heads, *(model.token_heads.keys() - {"token_density"})]}
    correct.update({counts[k]: 0 for k in counts if k in model.token_heads})
    object_tokens = all_tokens = 0
    for start in range(0, cfg.eval_images, 64):
        pv, grid, labels = _batch(processor, rng, min(64, cfg.eval_images - start), split, cfg.canvas, cfg.source,
                                  tuple(model.token_heads))
        out = model(pv, grid)
        for k in model.heads:
            correct[k] += int((out[k].argmax(-1) == labels[k]).sum())
        if not model.token_heads:
            continue
        on = labels["token_shape"] > 0
        for k in model.token_heads.keys() - {"token_density"}:
            hit = out[k].argmax(-1) == labels[k]
            correct[k] += int((hit if k == "token_centres" else hit & on).sum())
        if "token_centres" in model.token_heads:
            counted = out["token_centres"].argmax(-1).sum(-1)
            correct["centre_count"] += int((counted == labels["token_centres"].sum(-1)).sum())
        if "token_density" in model.token_heads:
            counted = out["token_density"].squeeze(-1).sum(-1).round()
            correct["density_count"] += int((counted == labels["token_density"].sum(-1).round()).sum())
        object_tokens += int(on.sum())
        all_tokens += on.numel()
    model.train()
    per = {"token_shape": object_tokens, "token_colour": object_tokens, "token_centres": all_tokens}
    return {k: v / per.get(k, cfg.eval_images) for k, v in correct.items()}


def pretrain_tower(cfg: PretrainTowerConfig, out_dir: str | Path, log=print) -> dict:
    """Train a seeded random MoonViT as a shape classifier and save it (``save_pretrained`` + the
    ``Kimi_K25ImageProcessor`` config) to ``out_dir``, with ``pretrain_metrics.json`` (loss curve and probe
    accuracy on the test split). Returns the metrics. Raises ValueError for ``token_weight``, ``centre_weight`` or
    ``density_weight`` without ``source: scenes``."""
    from transformers import Kimi_K25ImageProcessor, get_cosine_schedule_with_warmup

    t = cfg.tower
    if cfg.init:
        tower = tower_class(cfg.init).from_pretrained(cfg.init, dtype=torch.float32)
    else:
        tower = build_random_tower(build_tower_config(t.hidden_size, t.num_hidden_layers, t.num_attention_heads,
                                                      t.intermediate_size, t.pos_emb_height, t.pos_emb_width,
                                                      t.patch_stem, t.stem_channels, t.stem_strides,
                                                      t.stem_patch), cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.token_heads() and cfg.source != "scenes":
        raise ValueError("token_weight, centre_weight and density_weight need source: scenes (token targets come from "
                         "grafting.train.scenes)")
    model = TowerClassifier(tower, heads_of(cfg.source), token_heads=cfg.token_heads()).train()
    side = cfg.max_image_side // 14
    processor = Kimi_K25ImageProcessor(size={"max_height": side, "max_width": side})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, max(1, cfg.steps // 20), cfg.steps)
    rng = random.Random(cfg.seed)
    curve, t0 = [], time.perf_counter()
    for step in range(1, cfg.steps + 1):
        pv, grid, labels = _batch(processor, rng, cfg.batch_size, cfg.split, cfg.canvas, cfg.source, cfg.token_heads())
        out = model(pv, grid)
        loss = sum(nn.functional.cross_entropy(out[k], labels[k]) for k in model.heads)
        for k in model.token_heads:
            if k == "token_density":
                term = nn.functional.mse_loss(out[k].squeeze(-1), labels[k])
            else:
                term = nn.functional.cross_entropy(out[k].flatten(0, 1), labels[k].flatten())
            loss = loss + cfg.token_loss_weight(k) * term
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        curve.append(loss.item())
        if step % 50 == 0 or step == cfg.steps:
            log(f"pretrain-tower step {step}/{cfg.steps} loss {sum(curve[-50:]) / len(curve[-50:]):.4f} "
                f"{(time.perf_counter() - t0) / step:.3f} s/step")
    acc = probe_accuracy(model, processor, cfg, "test")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tower.eval().save_pretrained(out)
    processor.save_pretrained(out)
    metrics = {"config": cfg.model_dump(), "loss": curve, "test_probe_accuracy": acc,
               "seconds": time.perf_counter() - t0}
    (out / "pretrain_metrics.json").write_text(json.dumps(metrics))
    log(f"pretrain-tower test probe accuracy {acc}")
    return metrics
