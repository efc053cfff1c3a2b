"""Issue 15: varied scenes, held-out phrasings and renderings, the generated-answer checks and their table."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from grafting.train import scenes as sc
from grafting.train.freeform import one_word, read_answer, score_generated
from grafting.train.report import varied_table


SLOTS = {"c": "colou?r", "obj": "[a-z]+", "objs": "[a-z]+", "attr": "(?:a )?[a-z]+"}
ANY_INSTRUCTION = "(?: (?:" + "|".join(re.escape(i) for st in sc.INSTRUCTIONS.values() for v in st.values()
                                       for i in v if i) + "))?"


def _pattern(stem: str) -> re.Pattern:
    """A stem as a regex matching the whole question (stem, then at most one format instruction)."""
    rx = re.sub(r"\\\{([a-z]+)\\\}", lambda m: SLOTS[m.group(1)], re.escape(stem))
    return re.compile(rx + ANY_INSTRUCTION)


def test_at_least_30_phrasings_per_type_and_held_out_sets_are_disjoint():
    for t in sc.QTYPES:
        train = len(sc.STEMS[t]["train"]) * sum(len(sc.INSTRUCTIONS[s]["train"]) for s in sc.styles_for(t))
        assert train >= 30, t
        assert not set(sc.STEMS[t]["train"]) & set(sc.STEMS[t]["test"])
    for style in sc.STYLES:
        assert not {i for i in sc.INSTRUCTIONS[style]["train"] if i} & set(sc.INSTRUCTIONS[style]["test"])
    # both spellings are asked
    qs = {sc.ask(random.Random(i), sc.sample_scene(random.Random(i)), "colour")["question"] for i in range(60)}
    assert any("colour" in q for q in qs) and any("color" in q for q in qs)


def test_train_and_test_renderings_are_held_apart():
    rng = random.Random(0)
    train = [sc.sample_scene(rng, "train") for _ in range(300)]
    test = [sc.sample_scene(rng, "test") for _ in range(300)]
    assert {s.background for s in train} == set(sc.TRAIN_BACKGROUNDS)
    assert {s.background for s in test} == {sc.HELD_OUT_BACKGROUND}
    lo, hi = sc.HELD_OUT_SIZE
    for s in train:
        for o in s.objects:
            assert 0.10 * 112 - 1 <= o.side <= 0.80 * 112
        if s.count == 1:
            # side = int(fraction * 112): a training fraction outside the band gives a side outside its interior
            assert not s.held_out_size and not (lo * 112 + 1 <= s.objects[0].side <= hi * 112 - 1)
    held = [s for s in test if s.held_out_size]
    assert 30 < len(held) and all(int(lo * 112) <= s.objects[0].side <= int(hi * 112) for s in held)
    assert {s.count for s in train} == {1, 2, 3} and any(o.outline for s in train for o in s.objects)
    assert any(o.angle != 0 for s in train for o in s.objects)
    with pytest.raises(ValueError):
        sc.sample_scene(rng, "nope")


def test_render_is_seeded_and_draws_the_shade_at_a_filled_centre():
    rng = random.Random(5)
    s = next(s for s in (sc.sample_scene(rng) for _ in range(100))
             if s.shape != "triangle" and not s.objects[0].outline and s.objects[0].side > 20)
    a, b = sc.render(s), sc.render(s)
    assert a.tobytes() == b.tobytes() and a.size == (112, 112) and a.mode == "RGB"
    o = s.objects[0]
    assert a.getpixel((o.x, o.y)) == o.rgb


def test_questions_answers_and_choices_agree():
    rng = random.Random(1)
    for _ in range(200):
        s = sc.sample_scene(rng, "test")
        for t in s.question_types():
            q = sc.ask(rng, s, t, "test")
            assert q["choices"][q["answer_index"]] == q["answer"]
            assert len(set(q["choices"])) == len(q["choices"])
            if t != "yesno":
                assert q["answer_word"] == s.value(t)
            if q["style"] == "word":
                assert one_word(q["answer"]), q
            assert read_answer(q["answer"], t) == q["answer_word"], q
            assert any(_pattern(st).fullmatch(q["question"]) for st in sc.STEMS[t]["test"]), q
            assert not any(_pattern(st).fullmatch(q["question"]) for st in sc.STEMS[t]["train"]), q
            assert not any(q["question"].endswith(" " + i) for v in sc.INSTRUCTIONS.values() for i in v["train"] if i)


def test_dataset_files(tmp_path):
    paths = sc.write_dataset(tmp_path, n_train=6, n_test=4, seed=2)
    qa = [json.loads(line) for line in paths["qa"].read_text().splitlines()]
    test = [json.loads(line) for line in paths["test"].read_text().splitlines()]
    assert len(qa) == 6 and all(len(r["conversations"]) == 6 for r in qa)
    assert {r["question_type"] for r in test} >= {"colour", "shape", "count", "yesno", "multi"}
    assert all(r["scene"]["background"] == "gradient" for r in test)
    assert all(r["choices"][r["answer_index"]] == r["conversations"][1]["value"] for r in test)
    assert (tmp_path / test[0]["image"]).is_file()
    again = sc.write_dataset(tmp_path / "again", n_train=6, n_test=4, seed=2)
    assert again["test"].read_text() == paths["test"].read_text()


def test_one_word_and_reading_answers_out_of_text():
    assert one_word("Red") and one_word(" Red. ") and one_word("circle!")
    assert not one_word("Large red.") and not one_word("") and not one_word("2")
    assert read_answer("The shapes are blue.", "colour") == "blue"
    assert read_answer("Red and blue.", "colour") is None and read_answer("Large.", "colour") is None
    assert read_answer("They are triangles.", "shape") == "triangle"
    assert read_answer("There are 2 shapes.", "count") == "two"
    assert read_answer("Yes, it is.", "yesno") == "yes" and read_answer("It is.", "yesno") is None
    assert read_answer("A green square.", "multi") == "green square"
    assert read_answer("The shape is in the top left.", "position") == "top left"


def test_score_generated_counts_answers_and_the_one_word_format():
    def row(qtype, style, word, answer):
        return {"question_type": qtype, "style": style, "answer_word": word,
                "conversations": [{"value": f"<image>\n{qtype}?"}, {"value": answer}]}

    rows = [row("colour", "word", "red", "Red"), row("colour", "short", "blue", "Blue."),
            row("shape", "word", "circle", "Circle")]
    res = score_generated(rows, ["Red", "Green.", "A circle."])
    assert res["accuracy"] == {"colour": 0.5, "shape": 1.0} and res["n"] == {"colour": 2, "shape": 1}
    assert res["format_obeyed"] == 0.5 and res["format_n"] == 2
    assert res["format_failures"] == [("shape?", "A circle.")]
    assert res["samples"][1] == ("colour?", "Green.", "Blue.")
    assert res["confusion"] == {"colour": {"blue": {"green": 1}, "red": {"red": 1}}, "shape": {"circle": {"circle": 1}}}
    assert score_generated([row("count", "word", "two", "Two")], ["Many."])["confusion"] == {"count": {"two": {"none": 1}}}
    with pytest.raises(ValueError, match="3 rows but 2 texts"):
        score_generated(rows, ["Red", "Blue"])


def test_varied_table_prints_every_row():
    by = {"colour": 0.98, "shape": 0.5}
    ev = {"chance": {"colour": 0.25, "shape": 1 / 3},
          "image": {"by_type": by, "by_type_n": {"colour": 50, "shape": 40}},
          "blind": {"by_type": {"colour": 0.3, "shape": 0.3}, "by_type_n": {"colour": 50, "shape": 40}},
          "generated": {"accuracy": {"colour": 0.96, "shape": 0.5}, "format_obeyed": 0.975, "format_n": 40}}
    table = varied_table(ev).splitlines()
    assert table[0] == "| | colour | shape |"
    assert table[2] == "| multiple choice, image | 98.0% | 50.0% |"
    assert table[3] == "| multiple choice, blind | 30.0% | 30.0% |"
    assert table[4] == "| generated (greedy), image | 96.0% | 50.0% |"
    assert table[5] == "| chance | 25.0% | 33.3% |" and table[6] == "| n | 50 | 40 |"
    assert table[-1] == "One-word instruction obeyed (generated text is one word): 97.5% of 40."


def test_tower_pretraining_on_scenes_runs_its_heads(tmp_path):
    from grafting.config import TowerBuild
    from grafting.train.pretrain import PretrainTowerConfig, pretrain_tower

    cfg = PretrainTowerConfig(tower=TowerBuild(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64, pos_emb_height=16, pos_emb_width=16),
                              steps=2, batch_size=4, eval_images=8, source="scenes")
    m = pretrain_tower(cfg, tmp_path, log=lambda s: None)
    assert set(m["test_probe_accuracy"]) == set(sc.TOWER_HEADS) and len(m["loss"]) == 2
    assert (tmp_path / "pretrain_metrics.json").is_file()


def test_pretrain_tower_cli_trains_on_the_canvas_it_is_given(tmp_path):
    """``chimera graft pretrain-tower --canvas 224`` pretrains on scenes drawn at 224 px (64 merged tokens a scene
    instead of 112 px's 16): the saved config records it, the default stays 112, and a canvas under 28 px (one 2 x 2
    merged token) is a usage error naming the option."""
    from typer.testing import CliRunner

    from services.cli import app

    args = ["graft", "pretrain-tower", "--source", "scenes", "--steps", "1", "--batch-size", "2", "--hidden-size",
            "32", "--layers", "1", "--heads", "2", "--intermediate-size", "64"]
    for canvas in (224, None):
        out = tmp_path / str(canvas)
        r = CliRunner().invoke(app, args + ["--out", str(out)] + (["--canvas", str(canvas)] if canvas else []))
        assert r.exit_code == 0, r.output
        assert json.loads((out / "pretrain_metrics.json").read_text())["config"]["canvas"] == (canvas or 112)
    r = CliRunner().invoke(app, args + ["--out", str(tmp_path / "small"), "--canvas", "14"])
    assert r.exit_code == 2 and "--canvas" in r.output and not (tmp_path / "small").exists()


def test_token_targets_mark_the_cells_an_object_covers():
    # a blue square over pixels 28..56 fills merged-token cell (1, 1) of the 4 x 4 grid (28-px cells); its last
    # pixel row and column reach 29 of the 784 pixels of each neighbour (3.7% < the 20% threshold)
    scene = sc.Scene("blue", "square", 1, "light", [sc.Obj(42, 42, 28, 0.0, (40, 80, 215), 0)])
    shape, colour = sc.token_targets(scene, canvas=112)
    want_shape, want_colour = [0] * 16, [0] * 16
    want_shape[5], want_colour[5] = 1 + sc.SHAPES.index("square"), 1 + list(sc.COLOURS).index("blue")
    assert shape.tolist() == want_shape and colour.tolist() == want_colour
    outlined = sc.Scene("blue", "square", 1, "light", [sc.Obj(42, 42, 28, 0.0, (40, 80, 215), 3)])
    assert sc.token_targets(outlined)[0].tolist() == want_shape  # outlined objects count as their whole area
    with pytest.raises(ValueError, match="multiple"):
        sc.token_targets(scene, canvas=100)


def test_centre_targets_put_each_object_in_the_cell_of_its_centre():
    # centres (42, 42) and (50, 30) share cell (1, 1) of the 4 x 4 grid of 28-px cells; (111, 0) is in the last
    # column of the first row (cell 3), the canvas edge clamped into the grid
    objs = [sc.Obj(42, 42, 12, 0.0, (40, 80, 215), 0), sc.Obj(50, 30, 12, 0.0, (40, 80, 215), 0),
            sc.Obj(111, 0, 12, 0.0, (40, 80, 215), 0)]
    want = [0] * 16
    want[5], want[3] = 2, 1
    assert sc.centre_targets(sc.Scene("blue", "square", 3, "light", objs)).tolist() == want
    rng = random.Random(3)
    for _ in range(50):  # every drawn scene: one centre per object
        scene = sc.sample_scene(rng, "train")
        assert int(sc.centre_targets(scene).sum()) == scene.count
    with pytest.raises(ValueError, match="multiple"):
        sc.centre_targets(scene, canvas=100)


def test_density_targets_split_each_object_over_the_cells_it_covers():
    # an axis-aligned 28-px square centred on the corner (56, 56) of four cells; PIL fills the closed polygon, pixels
    # 42..70 (29 a side), so 14 of them fall in the first cell of each axis and 15 in the second
    square = sc.Scene("blue", "square", 1, "light", [sc.Obj(56, 56, 28, 0.0, (40, 80, 215), 0)])
    d = sc.density_targets(square)
    assert d.dtype == np.float32 and d.shape == (16,)
    assert np.allclose(d[[5, 6, 9, 10]], np.array([14 * 14, 14 * 15, 15 * 14, 15 * 15]) / 29**2, atol=1e-6)
    assert d[[0, 1, 2, 3, 4, 7, 8, 11, 12, 13, 14, 15]].sum() == 0
    rng = random.Random(4)
    for _ in range(50):  # every drawn scene: the densities sum to the count (float32 rounding of <= 16 terms)
        scene = sc.sample_scene(rng, "test")
        assert abs(float(sc.density_targets(scene).sum()) - scene.count) < 1e-5
    with pytest.raises(ValueError, match="multiple"):
        sc.density_targets(square, canvas=100)


def test_tower_pretraining_with_token_targets_reports_token_accuracy(tmp_path):
    from grafting.config import TowerBuild
    from grafting.train.pretrain import TOKEN_HEADS, PretrainTowerConfig, pretrain_tower

    tiny = TowerBuild(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      pos_emb_height=16, pos_emb_width=16)
    cfg = PretrainTowerConfig(tower=tiny, steps=2, batch_size=4, eval_images=8, source="scenes", token_weight=0.5)
    m = pretrain_tower(cfg, tmp_path, log=lambda s: None)
    acc = m["test_probe_accuracy"]
    assert set(acc) == set(sc.TOWER_HEADS) | {"token_shape", "token_colour"}
    assert all(0.0 <= acc[k] <= 1.0 for k in ("token_shape", "token_colour"))
    with pytest.raises(ValueError, match="scenes"):
        pretrain_tower(cfg.model_copy(update={"source": "synth"}), tmp_path / "x", log=lambda s: None)
    # the centre count target alone: its head, per-token accuracy over all 16 tokens, and whole-image counts
    centre = cfg.model_copy(update={"token_weight": 0.0, "centre_weight": 1.0})
    acc = pretrain_tower(centre, tmp_path / "c", log=lambda s: None)["test_probe_accuracy"]
    assert set(acc) == set(sc.TOWER_HEADS) | {"token_centres", "centre_count"} and set(TOKEN_HEADS) > {"token_centres"}
    assert all(0.0 <= acc[k] <= 1.0 for k in ("token_centres", "centre_count"))
    with pytest.raises(ValueError, match="scenes"):
        pretrain_tower(centre.model_copy(update={"source": "synth"}), tmp_path / "y", log=lambda s: None)
    density = cfg.model_copy(update={"token_weight": 0.0, "density_weight": 1.0})
    acc = pretrain_tower(density, tmp_path / "d", log=lambda s: None)["test_probe_accuracy"]
    assert set(acc) == set(sc.TOWER_HEADS) | {"density_count"} and 0.0 <= acc["density_count"] <= 1.0


def test_plateau_step_finds_where_a_curve_flattens():
    from grafting.train.report import plateau_step, smoothed

    assert smoothed([4.0, 2.0, 0.0], window=2) == [4.0, 3.0, 1.0]
    curve = [1.0 / (1 + i) for i in range(100)] + [0.01] * 200
    step = plateau_step(curve, window=10, tol=0.05)
    # at step 100 the window holds 1/91..1/100 (mean 0.01050), within 5% of the floor 0.01; at step 90
    # (1/81..1/90, mean 0.01168) it is not
    assert 90 < step <= 100
    assert plateau_step([1.0 - 0.01 * i for i in range(60)], window=10) is None  # still falling at the end
    assert plateau_step([1.0] * 10, window=10) is None  # too short to say
