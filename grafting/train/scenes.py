"""Varied synthetic scenes and everyday questions about them, with held-out phrasings and renderings (issue 15).

A scene holds 1-3 copies of one shape (circle, square, triangle) in one colour (red, green, blue, yellow), each
copy its own size (a fraction of the canvas side: 10-80% for one object, less for several), shade, rotation
(squares and triangles) and filled or outlined, on one background family: plain light, plain dark, noise,
scikit-image photographs (``skimage.data``, shipped in its wheel) or gradients.

Held out from all training (tower pretraining, captions, QA):
- renderings: the ``gradient`` background family and single objects of 40-50% of the canvas
  (:data:`HELD_OUT_SIZE`); the ``test`` split draws every image on a gradient, and half of its single objects
  from that size band;
- phrasings: a set of question stems per question type and a set of format instructions
  (:data:`STEMS`, :data:`INSTRUCTIONS`: the ``test`` entries), used only by the ``test`` split.

Question types: ``colour``, ``shape``, ``count``, ``yesno`` (is it red / a circle),
``multi`` (colour and shape at once), ``position`` (quadrant of one small object), ``size`` (small < 25% of the
canvas, large > 55%). Answer styles follow the instruction: ``short`` ("Red."), ``word`` (one word, "Red"),
``sentence`` ("The shape is red."). Rows are LLaVA JSONL (arXiv:2304.08485) like :mod:`grafting.train.synth`; test
rows add ``question_type``, ``style``, ``choices`` (every possible answer written in the row's style),
``answer_index``, ``answer_word`` and ``held_out_pair`` (here: the object is in the held-out size band).
Images are drawn with PIL in-process, seeded; no downloads.
"""

from __future__ import annotations

import colorsys
import json
import math
import random
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 215), "yellow": (230, 195, 30)}
SHAPES = ("circle", "square", "triangle")
COUNTS = (1, 2, 3)
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
SIZE_WORDS = ("small", "large")
NUMBER_WORDS = {1: "one", 2: "two", 3: "three"}
TRAIN_BACKGROUNDS = ("light", "dark", "noise", "photo")
HELD_OUT_BACKGROUND = "gradient"
HELD_OUT_SIZE = (0.40, 0.50)  # single-object side as a fraction of the canvas, never in training
# Canvas side in pixels of the scenes the shipped cpu graft (grafting/assets/cpu_scenes224, issue 27) was trained
# on: 64 merged image tokens a scene. Scenes sent to the served graft (quantization and speculator traffic, benches,
# tests) are drawn at this size; the functions' default canvas (112) is that of the earlier rounds' data.
SERVED_CANVAS = 224
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "brick", "grass", "gravel", "moon", "page",
          "text", "coins", "clock", "horse")
QTYPES = ("colour", "shape", "count", "yesno", "multi", "position", "size")
STYLES = ("short", "word", "sentence")

