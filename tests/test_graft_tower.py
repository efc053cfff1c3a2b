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


# -- the conv-stem MoonViT of the cpu tower (issue 27) -----------------------------------------------------------
XIAO = {"stem_channels": [4, 8, 8, 16], "stem_strides": [2, 2, 2, 2], "stem_patch": 16}  # Xiao's layout, resampled


def _pair(seed: int = 0, **stem):
    """A linear-stem and a conv-stem tiny MoonViT of the same sizes (default stem: 3x3/2, 3x3/1, then 7x7/7)."""
    from grafting.tower import build_random_tower, build_tower_config

    lin = build_random_tower(build_tower_config(32, 2, 2, 64, 16, 16), seed=seed)
    stem = stem or {"stem_channels": [8, 16], "stem_strides": [2, 1]}
    conv = build_random_tower(build_tower_config(32, 2, 2, 64, 16, 16, patch_stem="conv", **stem), seed=seed)
    return lin, conv


def _images(sizes):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("stem", [{}, XIAO], ids=["half-res", "xiao16"])
def test_conv_stem_tower_gives_the_linear_towers_shapes_and_token_counts(stem):
    from transformers import Kimi_K25ImageProcessor

    from grafting.tower import MoonViTConvStem

    lin, conv = _pair(**stem)
    assert isinstance(conv, MoonViTConvStem) and type(lin).__name__ == "Kimi_K25VisionModel"
    proc = Kimi_K25ImageProcessor(size={"max_height": 16, "max_width": 16})
    # one image at a time, then all packed in one call (mixed sizes, the serving path's packing)
    sizes = [(112, 112), (224, 224), (100, 170), (300, 60), (28, 28)]
    for batch in [[s] for s in sizes] + [sizes]:
        f = proc(images=_images(batch), return_tensors="pt")
        with torch.no_grad():
            a = lin(f["pixel_values"], grid_thw=f["image_grid_thw"])
            b = conv(f["pixel_values"], grid_thw=f["image_grid_thw"])
        assert a.last_hidden_state.shape == b.last_hidden_state.shape
        assert a.pooler_output.shape == b.pooler_output.shape
        g = f["image_grid_thw"]
        assert b.pooler_output.shape[0] == int((g[:, 1] * g[:, 2] // 4).sum())
        assert torch.isfinite(b.pooler_output).all()


@pytest.mark.parametrize("stem", [{}, XIAO], ids=["half-res", "xiao16"])
def test_conv_stem_sees_whole_images_and_packs_images_independently(stem):
    from transformers import Kimi_K25ImageProcessor

    _, conv = _pair(**stem)
    stem = conv.patch_embed
    proc = Kimi_K25ImageProcessor(size={"max_height": 16, "max_width": 16})
    imgs = _images([(112, 84), (56, 140)])
    with torch.no_grad():
        # the stem runs on each image's pixels put back together: same as the conv stack on the image itself
        f = proc(images=imgs[:1], return_tensors="pt")
        t, h, w = f["image_grid_thw"][0].tolist()
        pixels = torch.from_numpy(__import__("numpy").array(imgs[0])).permute(2, 0, 1)[None].float() / 127.5 - 1
        if stem.stem_patch != 14:
            pixels = torch.nn.functional.interpolate(pixels, size=(h * 16, w * 16), mode="bilinear")
        direct = stem.proj(stem.stem(pixels)).permute(0, 2, 3, 1).reshape(h * w, -1)
        got = stem(f["pixel_values"], f["image_grid_thw"]) - stem.pos_emb(torch.zeros_like(direct), f["image_grid_thw"])
        assert torch.allclose(got, direct, atol=1e-5)
        # packed images give each image's own rows (eval mode: BatchNorm uses its running statistics)
        both = proc(images=imgs, return_tensors="pt")
        one = [proc(images=[im], return_tensors="pt") for im in imgs]
        packed = conv(both["pixel_values"], grid_thw=both["image_grid_thw"]).pooler_output
        alone = torch.cat([conv(o["pixel_values"], grid_thw=o["image_grid_thw"]).pooler_output for o in one])
        assert torch.allclose(packed, alone, atol=1e-5)


@pytest.mark.parametrize("stem", [{}, XIAO], ids=["half-res", "xiao16"])
def test_conv_stem_is_the_only_difference_from_moonvit(stem):
    lin, conv = _pair(**stem)
    assert [n for n, _ in lin.named_children()] == [n for n, _ in conv.named_children()]
    ls, cs = lin.state_dict(), conv.state_dict()
    stem_keys = {k for k in cs if k.startswith(("patch_embed.stem.", "patch_embed.proj."))}
    assert {k for k in ls if k not in cs or ls[k].shape != cs[k].shape} == {"patch_embed.proj.weight"}
    assert set(cs) - set(ls) == stem_keys - {"patch_embed.proj.weight", "patch_embed.proj.bias"}
    # with the linear tower's weights everywhere but the stem, and its patch embedding swapped in, the conv-stem
    # tower computes exactly what MoonViT computes
    conv.load_state_dict({k: ls[k] if k in ls and k not in stem_keys else v for k, v in cs.items()})
    conv.patch_embed.proj = lin.patch_embed.proj
    conv.patch_embed.forward = lin.patch_embed.forward
    x, grid = torch.randn(64 + 32, 3, 14, 14), torch.tensor([[1, 8, 8], [1, 4, 8]])
    with torch.no_grad():
        assert torch.equal(conv(x, grid_thw=grid).pooler_output, lin(x, grid_thw=grid).pooler_output)


def test_conv_stem_tower_saves_loads_and_builds_like_the_linear_one(tmp_path):
    from grafting.build import build_projector, build_tower
    from grafting.config import VLMConfig
    from grafting.tower import MoonViTConvStem, load_tower, tower_class

    _, conv = _pair(seed=4)
    conv.save_pretrained(tmp_path / "t")
    assert tower_class(tmp_path / "t") is MoonViTConvStem
    loaded = load_tower(tmp_path / "t")
    assert isinstance(loaded, MoonViTConvStem) and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in conv.state_dict().items())
    x, grid = torch.randn(64, 3, 14, 14), torch.tensor([[1, 8, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(x, grid_thw=grid).pooler_output, conv.eval()(x, grid_thw=grid).pooler_output)
    # fp16 storage (chimera graft export) loads back to fp32
    conv.to(torch.float16).save_pretrained(tmp_path / "t16")
    assert load_tower(tmp_path / "t16").patch_embed.stem[1].running_var.dtype == torch.float32
    # a linear-stem folder still loads as Kimi_K25VisionModel; a hub id is left to from_pretrained
    lin, _ = _pair()
    lin.save_pretrained(tmp_path / "lin")
    assert tower_class(tmp_path / "lin").__name__ == "Kimi_K25VisionModel"
    assert tower_class("moonshotai/Kimi-K2.6").__name__ == "Kimi_K25VisionModel"
    # the cpu build: TowerBuild.patch_stem: conv writes a conv-stem tower the projector builder can read
    cfg = VLMConfig(max_image_side=224, build={"tower": {"hidden_size": 32, "num_hidden_layers": 1,
                                                         "num_attention_heads": 2, "intermediate_size": 64,
                                                         "pos_emb_height": 16, "pos_emb_width": 16,
                                                         "patch_stem": "conv", "stem_channels": [8],
                                                         "stem_strides": [2]}})
    build_tower(tmp_path / "built", cfg)
    assert isinstance(load_tower(tmp_path / "built"), MoonViTConvStem)
    assert VLMConfig().build is None and VLMConfig(build={}).build.tower.patch_stem == "linear"
    with pytest.raises(ValueError):
        VLMConfig(build={"tower": {"patch_stem": "resnet"}})
    from grafting.tower import build_random_tower, build_tower_config

    with pytest.raises(ValueError, match="divisible"):  # 14 px cannot be reached by four stride-2 convolutions
        build_random_tower(build_tower_config(32, 1, 2, 64, 16, 16, patch_stem="conv", **{**XIAO, "stem_patch": 14}))
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 48,
                                                                     "num_attention_heads": 4}))
    build_projector(tmp_path / "proj", tmp_path / "built", tmp_path / "llm", cfg)
    assert json.loads((tmp_path / "proj" / "config.json").read_text())["vision_hidden_size"] == 32


def test_pretrain_tower_trains_a_conv_stem_tower(tmp_path):
    from grafting.config import TowerBuild
    from grafting.tower import MoonViTConvStem, load_tower
    from grafting.train.pretrain import PretrainTowerConfig, pretrain_tower

    torch.set_num_threads(1)
    cfg = PretrainTowerConfig(tower=TowerBuild(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=64, pos_emb_height=16, pos_emb_width=16,
                                               patch_stem="conv", stem_channels=[8], stem_strides=[2]),
                              steps=2, batch_size=4, eval_images=8, seed=5, source="scenes")
    pretrain_tower(cfg, tmp_path / "c1", log=lambda *_: None)
    a = load_tower(tmp_path / "c1")
    assert isinstance(a, MoonViTConvStem)
    cont = cfg.model_copy(update={"init": str(tmp_path / "c1"), "steps": 1})
    pretrain_tower(cont, tmp_path / "c2", log=lambda *_: None)
    b = load_tower(tmp_path / "c2")
    assert isinstance(b, MoonViTConvStem) and any(not torch.equal(v, b.state_dict()[k])
                                                  for k, v in a.state_dict().items())
