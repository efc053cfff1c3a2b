"""Synthetic data, LLaVA JSONL reading, assistant-only labels, batching; MMStar/MMMU-Pro readers on fixtures."""

from __future__ import annotations

import base64
import io
import json
import random

import pytest
import torch
from PIL import Image

from grafting.train.synth import HELD_OUT_PAIRS, DRAW, answer_choices, render, sample_scene, write_dataset


@pytest.fixture(scope="module")
def processor(model_dir):
    from transformers import Kimi_K25ImageProcessor

    from core.smollm2 import smollm2_tokenizer
    from grafting.processor import GraftProcessor

    return GraftProcessor(smollm2_tokenizer(model_dir), Kimi_K25ImageProcessor(size={"max_height": 16, "max_width": 16}),
                          ("<jupyter_start>", "<jupyter_code>", "<jupyter_output>"))


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("synth"), n_train=40, n_test=20, seed=3)


def test_synth_splits_hold_out_pairs_and_draw_test_differently(synth):
    rows = [json.loads(l) for l in synth["qa"].read_text().splitlines()]
    test = [json.loads(l) for l in synth["test"].read_text().splitlines()]
    assert len(rows) == 40 and all((r["scene"]["colour"], r["scene"]["shape"]) not in HELD_OUT_PAIRS for r in rows)
    for r in rows:
        lo, hi = DRAW["train"][r["scene"]["size"]]
        assert lo <= r["scene"]["side"] <= hi
    for r in test:
        lo, hi = DRAW["test"][r["scene"]["size"]]
        assert lo <= r["scene"]["side"] <= hi
        assert r["choices"][r["answer_index"]] == r["conversations"][1]["value"]
        assert r["held_out_pair"] == ((r["scene"]["colour"], r["scene"]["shape"]) in HELD_OUT_PAIRS)
    # test images are a different size range than training: the two never overlap
    assert DRAW["test"]["small"][0] > DRAW["train"]["small"][1] and DRAW["test"]["large"][1] < DRAW["train"]["large"][0]
    assert {r["question_type"] for r in test} == {"colour", "shape", "count", "size", "position"}
    img = Image.open(synth["qa"].parent / rows[0]["image"])
    assert img.size == (112, 112) and img.mode == "RGB"