# Question stems per type; {c} = colour/color, {obj}/{objs} = "shape"/"object"/... Train and held-out test sets
# never share a stem. yes/no stems take {attr}: "red" / "a circle".
STEMS = {
    "colour": {
        "train": ["What {c} is the {obj}?", "What {c} are the {objs}?", "Which {c} is shown?", "Name the {c} of the {obj}.",
                  "What is the {c} of the {obj}?", "Tell me the {c} of the {objs}.", "What {c} do you see?",
                  "Which {c} are the {objs} in the picture?", "Identify the {c} of the {obj}.",
                  "What {c} has the {obj} in this image?", "The {obj} is which {c}?", "Say the {c} of the {objs}.",
                  "What {c} is the {obj} in the image?", "Which {c} does the {obj} have?",
                  "Can you tell me what {c} the {obj} is?", "What's the {c} of the {obj}?"],
        "test": ["What {c} is used for the {obj}?", "Which {c} is the {obj} painted in?", "Of what {c} is the {obj}?",
                 "Could you name the {c} of the {obj} here?", "What {c} would you call the {obj}?",
                 "In which {c} is the {obj} drawn?"],
    },
    "shape": {
        "train": ["What shape is shown?", "Which shape is in the image?", "What kind of shape do you see?",
                  "What shape is the {obj}?", "Name the shape.", "What is the shape of the {obj}?",
                  "Identify the shape in the picture.", "What geometric shape is drawn?", "Which figure is shown?",
                  "What shape are the {objs}?", "Tell me the shape of the {objs}.", "What form does the {obj} have?",
                  "What's the shape in this image?", "Which shape do the {objs} have?",
                  "Can you tell me what shape this is?", "What type of shape is in the picture?"],
        "test": ["What shape has been drawn here?", "Which geometric figure appears in the image?",
                 "What would you call the shape of the {obj}?", "Could you name the shape you see?",
                 "What is the outline of the {obj} like: which shape?", "Which shape is depicted?"],
    },
    "count": {
        "train": ["How many shapes are there?", "How many objects are in the image?", "Count the shapes.",
                  "How many {objs} do you see?", "What is the number of shapes?", "How many figures are drawn?",
                  "Count the {objs} in the picture.", "How many shapes are in this image?",
                  "Tell me how many {objs} there are.", "What number of {objs} is shown?",
                  "How many items are in the picture?", "How many {objs} can you count?",
                  "What's the count of shapes?", "How many things are drawn?", "Give the number of {objs}.",
                  "How many shapes can be seen?"],
        "test": ["How many shapes have been drawn?", "Could you count the {objs} for me?",
                 "What is the total number of {objs} in the image?", "How many separate shapes appear here?",
                 "Count how many {objs} are visible.", "How many of them are there?"],
    },
    "yesno": {
        "train": ["Is the {obj} {attr}?", "Is it {attr}?", "Are the {objs} {attr}?", "Is this {attr}?",
                  "Would you say the {obj} is {attr}?", "Is the {obj} in the image {attr}?",
                  "Do you see something {attr}?", "Is what you see {attr}?", "Is the picture showing {attr}?",
                  "Is the figure {attr}?", "Answer yes or no: is it {attr}?", "Is the drawn {obj} {attr}?",
                  "Can you confirm the {obj} is {attr}?", "Is the {obj} shown {attr}?", "Is that {attr}?",
                  "Yes or no, is the {obj} {attr}?"],
        "test": ["Would you describe it as {attr}?", "Is the {obj} here {attr}, yes or no?",
                 "Does the image show something {attr}?", "Am I right that it is {attr}?",
                 "True or false (answer yes or no): the {obj} is {attr}.", "Is the thing drawn {attr}?"],
    },
    "multi": {
        "train": ["What {c} and shape is the {obj}?", "Describe the {obj}'s {c} and shape.",
                  "What {c} and what shape is shown?", "Name the {c} and the shape.",
                  "Which {c} and shape do the {objs} have?", "Tell me the shape and {c} of the {obj}.",
                  "What shape and {c} is in the image?", "Give the {c} and shape of the {objs}.",
                  "What is the {c} and the shape of the {obj}?", "Identify both the {c} and the shape.",
                  "What are the {c} and shape of the {objs}?", "Say what {c} and shape the {obj} is.",
                  "What shape is it, and which {c}?", "Which shape and which {c} do you see?",
                  "What {c} and form does the {obj} have?", "Tell me the {obj}'s shape and {c}."],
        "test": ["Could you give me both the {c} and the shape?", "What does the {obj} look like ({c} and shape)?",
                 "Which {c} is it, and which shape?", "Name the shape of the {obj} together with its {c}.",
                 "What {c} and which geometric shape appear?", "Describe its shape and {c}."],
    },
    "position": {
        "train": ["Where is the {obj}?", "In which part of the image is the {obj}?", "Where is the object located?",
                  "Which corner is the {obj} in?", "Where in the picture is the {obj}?", "Where can you see the {obj}?",
                  "In which quarter of the image is the {obj}?", "Where is the {obj} placed?",
                  "Which part of the picture holds the {obj}?", "Where does the {obj} sit?",
                  "Tell me where the {obj} is.", "What is the position of the {obj}?", "Where's the {obj}?",
                  "Locate the {obj}.", "In which corner do you see the {obj}?", "Where is the figure?"],
        "test": ["Whereabouts is the {obj} drawn?", "Which quadrant contains the {obj}?",
                 "Could you say where the {obj} is?", "In what region of the image is the {obj}?",
                 "Where has the {obj} been placed?", "Where would you find the {obj}?"],
    },
    "size": {
        "train": ["Is the {obj} small or large?", "Is the {obj} big or small?", "What size is the {obj}?",
                  "How big is the {obj}?", "Is it a small or a large {obj}?", "Is the {obj} large or small?",
                  "How large is the {obj}?", "Is the {obj} tiny or big?", "What is the size of the {obj}?",
                  "Tell me if the {obj} is small or large.", "Is the figure small or large?",
                  "Would you call the {obj} small or large?", "Is the object big or little?",
                  "How big is the figure?", "What size is the object?", "Small or large: which is the {obj}?"],
        "test": ["Does the {obj} look small or large?", "Is the {obj} drawn small or large?",
                 "How would you describe the size of the {obj}: small or large?", "Is this {obj} large or small?",
                 "What about its size: small or large?", "Is the {obj} of small or large size?"],
    },
}
# Format instructions appended to a stem, by answer style; "" = none (short answer).
INSTRUCTIONS = {
    "word": {"train": ["Answer with one word.", "Reply in one word.", "One word only.", "Use a single word.",
                       "Answer in a single word.", "Respond with one word.", "Just one word, please.",
                       "Give a one-word answer."],
             "test": ["Answer using only one word.", "Please respond with a single word.", "In one word."]},
    "sentence": {"train": ["Answer in a sentence.", "Reply with a full sentence.", "Use a complete sentence.",
                           "Answer with a short sentence.", "Respond in one sentence."],
                 "test": ["Please answer in a full sentence.", "Write your answer as a sentence."]},
    "short": {"train": ["", "", "", "Answer briefly.", "Be brief."], "test": ["", "Keep it short."]},
}
CAPTION_PROMPTS = ["Describe the image.", "What is in this picture?", "Write a short caption for the image.",
                   "Describe what you see.", "Give a caption.", "What does this image show?",
                   "Caption this picture.", "Tell me what is in the image."]


