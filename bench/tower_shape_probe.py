"""Is the varied-scene data learnable, and how far is the cpu profile's MoonViT tower from it? (issue 15)

Trains two classifiers side by side, on the same batches of :mod:`grafting.train.scenes` training renderings, for the
same steps with the same optimiser (AdamW, 5% warmup, cosine):

1. the cpu profile's tower: the shipped small MoonViT (``grafting/assets/cpu_shapes/tower``, 1.35M parameters,
   patch 14) with :class:`grafting.train.pretrain.TowerClassifier`'s heads, exactly as ``chimera graft
   pretrain-tower --source scenes --init grafting/assets/cpu_shapes/tower`` trains it;
2. a reference: a plain 6-layer CNN (3x3 convolutions, BatchNorm, GELU, 0.44M parameters at width 32) with
   the same heads on the mean of its 8x8 feature map. It is a yardstick for the data, not a tower: the graft
   keeps MoonViT.

Every ``--eval-every`` steps both are probed on the same 256 held-out renderings (the ``test`` split: gradient
backgrounds, held-out size band; chance: colour 25%, shape and count 33%) and one line per model is printed;
the last lines give the MoonViT / CNN accuracy ratio per head. If the CNN reaches the issue's targets on these
renderings while the tower does not, the data is learnable and what limits the graft is the from-scratch ViT
(no locality prior: Dosovitskiy et al., arXiv:2010.11929, sec. 4.2; Xiao et al., arXiv:2106.14881).

    .venv/bin/python bench/tower_shape_probe.py [--steps 1500] [--batch-size 32] [--eval-every 250]

One thread, both models and the rendering: 2159 s for the default 1500 steps beside other jobs on the 2-core machine.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from torch import nn
from transformers import Kimi_K25ImageProcessor, Kimi_K25VisionModel, get_cosine_schedule_with_warmup

from grafting.train import scenes as sc
from grafting.train.pretrain import TowerClassifier

HEADS = sc.TOWER_HEADS
TOWER = "grafting/assets/cpu_shapes/tower"


class ReferenceCNN(nn.Module):
    """Six 3x3 conv blocks (strides 2, 1, 2, 1, 2, 1; widths w, w, 2w, 2w, 4w, 4w), pooled to an 8x8 map, one more
    block, then one linear head per :data:`grafting.train.scenes.TOWER_HEADS` on the map's mean.

    forward(images ``(B, 3, H, W)`` float in [-1, 1]) -> ``{head: (B, classes)}`` logits."""

    def __init__(self, width: int = 32):
        super().__init__()

        def block(i: int, o: int, s: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, 3, s, 1, bias=False), nn.BatchNorm2d(o), nn.GELU())

        w = width
        self.body = nn.Sequential(block(3, w, 2), block(w, w, 1), block(w, 2 * w, 2), block(2 * w, 2 * w, 1),
                                  block(2 * w, 4 * w, 2), block(4 * w, 4 * w, 1), nn.AdaptiveAvgPool2d(8),
                                  block(4 * w, 4 * w, 1))
        self.heads = nn.ModuleDict({k: nn.Linear(4 * w, len(v)) for k, v in HEADS.items()})

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Logits per head, ``{name: (B, classes)}`` float."""
        pooled = self.body(images).mean(dim=(2, 3))
        return {k: h(pooled) for k, h in self.heads.items()}


def draw(rng: random.Random, n: int, split: str, canvas: int):
    """``n`` scenes of ``split``: uint8 images ``(n, canvas, canvas, 3)`` and labels ``{head: (n,)}`` int64."""
    scenes = [sc.sample_scene(rng, split, canvas) for _ in range(n)]
    images = np.stack([np.asarray(sc.render(s, canvas)) for s in scenes])
    labels = [sc.tower_labels(s) for s in scenes]
    return images, {k: torch.tensor([lab[k] for lab in labels]) for k in HEADS}


def main() -> None:
    """Train both models side by side and print the held-out probe lines and the final ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--canvas", type=int, default=112)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    processor = Kimi_K25ImageProcessor(size={"max_height": 16, "max_width": 16})
    tower = TowerClassifier(Kimi_K25VisionModel.from_pretrained(TOWER, dtype=torch.float32), HEADS).train()
    cnn = ReferenceCNN().train()
    models = {"moonvit": tower, "cnn": cnn}
    for name, m in models.items():
        n = sum(p.numel() for p in (m.tower if name == "moonvit" else m).parameters())
        print(f"{name}: {n / 1e6:.2f}M parameters", flush=True)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.05) for k, m in models.items()}
    scheds = {k: get_cosine_schedule_with_warmup(o, max(1, a.steps // 20), a.steps) for k, o in opts.items()}
    test_images, test_labels = draw(random.Random(a.seed + 7), 256, "test", a.canvas)

    def inputs(name: str, images: np.ndarray):
        if name == "cnn":
            return (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1,)
        from PIL import Image

        f = processor(images=[Image.fromarray(x) for x in images], return_tensors="pt")
        return f["pixel_values"], f["image_grid_thw"]

    @torch.no_grad()
    def probe(name: str) -> dict[str, float]:
        m = models[name].eval()
        preds = {k: [] for k in HEADS}
        for i in range(0, len(test_images), 64):
            out = m(*inputs(name, test_images[i:i + 64]))
            for k in HEADS:
                preds[k].append(out[k].argmax(-1))
        m.train()
        return {k: float((torch.cat(preds[k]) == test_labels[k]).float().mean()) for k in HEADS}

    rng, t0, last = random.Random(a.seed), time.perf_counter(), {}
    for step in range(1, a.steps + 1):
        images, labels = draw(rng, a.batch_size, "train", a.canvas)
        for name, m in models.items():
            out = m(*inputs(name, images))
            loss = sum(nn.functional.cross_entropy(out[k], labels[k]) for k in HEADS)
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[name].step()
            scheds[name].step()
        if step % a.eval_every == 0 or step == a.steps:
            for name in models:
                last[name] = probe(name)
                acc = "  ".join(f"{k} {v:6.1%}" for k, v in last[name].items())
                print(f"step {step:5d} {name:8s} held-out {acc}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    ratio = "  ".join(f"{k} {last['moonvit'][k] / max(last['cnn'][k], 1e-9):.2f}" for k in HEADS)
    print(f"moonvit / cnn held-out accuracy after {a.steps} steps: {ratio}")


if __name__ == "__main__":
    main()