def test_render_is_seeded_and_draws_the_colour():
    rng = random.Random(0)
    s = sample_scene(rng, "train")
    a, b = render(s), render(s)
    assert a.tobytes() == b.tobytes()
    cx, cy = s.centres[0]
    px = a.getpixel((cx, cy + (s.side // 4 if s.shape == "triangle" else 0)))
    ref = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 215), "yellow": (230, 195, 30)}[s.colour]
    assert max(abs(p - r) for p, r in zip(px, ref)) <= 15
    assert answer_choices("colour") == ["Red.", "Green.", "Blue.", "Yellow."]
    with pytest.raises(ValueError):
        sample_scene(rng, "nope")


def test_labels_cover_every_assistant_turn_and_nothing_else(processor, synth):
    from grafting.train.data import IGNORE, ConversationDataset, read_jsonl

    rows = read_jsonl(synth["qa"])
    enc = ConversationDataset(rows, processor)[0]
    tok = processor.tokenizer
    answers = [t["value"] for t in rows[0]["conversations"] if t["from"] == "gpt"]
    labelled = tok.decode([t for t, l in zip(enc.input_ids.tolist(), enc.labels.tolist()) if l != IGNORE])
    assert labelled == "".join(a + "<|im_end|>" for a in answers)
    assert len(answers) >= 4  # multi-turn
    ids = processor.image_token_ids
    span = (enc.input_ids == ids.image)
    assert int(span.sum()) == 16 and bool((enc.labels[span] == IGNORE).all())
    assert enc.pixel_values.shape == (64, 3, 14, 14) and enc.image_grid_thw.tolist() == [[1, 8, 8]]
    # labels match the ids wherever they are set
    keep = enc.labels != IGNORE
    assert torch.equal(enc.labels[keep], enc.input_ids[keep])


def test_collate_pads_right_and_keeps_image_order(processor, synth):
    from grafting.train.data import IGNORE, ConversationDataset, collate, read_jsonl

    ds = ConversationDataset(read_jsonl(synth["captions"])[:2] + read_jsonl(synth["qa"])[:1], processor)
    items = [ds[i] for i in range(3)]
    b = collate(items, pad_id=processor.tokenizer.pad_token_id)
    T = max(len(x.input_ids) for x in items)
    assert b["input_ids"].shape == (3, T) and b["attention_mask"].sum(1).tolist() == [len(x.input_ids) for x in items]
    assert b["attention_mask"][:, 0].all()  # right padding: every row starts with real tokens
    assert (b["labels"][b["attention_mask"] == 0] == IGNORE).all()
    assert torch.equal(b["pixel_values"], torch.cat([x.pixel_values for x in items]))
    with pytest.raises(ValueError, match="over max_len"):
        collate(items, 0, max_len=10)


def test_text_only_rows_and_bad_rows(processor, tmp_path):
    from grafting.train.data import ConversationDataset, read_jsonl, to_messages

    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"conversations": [{"from": "system", "value": "Be brief."},
                                               {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}) + "\n")
    enc = ConversationDataset(read_jsonl(p), processor)[0]
    assert enc.pixel_values is None and (enc.labels != -100).sum() == 3  # "Hello", ".", <|im_end|>
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_jsonl(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_jsonl(bad)
    with pytest.raises(ValueError, match="unknown conversation role"):
        to_messages({"conversations": [{"from": "robot", "value": "x"}]}, None)


def _png_b64(colour) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (30, 20), colour).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_mmstar_and_mmmu_pro_readers(tmp_path):
    from grafting.train.mcq import read_items

    tsv = tmp_path / "MMStar.tsv"
    header = "index\tquestion\tanswer\tcategory\tl2-category\tA\tB\tC\tD\timage\n"
    tsv.write_text(header + f"0\tWhat colour is it?\tB\tcoarse perception\timage style\tred\tblue\tgreen\tgrey\t{_png_b64('blue')}\n"
                   + f"1\tHow many?\tA\tinstance reasoning\tcount\tone\ttwo\t\t\t{json.dumps([_png_b64('red'), _png_b64('red')])}\n")
    items = read_items(tsv)
    assert [it.choices for it in items] == [["A", "B", "C", "D"], ["A", "B"]]
    assert [it.answer_index for it in items] == [1, 0]
    assert items[0].question_type == "coarse perception" and "B. blue" in items[0].question
    assert len(items[1].images) == 2 and items[1].images[0].size == (30, 20)

    jl = tmp_path / "mmmu_pro.jsonl"
    (tmp_path / "img.png").write_bytes(base64.b64decode(_png_b64("white")))
    jl.write_text(json.dumps({"id": "validation_Art_1", "question": "Which style is <image 1>?",
                              "options": "['Baroque', 'Cubism', 'Pop art']", "answer": "C", "subject": "Art",
                              "image_1": "img.png", "image_2": _png_b64("black")}) + "\n")
    it = read_items(jl)[0]
    assert it.choices == ["A", "B", "C"] and it.answer_index == 2 and it.question_type == "Art"
    assert "[image 1]" in it.question and "C. Pop art" in it.question
    assert it.images[0] == str(tmp_path / "img.png") and it.images[1].size == (30, 20)

    tsv.write_text(header + f"0\tq\tE\tx\ty\ta\tb\t\t\t{_png_b64('red')}\n")
    with pytest.raises(ValueError, match="answer 'E'"):
        read_items(tsv)
    jl.write_text(json.dumps({"question": "q", "options": "not a list", "answer": "A"}) + "\n")
    with pytest.raises(ValueError, match="options"):
        read_items(jl)
    with pytest.raises(ValueError, match="unsupported"):
        read_items(tmp_path / "x.parquet")