@dataclass
class Obj:
    """One drawn object: centre ``(x, y)`` and ``side`` in pixels (bounding square), ``angle`` in degrees,
    ``rgb`` (its shade), ``outline`` width in pixels (0 = filled)."""

    x: int
    y: int
    side: int
    angle: float
    rgb: tuple[int, int, int]
    outline: int


@dataclass
class Scene:
    """What one image shows and how it is drawn; ``position`` only for one object in a quadrant, ``size`` only
    for one object clearly small or large (else None); ``held_out_size``: the object is in
    :data:`HELD_OUT_SIZE`."""

    colour: str
    shape: str
    count: int
    background: str
    objects: list[Obj] = field(default_factory=list)
    position: str | None = None
    size: str | None = None
    held_out_size: bool = False
    seed: int = 0

    def question_types(self) -> list[str]:
        """Question types with one right answer for this scene."""
        return [t for t in QTYPES if (t != "position" or self.position) and (t != "size" or self.size)]

    def value(self, qtype: str) -> str:
        """The answer word(s) of a question type (``multi``: "red circle")."""
        return {"colour": self.colour, "shape": self.shape, "count": NUMBER_WORDS[self.count],
                "position": self.position, "size": self.size,
                "multi": f"{self.colour} {self.shape}"}[qtype]


