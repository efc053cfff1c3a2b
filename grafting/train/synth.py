"""Synthetic shape images with captions and question/answer pairs, written as LLaVA-style JSONL.

Each scene holds 1-3 copies of one shape (circle, square, triangle) in one colour (red, green, blue, yellow) and
one size (small, large) on a plain or noisy background; a single shape also has a position (a quadrant).
Splits:
- ``train``: every colour/shape pair except :data:`HELD_OUT_PAIRS`, drawn with the train ranges.
- ``test``: all pairs (the held-out pairs never appear in training), drawn differently: other shape sizes
  (inside the small/large gap), other position jitter, other background colours and another noise kind.
- ``pretrain``: what the cpu tower is pretrained on (:mod:`grafting.train.pretrain`), standing in for the
  broad data a real encoder saw: the whole size range, random tints, both noise kinds and all colour/shape
  pairs (the graft's own captions and QA never show a held-out pair).
Rows follow LLaVA's format (arXiv:2304.08485): ``{"id", "image", "conversations": [{"from": "human"|"gpt",
"value"}]}`` with ``<image>`` marking the image; test rows add ``question_type``, ``choices``, ``answer_index``.
Images are drawn with PIL in-process (no downloads), seeded.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 215), "yellow": (230, 195, 30)}
SHAPES = ("circle", "square", "triangle")
SIZES = ("small", "large")
COUNTS = (1, 2, 3)
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
HELD_OUT_PAIRS = {("red", "triangle"), ("green", "square"), ("blue", "circle")}
NUMBER_WORDS = {1: "one", 2: "two", 3: "three"}

# How each split is drawn: shape side in pixels per size class, position jitter (pixels from the quadrant centre),
# plain background colours, noise kind. The test ranges sit between/outside the train ranges.
DRAW = {
    "train": {"small": (20, 28), "large": (44, 56), "jitter": (0, 8),
              "plain": [(255, 255, 255), (236, 236, 236), (250, 244, 228)], "noise": "gaussian"},
    "test": {"small": (29, 32), "large": (38, 43), "jitter": (9, 12),
             "plain": [(214, 214, 214), (244, 249, 255)], "noise": "uniform"},
    # tower pretraining (standing in for a generic pretrained encoder): the whole size range, random light
    # tints, both noise kinds, every colour/shape pair
    "pretrain": {"small": (16, 34), "large": (36, 60), "jitter": (0, 12), "plain": "random", "noise": "any"},
}

QUESTIONS = {
    "colour": ["What colour is the shape?", "What color are the shapes in the image?", "Which colour is shown?"],
    "shape": ["What shape is shown?", "Which shape is in the image?", "What kind of shape do you see?"],
    "count": ["How many shapes are there?", "How many objects are in the image?", "Count the shapes."],
    "size": ["Is the shape small or large?", "Are the shapes small or large?", "What size are the shapes?"],
    "position": ["Where is the shape?", "In which part of the image is the shape?", "Where is the object located?"],
}
CAPTION_PROMPTS = ["Describe the image.", "What is in this picture?", "Write a short caption for the image.",
                   "Describe what you see."]


def answer_choices(qtype: str) -> list[str]:
    """The multiple-choice options of a question type, written exactly as training answers are."""
    opts = {"colour": list(COLOURS), "shape": list(SHAPES), "count": [NUMBER_WORDS[c] for c in COUNTS],
            "size": list(SIZES), "position": list(POSITIONS)}[qtype]
    return [o.capitalize() + "." for o in opts]


@dataclass
class Scene:
    """One synthetic image: what is drawn and how. ``centres``/``side`` in pixels; ``position`` is None when
    ``count`` > 1."""

    colour: str
    shape: str
    size: str
    count: int
    background: str  # plain | noisy
    position: str | None
    side: int
    centres: list[tuple[int, int]] = field(default_factory=list)
    seed: int = 0

    def answer(self, qtype: str) -> str:
        """The answer to a question type, as trained (e.g. ``"Red."``)."""
        value = {"colour": self.colour, "shape": self.shape, "count": NUMBER_WORDS[self.count],
                 "size": self.size, "position": self.position}[qtype]
        return str(value).capitalize() + "."

    def question_types(self) -> list[str]:
        """Question types that have one right answer for this scene (position only for a single shape)."""
        return ["colour", "shape", "count", "size"] + (["position"] if self.position else [])

    def caption(self, rng: random.Random) -> str:
        """A one-sentence description naming colour, shape, size, count, position and background."""
        bg = "plain" if self.background == "plain" else "noisy"
        if self.count == 1:
            forms = [f"A {self.size} {self.colour} {self.shape} in the {self.position} of a {bg} background.",
                     f"The image shows a {self.size} {self.colour} {self.shape} in the {self.position}, "
                     f"on a {bg} background.",
                     f"There is one {self.size} {self.colour} {self.shape} in the {self.position}."]
        else:
            n = NUMBER_WORDS[self.count]
            forms = [f"{n.capitalize()} {self.size} {self.colour} {self.shape}s on a {bg} background.",
                     f"The image shows {n} {self.size} {self.colour} {self.shape}s on a {bg} background.",
                     f"There are {n} {self.size} {self.colour} {self.shape}s."]
        return rng.choice(forms)


def sample_scene(rng: random.Random, split: str = "train", canvas: int = 112) -> Scene:
    """Draw a random scene description for ``split`` (train never yields a held-out colour/shape pair).

    Raises ValueError for an unknown split."""
    if split not in DRAW:
        raise ValueError(f"split must be one of {list(DRAW)}")
    d = DRAW[split]
    while True:
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        if split == "train" and (colour, shape) in HELD_OUT_PAIRS:
            continue
        count = rng.choices(COUNTS, weights=(2, 1, 1))[0]
        size = rng.choice(SIZES)
        side = rng.randint(*d[size])
        background = rng.choice(("plain", "noisy"))
        if count == 1:
            pos = rng.choice(POSITIONS)
            cy = canvas // 4 if pos.startswith("top") else 3 * canvas // 4
            cx = canvas // 4 if pos.endswith("left") else 3 * canvas // 4
            r, a = rng.uniform(*d["jitter"]), rng.uniform(0, 2 * np.pi)
            lo, hi = side // 2 + 1, canvas - side // 2 - 1
            centres = [(int(min(max(cx + r * np.cos(a), lo), hi)), int(min(max(cy + r * np.sin(a), lo), hi)))]
            return Scene(colour, shape, size, 1, background, pos, side, centres, rng.randrange(2**31))
        centres = _place(rng, count, side, canvas)
        if centres is not None:
            return Scene(colour, shape, size, count, background, None, side, centres, rng.randrange(2**31))


def _place(rng: random.Random, count: int, side: int, canvas: int, tries: int = 200):
    lo, hi = side // 2 + 2, canvas - side // 2 - 2
    for _ in range(tries):
        pts = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(count)]
        if all(max(abs(a[0] - b[0]), abs(a[1] - b[1])) > side + 4 for i, a in enumerate(pts) for b in pts[i + 1:]):
            return pts
    return None


def render(scene: Scene, split: str = "train", canvas: int = 112) -> Image.Image:
    """Draw a scene as a ``canvas`` x ``canvas`` RGB image (uint8), deterministic given ``scene.seed``."""
    d = DRAW[split]
    rng = np.random.default_rng(scene.seed)
    noise = d["noise"] if d["noise"] != "any" else ("gaussian", "uniform")[int(rng.integers(2))]
    if scene.background == "plain":
        base = (d["plain"][int(rng.integers(len(d["plain"])))] if d["plain"] != "random"
                else tuple(int(v) for v in rng.integers(200, 256, 3)))
        arr = np.broadcast_to(np.array(base, np.float32), (canvas, canvas, 3)).copy()
    elif noise == "gaussian":
        arr = rng.normal(205, 25, (canvas, canvas, 3))
    else:
        arr = rng.uniform(170, 250, (canvas, canvas, 1)).repeat(3, axis=2) + rng.uniform(-15, 15, (canvas, canvas, 3))
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    colour = tuple(int(np.clip(c + rng.integers(-15, 16), 0, 255)) for c in COLOURS[scene.colour])
    h = scene.side / 2
    for cx, cy in scene.centres:
        if scene.shape == "circle":
            draw.ellipse([cx - h, cy - h, cx + h, cy + h], fill=colour)
        elif scene.shape == "square":
            draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=colour)
        else:
            draw.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=colour)
    return img


def conversations(scene: Scene, rng: random.Random, kind: str) -> list[dict]:
    """LLaVA conversation for a scene: ``caption`` (one turn) or ``qa`` (every question type, shuffled, one
    per turn; the image goes with the first question)."""
    if kind == "caption":
        return [{"from": "human", "value": "<image>\n" + rng.choice(CAPTION_PROMPTS)},
                {"from": "gpt", "value": scene.caption(rng)}]
    types = scene.question_types()
    rng.shuffle(types)
    conv = []
    for i, t in enumerate(types):
        q = rng.choice(QUESTIONS[t])
        conv += [{"from": "human", "value": ("<image>\n" if i == 0 else "") + q}, {"from": "gpt", "value": scene.answer(t)}]
    return conv


def write_dataset(out_dir: str | Path, n_train: int = 2000, n_test: int = 200, seed: int = 0,
                  canvas: int = 112) -> dict[str, Path]:
    """Write ``images/*.png``, ``captions.jsonl``, ``qa.jsonl`` (train) and ``test.jsonl`` (held-out
    multiple-choice questions, one per row) under ``out_dir``; returns the JSONL paths by name.

    Train rows: one caption row and one multi-turn QA row per image. Test: ``n_test`` images, one question row
    per applicable question type, with ``question_type``, ``choices``, ``answer_index``, ``held_out_pair``.
    """
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cap, qa, test = [], [], []
    for i in range(n_train):
        s = sample_scene(rng, "train", canvas)
        rel = f"images/train-{i:06d}.png"
        render(s, "train", canvas).save(out / rel)
        meta = {"scene": asdict(s)}
        cap.append({"id": f"train-{i:06d}-caption", "image": rel, "conversations": conversations(s, rng, "caption"), **meta})
        qa.append({"id": f"train-{i:06d}-qa", "image": rel, "conversations": conversations(s, rng, "qa"), **meta})
    test_rng = random.Random(seed + 1_000_003)
    for i in range(n_test):
        s = sample_scene(test_rng, "test", canvas)
        rel = f"images/test-{i:06d}.png"
        render(s, "test", canvas).save(out / rel)
        for t in s.question_types():
            choices = answer_choices(t)
            test.append({"id": f"test-{i:06d}-{t}", "image": rel, "question_type": t, "choices": choices,
                         "answer_index": choices.index(s.answer(t)),
                         "held_out_pair": (s.colour, s.shape) in HELD_OUT_PAIRS,
                         "conversations": [{"from": "human", "value": "<image>\n" + test_rng.choice(QUESTIONS[t])},
                                           {"from": "gpt", "value": s.answer(t)}], "scene": asdict(s)})
    paths = {}
    for name, rows in (("captions", cap), ("qa", qa), ("test", test)):
        paths[name] = out / f"{name}.jsonl"
        with open(paths[name], "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return paths
