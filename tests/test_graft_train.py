"""Projector training on tiny real-architecture models: loss goes down, tower and LLM stay frozen, checkpoints
reload to identical logits, resume continues exactly, the GPU config builds on the meta device."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.graft_fixtures import train_config, write_tiny_graft

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, model_dir):
    torch.set_num_threads(1)
    return write_tiny_graft(tmp_path_factory.mktemp("tiny_graft"), model_dir)


def _batch(processor, rows):
    from grafting.train.data import ConversationDataset, collate

    ds = ConversationDataset(rows, processor)
    return collate([ds[i] for i in range(len(rows))], processor.tokenizer.pad_token_id)


@pytest.mark.parametrize("image_context", [False, True])
def test_only_the_projector_gets_gradients_and_changes(dirs, tmp_path, image_context):
    """Also with the image-context projector (`projector_image_context`), whose extra map trains with the rest."""
    from grafting.train.data import read_jsonl
    from grafting.train.checkpoint import load_graft
    from grafting.train.loop import token_loss, trainable_parameters

    cfg = train_config(dirs, tmp_path / "run")
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"projector_image_context": image_context})})
    vlm, processor = load_graft(cfg.model)
    assert (vlm.projector.context_proj is not None) == image_context
    before = {n: p.detach().clone() for n, p in vlm.named_parameters()}
    assert {id(p) for p in trainable_parameters(vlm)} == {id(p) for p in vlm.projector.parameters()}
    opt = torch.optim.AdamW(trainable_parameters(vlm), lr=1e-2)
    batch = _batch(processor, read_jsonl(dirs["synth"] / "qa.jsonl")[:4])
    for _ in range(2):
        loss = token_loss(vlm, batch)
        loss.backward()
        for n, p in vlm.named_parameters():
            if n.startswith(("tower.", "llm.")):
                assert p.grad is None, n
                assert not p.requires_grad, n
            else:
                assert p.grad is not None and p.grad.abs().sum() > 0, n
        opt.step()
        opt.zero_grad()
    for n, p in vlm.named_parameters():
        if n.startswith(("tower.", "llm.")):
            assert torch.equal(p, before[n]), n
        else:
            assert not torch.equal(p, before[n]), n


def test_train_loss_goes_down_checkpoints_reload_and_resume_exactly(dirs, tmp_path):
    from grafting.train.data import read_jsonl
    from grafting.train.checkpoint import load_checkpoint_config, load_graft
    from grafting.train.loop import train

    # overfit 4 QA rows: one batch repeated, 8 steps
    qa4 = tmp_path / "qa4.jsonl"
    lines = (dirs["synth"] / "qa.jsonl").read_text().splitlines()[:4]
    qa4.write_text("\n".join(lines) + "\n")
    shutil.copytree(dirs["synth"] / "images", tmp_path / "images")
    cfg = train_config(dirs, tmp_path / "run", stages=[{"name": "qa", "data": str(qa4), "steps": 8}],
                       optim={"lr": 1e-2, "batch_size": 4, "warmup_ratio": 0.0})
    res = train(cfg, log=lambda *_: None)
    rows = list(csv.DictReader(open(tmp_path / "run" / "log.csv")))
    losses = [float(r["loss"]) for r in rows]
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    # Measured 11.81 -> 9.74, each step at least 0.11 nats below the one before: fp32 rounding differences between
    # CPUs move these losses by about 1e-4 nats at most (relative sqrt(S*n)*u, see test_graft_eval), 1000x below it.
    assert losses[-1] < 0.9 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert float(rows[0]["lr"]) == pytest.approx(1e-2) and 0 < float(rows[-1]["lr"]) < 1e-3
    assert res["steps"] == 8
    assert (tmp_path / "run/final/projector/model.safetensors").exists()
    assert not list((tmp_path / "run/final").glob("**/*tower*")), "checkpoints hold only the projector"

    # save + reload -> identical logits (twice loaded, and vs. the in-memory model the checkpoint came from)
    mc = load_checkpoint_config(tmp_path / "run" / "final")
    vlm1, proc = load_graft(mc)
    vlm2, _ = load_graft(mc)
    batch = _batch(proc, read_jsonl(qa4)[:2])
    with torch.no_grad():
        a = vlm1(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"]).logits
        b = vlm2(batch["input_ids"], batch["attention_mask"], batch["pixel_values"], batch["image_grid_thw"]).logits
    assert torch.equal(a, b)

    # resume: a fresh run from checkpoint-4 ends with exactly the same projector as the uninterrupted run
    shutil.copytree(tmp_path / "run" / "checkpoint-4", tmp_path / "run2" / "checkpoint-4")
    # as after a run stopped at step 6: the log holds steps 5 and 6, run again from checkpoint-4
    (tmp_path / "run2" / "log.csv").write_text("".join((tmp_path / "run" / "log.csv").open().readlines()[:7]))
    logs = []
    train(cfg.model_copy(update={"output_dir": str(tmp_path / "run2")}), log=logs.append)
    assert any("resumed" in m and "step 4" in m for m in logs)
    resumed = list(csv.DictReader(open(tmp_path / "run2" / "log.csv")))
    assert [int(r["step"]) for r in resumed] == list(range(1, 9))  # each step once, 5 and 6 from the resumed run
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    from safetensors.torch import load_file

    p1 = load_file(tmp_path / "run/final/projector/model.safetensors")
    p2 = load_file(tmp_path / "run2/final/projector/model.safetensors")
    assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)


def test_stages_run_in_order_with_one_schedule(dirs, tmp_path):
    from grafting.train.loop import train

    cfg = train_config(dirs, tmp_path / "run", steps=(2, 2), optim={"lr": 1e-3, "batch_size": 2, "warmup_ratio": 0.5})
    train(cfg, log=lambda *_: None)
    rows = list(csv.DictReader(open(tmp_path / "run" / "log.csv")))
    assert [r["stage"] for r in rows] == ["captions", "captions", "qa", "qa"]
    lrs = [float(r["lr"]) for r in rows]
    assert lrs == pytest.approx([0.0, 0.5e-3, 1e-3, 0.5e-3])  # linear warmup (2 steps), then cosine
    assert all(int(r["tokens"]) > 0 for r in rows)


def test_lora_option_trains_adapters_only(dirs, tmp_path):
    from safetensors.torch import load_file

    from grafting.train.loop import train

    cfg = train_config(dirs, tmp_path / "run", steps=(1, 1), lora={"enabled": True, "r": 4, "alpha": 8})
    train(cfg, log=lambda *_: None)
    adapter = load_file(tmp_path / "run/final/lora/adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(float(v.abs().sum()) > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0, so it trained
    assert (tmp_path / "run/final/projector/model.safetensors").exists()
    assert json.loads((tmp_path / "run/final/graft.json").read_text())["lora"] is True


def test_bad_configs_are_refused(dirs, tmp_path):
    import pydantic

    from grafting.train.config import TrainConfig
    from grafting.train.loop import train

    with pytest.raises(pydantic.ValidationError):
        train_config(dirs, tmp_path / "r", mixed_precision="fp8")
    with pytest.raises(pydantic.ValidationError):
        train_config(dirs, tmp_path / "r", stages=[{"name": "x", "data": "x.jsonl", "steps": 0}])
    with pytest.raises(pydantic.ValidationError):
        TrainConfig.model_validate({"output_dir": "x", "model": {"tower": "t", "llm": "l"}, "stages": [], "typo": 1})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no rows"):
        train(train_config(dirs, tmp_path / "r", stages=[{"name": "x", "data": str(empty), "steps": 1}]),
              log=lambda *_: None)


def test_gpu_config_dry_run_on_meta_device():
    from grafting.train.config import TrainConfig
    from grafting.train.loop import dry_run

    cfg = TrainConfig.from_yaml(REPO / "configs/graft/gpu_glm4_moonvit.yaml")
    rep = dry_run(cfg)
    assert rep["llm_class"] == "Glm4ForCausalLM"
    assert rep["devices"] == {"meta"}
    assert 9.3e9 < rep["llm_params"] < 9.5e9  # GLM-4-9B-0414: 9.40B
    assert 4.1e8 < rep["tower_params"] < 4.2e8  # MoonViT: ~417M
    # Kimi projector 1152*4 -> 4608 -> 4096 (+ LayerNorm 1152): the only trainable part
    assert rep["projector_params"] == 2 * 1152 + 4608 * 4608 + 4608 + 4608 * 4096 + 4096
    assert rep["trainable_params"] == rep["projector_params"]
    assert cfg.mixed_precision == "bf16" and cfg.gradient_checkpointing


def test_cpu_configs_parse():
    from grafting.train.config import TrainConfig

    for name in ("cpu", "cpu_exp_b", "cpu_captions_only", "cpu_random_tower"):
        cfg = TrainConfig.from_yaml(REPO / f"configs/graft/{name}.yaml")
        assert cfg.model.llm.endswith("vlm/llm") and cfg.stages[0].name == "captions"
    a = TrainConfig.from_yaml(REPO / "configs/graft/cpu_captions_only.yaml")
    b = TrainConfig.from_yaml(REPO / "configs/graft/cpu_exp_b.yaml")
    c = TrainConfig.from_yaml(REPO / "configs/graft/cpu_random_tower.yaml")
    assert a.total_steps == b.total_steps == c.total_steps and a.optim == b.optim == c.optim  # same compute
    assert [s.name for s in b.stages] == ["captions", "qa"] and b.stages == c.stages
    assert c.model.tower != b.model.tower


def test_conv_tower_arms_differ_from_the_issue_15_arms_only_in_tower_and_output():
    from grafting.train.config import TrainConfig

    for old, new in (("cpu_varied_captions_only", "cpu_conv_varied_captions_only"), ("cpu_varied", "cpu_conv_varied")):
        a = TrainConfig.from_yaml(REPO / f"configs/graft/{old}.yaml")
        b = TrainConfig.from_yaml(REPO / f"configs/graft/{new}.yaml")
        assert b.model.tower == "runs/i27_tower" and b.output_dir != a.output_dir
        assert b.model_copy(update={"output_dir": a.output_dir,
                                    "model": b.model.model_copy(update={"tower": a.model.tower})}) == a


def test_prepare_installs_the_shipped_graft_and_switches_back(profile, model_dir, tmp_path):
    from grafting import build
    from grafting.engine import VLMEngine

    cfg = profile.vlm.engine
    assert cfg.build.shipped_graft, "the cpu profile ships a trained graft"
    (tmp_path / "vlm").mkdir()
    (tmp_path / "vlm" / "llm").symlink_to((model_dir / cfg.llm).resolve())
    assert build.prepare(cfg, tmp_path) is True
    assert (tmp_path / cfg.tower / build.SHIPPED_MARKER).read_text().split()[0] == cfg.build.shipped_graft
    assert build.prepare(cfg, tmp_path) is False  # idempotent
    eng = VLMEngine.from_config(cfg, tmp_path)
    assert eng.model.tower.config.hidden_size == 192 and eng.model.projector.config.llm_hidden_size == 576
    random_cfg = cfg.model_copy(update={"build": cfg.build.model_copy(update={"shipped_graft": None})})
    assert build.prepare(random_cfg, tmp_path) is True  # stale shipped folders are replaced
    assert not (tmp_path / cfg.tower / build.SHIPPED_MARKER).exists()
    assert VLMEngine.from_config(random_cfg, tmp_path).model.tower.config.hidden_size == cfg.build.tower.hidden_size


def test_ninth_round_configs_differ_from_arm_b_only_where_they_say():
    """Issue 27's ninth round: the image-context projector and the 12,000-image data, each on the 3000-step tower
    (its float16 copy, shipped until the tenth round) and the 4500-step one; everything else is arm (b)'s recipe
    (configs/graft/cpu_conv_varied.yaml)."""
    from grafting.train.config import TrainConfig

    base = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_varied.yaml")
    for name, tower in (("cpu_conv_context", "runs/i27_tower16"),
                        ("cpu_conv_context_t4500", "runs/i27_t4500"),
                        ("cpu_conv_varied_12k", "runs/i27_tower16"),
                        ("cpu_conv_varied_t4500_12k", "runs/i27_t4500")):
        cfg = TrainConfig.from_yaml(REPO / f"configs/graft/{name}.yaml")
        assert cfg.model.tower == tower and cfg.output_dir != base.output_dir
        context = name.startswith("cpu_conv_context")
        assert cfg.model.projector_image_context == context
        stages = base.stages if context else [s.model_copy(update={"data": s.data.replace("runs/scenes/",
                                                                                          "runs/scenes12k/")})
                                              for s in base.stages]
        assert cfg.stages == stages
        model = cfg.model.model_copy(update={"tower": base.model.tower, "projector_image_context": False})
        assert cfg.model_copy(update={"output_dir": base.output_dir, "model": model, "stages": base.stages}) == base


def test_twelfth_round_config_differs_from_the_shipped_recipe_only_in_its_qa_steps():
    """Issue 27's twelfth round: the shipped graft's recipe (configs/graft/cpu_conv_varied_t4500_12k.yaml) with a QA
    stage of 1,500 steps of batch 8, so that it sees each of the 12,000 training records once; the same learning
    rate, warm-up share and schedule (stretched), checkpoints every 100 steps instead of 50."""
    from grafting.train.config import TrainConfig

    base = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_varied_t4500_12k.yaml")
    cfg = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_varied_t4500_12k_all.yaml")
    qa = [s for s in cfg.stages if s.name == "qa"]
    assert len(qa) == 1 and qa[0].steps * cfg.optim.batch_size == 12_000
    assert cfg.output_dir != base.output_dir and cfg.save_every == 100
    stages = [s.model_copy(update={"steps": b.steps}) for s, b in zip(cfg.stages, base.stages)]
    same = {"output_dir": base.output_dir, "stages": stages, "save_every": base.save_every}
    assert cfg.model_copy(update=same) == base


def test_224_px_config_differs_from_the_shipped_recipe_only_in_its_tower_and_scenes():
    """Issue 27's 224-px round: the shipped graft's recipe on a tower trained on 224-px scenes (64 merged tokens a
    scene) and the 224-px scenes written as the 112-px ones; nothing else changes."""
    from grafting.train.config import TrainConfig

    base = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_varied_t4500_12k.yaml")
    cfg = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_c224_12k.yaml")
    assert cfg.model.tower == "runs/i27_c224" and cfg.output_dir != base.output_dir
    assert cfg.model.max_image_side == 224  # 224 / 14 = 16 patches a side, 2 x 2 merged: 8 x 8 tokens
    assert cfg.stages == [s.model_copy(update={"data": s.data.replace("runs/scenes12k/", "runs/scenes224/")})
                          for s in base.stages]
    model = cfg.model.model_copy(update={"tower": base.model.tower})
    assert cfg.model_copy(update={"output_dir": base.output_dir, "model": model, "stages": base.stages}) == base


def test_count_request_stem_config_differs_from_the_224_px_recipe_only_in_its_scenes():
    """Issue 27's fourteenth round: the 224-px recipe on scenes written with one more training count stem (the
    polite-request form the other question types have; the command is in the config's header). The stem is not a
    held-out one, and nothing but the data and the output directory changes."""
    from grafting.train.config import TrainConfig
    from grafting.train.scenes import STEMS

    header = (REPO / "configs/graft/cpu_conv_c224_12k_cs.yaml").read_text()
    stem = "Can you tell me how many {objs} there are?"
    assert f'scenes.STEMS["count"]["train"].append("{stem}")' in header
    assert stem not in STEMS["count"]["train"] and all(stem not in v["test"] for v in STEMS.values())
    base = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_c224_12k.yaml")
    cfg = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_c224_12k_cs.yaml")
    assert cfg.stages == [s.model_copy(update={"data": s.data.replace("runs/scenes224/", "runs/scenes224_cs/")})
                          for s in base.stages]
    assert cfg.output_dir != base.output_dir and cfg.model_copy(update={"output_dir": base.output_dir,
                                                                       "stages": base.stages}) == base


def test_caption_replay_config_differs_from_the_224_px_recipe_only_in_its_qa_data():
    """Issue 27's fifteenth round: the 224-px recipe whose QA stage replays every fourth caption record beside the
    QA records (the file is written by the command in the config's header); the captions stage, the tower, the
    optimizer and the seed are the recipe's, and the header's command names exactly the files the stage reads."""
    from grafting.train.config import TrainConfig

    header = (REPO / "configs/graft/cpu_conv_c224_12k_capmix.yaml").read_text()
    assert ('open("runs/scenes224/qa_capmix.jsonl", "w").writelines(open("runs/scenes224/qa.jsonl").readlines() '
            '+ lines[::4])') in header
    base = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_c224_12k.yaml")
    cfg = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_c224_12k_capmix.yaml")
    assert [s.name for s in cfg.stages] == ["captions", "qa"] and cfg.stages[0] == base.stages[0]
    assert cfg.stages[1] == base.stages[1].model_copy(update={"data": "runs/scenes224/qa_capmix.jsonl"})
    assert cfg.output_dir != base.output_dir and cfg.model_copy(update={"output_dir": base.output_dir,
                                                                       "stages": base.stages}) == base


def test_captions_only_arm_on_the_224_px_tower_matches_the_served_recipe_but_for_its_stages():
    """Issue 27's curriculum table on the 224-px tower: arm (a) trains captions only for the 700 steps arm (b), the
    served graft's recipe, spends on 60 caption + 640 QA steps; the same optimizer, seed, LLM and image tokens, on
    the served graft's own tower (its float16 export, which the config names, so no tower rebuild is needed)."""
    from grafting.train.config import TrainConfig

    b = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_c224_12k_capmix.yaml")
    a = TrainConfig.from_yaml(REPO / "configs/graft/cpu_conv_c224_12k_captions_only.yaml")
    assert [(s.name, s.data, s.steps) for s in a.stages] == [("captions", "runs/scenes224/captions.jsonl", 700)]
    assert sum(s.steps for s in a.stages) == sum(s.steps for s in b.stages)
    assert a.model.tower == "grafting/assets/cpu_scenes224/tower" and (REPO / a.model.tower / "config.json").exists()
    assert a.output_dir != b.output_dir
    assert a.model_copy(update={"output_dir": b.output_dir, "stages": b.stages,
                                "model": a.model.model_copy(update={"tower": b.model.tower})}) == b


def test_the_served_graft_is_the_selected_caption_replay_graft_exported_whole():
    """Issue 27's fifteenth round selected the caption-replay graft on 450 validation scenes; its export
    (`chimera graft export --checkpoint runs/graft/c224_12k_capmix/final --name cpu_scenes224`) is the graft the cpu
    profile serves since the sixteenth round, replacing the 112-px `cpu_scenes`: the conv-stem tower and a plain
    projector at its final QA step, float16, reading the profile's LLM through the profile's image tokens."""
    from services.config.profiles import load_profile

    assets = REPO / "grafting/assets"
    engine = load_profile("cpu").vlm.engine
    assert engine.build.shipped_graft == "cpu_scenes224"
    assert not (assets / "cpu_scenes").exists()  # the 112-px graft it replaced is in git history only (36a6479)
    cand = json.loads((assets / "cpu_scenes224/graft.json").read_text())
    assert (cand["max_image_side"], cand["step"], cand["stage"], cand["lora"], cand["exported_dtype"]) == (
        224, 700, "qa", False, "float16")
    assert (cand["llm"], cand["tower"], cand["projector"]) == (".chimera/models/cpu/vlm/llm", "tower", "projector")
    assert cand["image_tokens"] == engine.image_tokens.model_dump()
    tower = json.loads((assets / "cpu_scenes224/tower/config.json").read_text())
    projector = json.loads((assets / "cpu_scenes224/projector/config.json").read_text())
    assert tower["model_type"] == "moonvit_conv_stem" and tower["merge_kernel_size"] == [2, 2]
    assert (projector["merge_size"], projector["image_context"]) == (4, False)
    assert projector["vision_hidden_size"] == tower["hidden_size"]