def values(qtype: str) -> list[str]:
    """Every answer value of a question type, in a fixed order (the multiple-choice options)."""
    return {"colour": list(COLOURS), "shape": list(SHAPES), "count": [NUMBER_WORDS[c] for c in COUNTS],
            "yesno": ["yes", "no"], "multi": [f"{c} {s}" for c in COLOURS for s in SHAPES],
            "position": list(POSITIONS), "size": list(SIZE_WORDS)}[qtype]


def answer_text(qtype: str, value: str, style: str, count: int = 1) -> str:
    """An answer written in a style: ``short`` "Red." / "Red circle.", ``word`` "Red" (one word; ``multi`` has
    no one-word style), ``sentence`` "The shape is red.". ``count`` picks singular/plural sentences."""
    if style == "word":
        return value.capitalize()
    if style == "short":
        return value.capitalize() + "."
    it, be = ("The shape", "is") if count == 1 else ("The shapes", "are")
    return {"colour": f"{it} {be} {value}.",
            "shape": f"It is a {value}." if count == 1 else f"They are {value}s.",
            "count": f"There {'is' if value == 'one' else 'are'} {value} shape{'' if value == 'one' else 's'}.",
            "yesno": f"{value.capitalize()}, it is." if value == "yes" else "No, it is not.",
            "multi": f"It is a {value}." if count == 1 else f"They are {value}s.",
            "position": f"{it} is in the {value}.", "size": f"{it} {be} {value}."}[qtype]


def styles_for(qtype: str) -> tuple[str, ...]:
    """Answer styles a question type is asked in (``multi`` and ``position`` have no one-word form)."""
    return ("short", "sentence") if qtype in ("multi", "position") else STYLES


# -- scenes ---------------------------------------------------------------------------------------
def _shade(rng: random.Random, colour: str) -> tuple[int, int, int]:
    r, g, b = (v / 255 for v in COLOURS[colour])
    h, l, s = colorsys.rgb_to_hls(r, g, b)
    h = (h + rng.uniform(-0.025, 0.025)) % 1.0
    l = min(max(l * rng.uniform(0.75, 1.25), 0.22), 0.72)
    s = min(max(s * rng.uniform(0.75, 1.1), 0.45), 1.0)
    return tuple(int(round(255 * v)) for v in colorsys.hls_to_rgb(h, l, s))


