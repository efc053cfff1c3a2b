"""The tower: loading MoonViT out of a sharded VLM checkpoint (only the shards holding vision_tower.* are
opened), and seeded tower pretraining."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file


def _tiny_tower_config():
    from grafting.tower import build_tower_config

    return build_tower_config(32, 2, 2, 64, 16, 16)


def test_tower_loads_from_sharded_checkpoint_reading_only_its_shards(tmp_path, monkeypatch):
    import grafting.tower as tower_mod
    from grafting.tower import build_random_tower, load_tower, tower_shards

    cfg = _tiny_tower_config()
    ref = build_random_tower(cfg, seed=3)
    state = {f"vision_tower.{k}": v.clone() for k, v in ref.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    # shard 1: first half of the tower + a language-model tensor; shard 2: rest of the tower; shard 3: LLM only
    shards = {
        "model-00001-of-00003.safetensors": {**{n: state[n] for n in names[:half]},
                                              "language_model.embed.weight": torch.randn(8, 4)},
        "model-00002-of-00003.safetensors": {n: state[n] for n in names[half:]},
        "model-00003-of-00003.safetensors": {"language_model.lm_head.weight": torch.randn(8, 4),
                                              "mm_projector.proj.0.weight": torch.randn(4, 4)},
    }
    weight_map = {}
    for fname, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / fname))
        weight_map.update({k: fname for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    vision = {k: v for k, v in cfg.to_dict().items() if k not in ("transformers_version", "architectures")}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "vision_config": vision}))

    assert set(tower_shards(tmp_path / "model.safetensors.index.json")) == set(list(shards)[:2])
    opened = []
    real = tower_mod.safe_open

    def recording(path, *a, **k):  # the real safe_open, recording which files it is asked for
        opened.append(path.rsplit("/", 1)[-1])
        return real(path, *a, **k)

    monkeypatch.setattr(tower_mod, "safe_open", recording)
    tower = load_tower(tmp_path, key_prefix="vision_tower.")
    assert sorted(opened) == sorted(list(shards)[:2])
    for k, v in ref.state_dict().items():
        assert torch.equal(tower.state_dict()[k], v), k
    assert not any(p.requires_grad for p in tower.parameters()) and not tower.training
    x = torch.randn(64, 3, 14, 14)
    grid = torch.tensor([[1, 8, 8]])
    with torch.no_grad():
        assert torch.equal(tower(x, grid_thw=grid).pooler_output, ref.eval()(x, grid_thw=grid).pooler_output)

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm.x": "a.safetensors"}}))
    with pytest.raises(KeyError, match="vision_tower"):
        load_tower(tmp_path, key_prefix="vision_tower.")
    with pytest.raises(FileNotFoundError):
        load_tower(tmp_path / "missing", key_prefix="vision_tower.")


def test_pretrain_tower_is_seeded_and_saves_a_loadable_tower(tmp_path):
    from transformers import Kimi_K25VisionModel

    from grafting.config import TowerBuild
    from grafting.train.pretrain import PretrainTowerConfig, pretrain_tower

    torch.set_num_threads(1)
    cfg = PretrainTowerConfig(tower=TowerBuild(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64, pos_emb_height=16, pos_emb_width=16),
                              steps=3, batch_size=4, eval_images=8, seed=5)
    m1 = pretrain_tower(cfg, tmp_path / "t1", log=lambda *_: None)
    pretrain_tower(cfg, tmp_path / "t2", log=lambda *_: None)
    a = Kimi_K25VisionModel.from_pretrained(tmp_path / "t1").state_dict()
    b = Kimi_K25VisionModel.from_pretrained(tmp_path / "t2").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(m1["loss"]) == 3 and set(m1["test_probe_accuracy"]) == {"colour", "shape", "count", "size", "position"}
    assert (tmp_path / "t1" / "preprocessor_config.json").exists()
    # continuing from a saved tower keeps its sizes and changes its weights
    cont = cfg.model_copy(update={"init": str(tmp_path / "t1"), "steps": 2})
    pretrain_tower(cont, tmp_path / "t3", log=lambda *_: None)
    c = Kimi_K25VisionModel.from_pretrained(tmp_path / "t3").state_dict()
    assert a.keys() == c.keys() and any(not torch.equal(a[k], c[k]) for k in a)