def sample_scene(rng: random.Random, split: str = "train", canvas: int = 112) -> Scene:
    """A random scene for ``split``: ``train`` (every training background, sizes outside
    :data:`HELD_OUT_SIZE`) or ``test`` (gradient backgrounds; half of the single objects in the held-out size
    band). Raises ValueError for another split."""
    if split not in ("train", "test"):
        raise ValueError("split must be 'train' or 'test'")
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    count = rng.choice(COUNTS)
    background = rng.choice(TRAIN_BACKGROUNDS) if split == "train" else HELD_OUT_BACKGROUND
    outline = rng.random() < 0.3
    while True:
        objs, held = [], False
        if count == 1:
            if split == "test" and rng.random() < 0.5:
                frac, held = rng.uniform(*HELD_OUT_SIZE), True
            else:
                frac = rng.uniform(0.10, 0.80)
                while HELD_OUT_SIZE[0] <= frac <= HELD_OUT_SIZE[1]:
                    frac = rng.uniform(0.10, 0.80)
            fracs = [frac]
        else:
            top = 0.40 if count == 2 else 0.30
            fracs = [rng.uniform(0.10, top) for _ in range(count)]
        sides = [max(8, int(f * canvas)) for f in fracs]
        pts = _place(rng, sides, canvas)
        if pts is None:
            continue
        for (x, y), side in zip(pts, sides):
            angle = 0.0 if shape == "circle" or rng.random() < 0.4 else rng.uniform(-40, 40)
            width = max(2, side // 10) if outline else 0
            objs.append(Obj(x, y, side, angle, _shade(rng, colour), width))
        break
    position = size = None
    if count == 1:
        o = objs[0]
        if o.side <= 0.40 * canvas and abs(o.x - canvas / 2) > o.side / 2 + 2 and abs(o.y - canvas / 2) > o.side / 2 + 2:
            position = ("top" if o.y < canvas / 2 else "bottom") + " " + ("left" if o.x < canvas / 2 else "right")
        size = "small" if o.side < 0.25 * canvas else "large" if o.side > 0.55 * canvas else None
    return Scene(colour, shape, count, background, objs, position, size, held, rng.randrange(2**31))


def _place(rng: random.Random, sides: list[int], canvas: int, tries: int = 200):
    for _ in range(tries):
        pts = [(rng.randint(s // 2 + 2, canvas - s // 2 - 2), rng.randint(s // 2 + 2, canvas - s // 2 - 2)) for s in sides]
        if all(max(abs(a[0] - b[0]), abs(a[1] - b[1])) > (sa + sb) / 2 + 4
               for i, (a, sa) in enumerate(zip(pts, sides)) for b, sb in zip(pts[i + 1:], sides[i + 1:])):
            return pts
    return None


@lru_cache(maxsize=None)
def _photo(name: str) -> np.ndarray:
    import skimage.data

    arr = np.asarray(getattr(skimage.data, name)(), dtype=np.float32)
    if arr.ndim == 2:
        arr = arr[..., None].repeat(3, axis=2)
    return arr[..., :3]


def _background(rng: np.random.Generator, kind: str, canvas: int) -> np.ndarray:
    if kind == "light":
        return np.broadcast_to(rng.uniform(195, 255, 3).astype(np.float32), (canvas, canvas, 3)).copy()
    if kind == "dark":
        return np.broadcast_to(rng.uniform(0, 70, 3).astype(np.float32), (canvas, canvas, 3)).copy()
    if kind == "noise":
        mean = rng.uniform(60, 220)
        if rng.random() < 0.5:
            return rng.normal(mean, rng.uniform(10, 35), (canvas, canvas, 3)).astype(np.float32)
        return (rng.uniform(mean - 40, mean + 40, (canvas, canvas, 1)).repeat(3, axis=2)
                + rng.uniform(-15, 15, (canvas, canvas, 3))).astype(np.float32)
    if kind == "photo":
        src = _photo(PHOTOS[int(rng.integers(len(PHOTOS)))])
        h, w = src.shape[:2]
        crop = int(rng.integers(min(h, w) // 3, min(h, w) + 1))
        y0, x0 = int(rng.integers(0, h - crop + 1)), int(rng.integers(0, w - crop + 1))
        im = Image.fromarray(src[y0:y0 + crop, x0:x0 + crop].astype(np.uint8)).resize((canvas, canvas), Image.BILINEAR)
        grey = rng.uniform(80, 200)
        a = rng.uniform(0.4, 1.0)  # photographs toned down towards grey, as often behind an object
        return a * np.asarray(im, np.float32) + (1 - a) * grey
    if kind == "gradient":
        grey = rng.uniform(40, 220)
        c0, c1 = (grey + 0.5 * (rng.uniform(0, 255, 3) - grey) for _ in range(2))  # half-saturated ends
        t = rng.uniform(0, 2 * math.pi)
        yy, xx = np.mgrid[0:canvas, 0:canvas] / (canvas - 1)
        ramp = ((xx * math.cos(t) + yy * math.sin(t)) - min(0, math.cos(t)) - min(0, math.sin(t)))
        ramp = ramp / ramp.max()
        return (c0 * (1 - ramp[..., None]) + c1 * ramp[..., None]).astype(np.float32)
    raise ValueError(f"unknown background {kind!r}")


def _polygon(shape: str, o: Obj) -> list[tuple[float, float]]:
    h = o.side / 2
    pts = [(-h, -h), (h, -h), (h, h), (-h, h)] if shape == "square" else [(0, -h), (h, h), (-h, h)]
    a = math.radians(o.angle)
    return [(o.x + px * math.cos(a) - py * math.sin(a), o.y + px * math.sin(a) + py * math.cos(a)) for px, py in pts]


def _fill(draw: ImageDraw.ImageDraw, shape: str, o: Obj, value: int) -> None:
    """Draw object ``o`` filled with ``value`` (its whole area, even when it is rendered outlined)."""
    if shape == "circle":
        h = o.side / 2
        draw.ellipse([o.x - h, o.y - h, o.x + h, o.y + h], fill=value)
    else:
        draw.polygon(_polygon(shape, o), fill=value)


def render(scene: Scene, canvas: int = 112) -> Image.Image:
    """Draw a scene as a ``canvas`` x ``canvas`` RGB image (uint8), deterministic given ``scene.seed``."""
    rng = np.random.default_rng(scene.seed)
    img = Image.fromarray(np.clip(_background(rng, scene.background, canvas), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for o in scene.objects:
        fill, line = (None, o.rgb) if o.outline else (o.rgb, None)
        if scene.shape == "circle":
            h = o.side / 2
            draw.ellipse([o.x - h, o.y - h, o.x + h, o.y + h], fill=fill, outline=line, width=o.outline or 1)
        else:
            draw.polygon(_polygon(scene.shape, o), fill=fill, outline=line, width=o.outline or 1)
    return img


# -- questions and captions -----------------------------------------------------------------------
def ask(rng: random.Random, scene: Scene, qtype: str, phrasing: str = "train", style: str | None = None) -> dict:
    """One question about ``scene``: ``{"question", "answer", "style", "choices", "answer_index",
    "answer_word"}``, the stem and instruction drawn from the ``phrasing`` set (``train`` | ``test``).
    ``yesno`` asks about the scene's colour or shape, true half of the time."""
    style = style or rng.choice(styles_for(qtype))
    obj, objs = rng.choice([("shape", "shapes"), ("object", "objects"), ("figure", "figures")])
    attr, truth = "", None
    if qtype == "yesno":
        about = rng.choice(("colour", "shape"))
        truth = rng.random() < 0.5
        pool = [v for v in values(about) if (v == scene.value(about)) == truth]
        v = rng.choice(pool)
        attr = v if about == "colour" else f"a {v}"
    stem = rng.choice(STEMS[qtype][phrasing]).format(c=rng.choice(("colour", "color")), obj=obj, objs=objs, attr=attr)
    instr = rng.choice(INSTRUCTIONS[style][phrasing])
    question = (stem + " " + instr).strip()
    right = ("yes" if truth else "no") if qtype == "yesno" else scene.value(qtype)
    choices = [answer_text(qtype, v, style, scene.count) for v in values(qtype)]
    return {"question": question, "answer": answer_text(qtype, right, style, scene.count), "style": style,
            "choices": choices, "answer_index": values(qtype).index(right), "answer_word": right}


def caption(rng: random.Random, scene: Scene) -> str:
    """A one-sentence description: count, colour, shape, filled/outlined, size or position, background."""
    bg = {"light": "a light background", "dark": "a dark background", "noise": "a noisy background",
          "photo": "a photograph", "gradient": "a gradient"}[scene.background]
    kind = "outlined " if scene.objects[0].outline else ""
    if scene.count == 1:
        where = f" in the {scene.position}" if scene.position else ""
        size = f"{scene.size} " if scene.size else ""
        forms = [f"A {size}{kind}{scene.colour} {scene.shape}{where} on {bg}.",
                 f"The image shows a {size}{kind}{scene.colour} {scene.shape}{where}, on {bg}.",
                 f"There is one {kind}{scene.colour} {scene.shape}{where}.",
                 f"One {scene.colour} {scene.shape} on {bg}."]
    else:
        n = NUMBER_WORDS[scene.count]
        forms = [f"{n.capitalize()} {kind}{scene.colour} {scene.shape}s on {bg}.",
                 f"The image shows {n} {kind}{scene.colour} {scene.shape}s on {bg}.",
                 f"There are {n} {scene.colour} {scene.shape}s.", f"{n.capitalize()} {scene.colour} {scene.shape}s."]
    return rng.choice(forms)


def qa_conversation(rng: random.Random, scene: Scene, turns: int = 3) -> list[dict]:
    """A multi-turn LLaVA conversation: ``turns`` questions of distinct types (train phrasings, mixed styles);
    the image goes with the first."""
    types = scene.question_types()
    rng.shuffle(types)
    conv = []
    for i, t in enumerate(types[:turns]):
        q = ask(rng, scene, t, "train")
        conv += [{"from": "human", "value": ("<image>\n" if i == 0 else "") + q["question"]},
                 {"from": "gpt", "value": q["answer"]}]
    return conv


def _write(path: Path, rows: list[dict]) -> Path:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_dataset(out_dir: str | Path, n_train: int = 3000, n_test: int = 300, seed: int = 0,
                  canvas: int = 112) -> dict[str, Path]:
    """Write ``images/*.png``, ``captions.jsonl`` and ``qa.jsonl`` (train renderings, train phrasings; one
    caption row and one 3-turn QA row per image) and ``test.jsonl`` (held-out renderings asked with held-out
    phrasings: one single-turn row per image and applicable question type) under ``out_dir``; returns the JSONL
    paths by name."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cap, qa, test = [], [], []
    for i in range(n_train):
        s = sample_scene(rng, "train", canvas)
        rel = f"images/train-{i:06d}.png"
        render(s, canvas).save(out / rel)
        meta = {"scene": asdict(s)}
        cap.append({"id": f"train-{i:06d}-caption", "image": rel, **meta, "conversations": [
            {"from": "human", "value": "<image>\n" + rng.choice(CAPTION_PROMPTS)}, {"from": "gpt", "value": caption(rng, s)}]})
        qa.append({"id": f"train-{i:06d}-qa", "image": rel, "conversations": qa_conversation(rng, s), **meta})
    trng = random.Random(seed + 1_000_003)
    for i in range(n_test):
        s = sample_scene(trng, "test", canvas)
        rel = f"images/test-{i:06d}.png"
        render(s, canvas).save(out / rel)
        for t in s.question_types():
            q = ask(trng, s, t, "test")
            test.append({"id": f"test-{i:06d}-{t}", "image": rel, "question_type": t, "style": q["style"],
                         "choices": q["choices"], "answer_index": q["answer_index"], "answer_word": q["answer_word"],
                         "held_out_pair": s.held_out_size, "scene": asdict(s),
                         "conversations": [{"from": "human", "value": "<image>\n" + q["question"]},
                                           {"from": "gpt", "value": q["answer"]}]})
    return {"captions": _write(out / "captions.jsonl", cap), "qa": _write(out / "qa.jsonl", qa),
            "test": _write(out / "test.jsonl", test)}


def _token_grid(canvas: int, cell: int) -> int:
    """Merged tokens per side of a ``canvas``-px scene with ``cell``-px tokens. Raises ValueError when ``canvas`` is
    not a multiple of ``cell``."""
    if canvas % cell:
        raise ValueError(f"canvas {canvas} is not a multiple of the token cell {cell}")
    return canvas // cell


def token_targets(scene: Scene, canvas: int = 112, cell: int = 28,
                  min_cover: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Per merged tower token (a ``cell`` x ``cell`` pixel square: two 14-px patches merged 2x2, row-major over the
    ``canvas // cell`` grid), which object class it shows: ``(shape, colour)`` int64 arrays of ``(canvas // cell)**2``,
    0 = background, else 1 + the index in :data:`SHAPES` / :data:`COLOURS`, where the scene's objects (drawn
    filled, even when outlined) cover at least ``min_cover`` of the cell's pixels. Dense targets for tower
    pretraining (:mod:`grafting.train.pretrain`, ``token_weight``). Raises ValueError when ``canvas`` is not a
    multiple of ``cell``."""
    g = _token_grid(canvas, cell)
    mask = Image.new("L", (canvas, canvas), 0)
    draw = ImageDraw.Draw(mask)
    for o in scene.objects:
        _fill(draw, scene.shape, o, 255)
    on = (np.asarray(mask, np.float32).reshape(g, cell, g, cell).mean(axis=(1, 3)) / 255 >= min_cover).reshape(-1)
    shape = np.where(on, 1 + SHAPES.index(scene.shape), 0).astype(np.int64)
    colour = np.where(on, 1 + list(COLOURS).index(scene.colour), 0).astype(np.int64)
    return shape, colour


def centre_targets(scene: Scene, canvas: int = 112, cell: int = 28) -> np.ndarray:
    """Per merged tower token (a ``cell`` x ``cell`` pixel square, row-major over the ``canvas // cell`` grid, as
    in :func:`token_targets`), how many of the scene's object centres fall in it: int64 array of
    ``(canvas // cell)**2``, values 0..``max(COUNTS)``, summing to ``scene.count``. A dense count target for tower
    pretraining (:mod:`grafting.train.pretrain`, ``centre_weight``): objects become separate tokens' business, in
    the spirit of centre heatmaps for counting and detection (Zhou et al. 2019, "Objects as Points",
    arXiv:1904.07850). Raises ValueError when ``canvas`` is not a multiple of ``cell``."""
    g = _token_grid(canvas, cell)
    out = np.zeros(g * g, np.int64)
    for o in scene.objects:
        out[min(o.y // cell, g - 1) * g + min(o.x // cell, g - 1)] += 1
    return out


def density_targets(scene: Scene, canvas: int = 112, cell: int = 28) -> np.ndarray:
    """Per merged tower token (a ``cell`` x ``cell`` pixel square, row-major over the ``canvas // cell`` grid, as
    in :func:`token_targets`), the share of each object's drawn (filled) area that lies in it, summed over the
    objects: float32 array of ``(canvas // cell)**2``, each value in [0, count], summing to ``scene.count`` (up to
    float rounding). A density-map count target for tower pretraining (:mod:`grafting.train.pretrain`,
    ``density_weight``; Lempitsky and Zisserman 2010, "Learning to count objects in images"): unlike a centre's
    cell, it has no hard boundary to guess. Raises ValueError when ``canvas`` is not a multiple of ``cell``."""
    g = _token_grid(canvas, cell)
    out = np.zeros(g * g, np.float64)
    for o in scene.objects:
        mask = Image.new("L", (canvas, canvas), 0)
        _fill(ImageDraw.Draw(mask), scene.shape, o, 1)
        per_cell = np.asarray(mask, np.float64).reshape(g, cell, g, cell).sum(axis=(1, 3)).reshape(-1)
        out += per_cell / per_cell.sum()
    return out.astype(np.float32)


TOWER_HEADS = {"colour": list(COLOURS), "shape": list(SHAPES), "count": list(COUNTS),
               "position": list(POSITIONS) + [None], "size": list(SIZE_WORDS) + [None], "outline": [False, True]}


def tower_labels(scene: Scene) -> dict[str, int]:
    """Class index per :data:`TOWER_HEADS` head (tower pretraining on these scenes)."""
    v = {"colour": scene.colour, "shape": scene.shape, "count": scene.count, "position": scene.position,
         "size": scene.size, "outline": bool(scene.objects[0].outline)}
    return {k: TOWER_HEADS[k].index(v[k]) for k in TOWER_HEADS}
