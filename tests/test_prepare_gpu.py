"""``chimera prepare`` for profiles that name hub checkpoints (the gpu profile): which files are fetched, the
``--dry-run`` listing, ``HF_HUB_OFFLINE``, and that the engines' loaders then find the tower in the fetched dir.

No network: the repos are a local mirror written by the test (``--mirror``, :class:`services.config.weights.DirSource`),
with a real (tiny, random) MoonViT stored under ``vision_tower.*`` in one shard of a three-shard checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from core.config import resolve_path
from grafting.tower import build_random_tower, build_tower_config, load_tower
from services.cli import app as cli
from services.config.profiles import load_profile
from services.config.weights import MANIFEST, checkpoints, select_files

TOWER_REPO, LLM_REPO = "moonshotai/Kimi-K2.5", "org/tiny-llm"


def _kimi_repo(root):
    """A Kimi-K2.5-shaped repo: 3 shards, the tower's tensors (a 1-layer 32-wide MoonViT) only in shard 2."""
    from transformers import Kimi_K25ImageProcessor

    d = root / TOWER_REPO
    d.mkdir(parents=True)
    tower = build_random_tower(build_tower_config(32, 1, 2, 64, 8, 8), seed=3)
    shards = {"model-00001-of-00003.safetensors": {"language_model.embed.weight": torch.ones(4, 4)},
              "model-00002-of-00003.safetensors": {f"vision_tower.{k}": v.contiguous()
                                                   for k, v in tower.state_dict().items()},
              "model-00003-of-00003.safetensors": {"mm_projector.weight": torch.zeros(2, 2)}}
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(d / name))
        weight_map.update({k: name for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "vision_config": tower.config.to_dict()}))
    Kimi_K25ImageProcessor(size={"max_height": 8, "max_width": 8}).save_pretrained(d)
    (d / "README.md").write_text("not fetched")
    (d / "tiktoken.model").write_bytes(b"tok")
    return d, tower


def _llm_repo(root):
    d = root / LLM_REPO
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    save_file({"w": torch.zeros(3)}, str(d / "model.safetensors"))
    (d / "pytorch_model.bin").write_bytes(b"0" * 100)  # a folder with safetensors: its .bin is not fetched
    return d


@pytest.fixture
def mirror(tmp_path):
    root = tmp_path / "mirror"
    kimi, tower = _kimi_repo(root)
    _llm_repo(root)
    data = load_profile("gpu").model_dump(mode="json")
    data["model_dir"] = str(tmp_path / "models")
    del data["video"], data["tts"]
    data["vlm"]["engine"]["llm"] = LLM_REPO
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(data))
    return root, kimi, tower, prof, tmp_path / "models"


def test_select_files_per_folder_and_by_tower_index(tmp_path):
    diffusers = {"model_index.json": 1, "transformer/config.json": 2,
                 "transformer/diffusion_pytorch_model-00001-of-00002.safetensors": 30,
                 "transformer/diffusion_pytorch_model-00002-of-00002.safetensors": 31,
                 "transformer/diffusion_pytorch_model.safetensors.index.json": 3, "vae/config.json": 4,
                 "vae/diffusion_pytorch_model.safetensors": 40, "vae/diffusion_pytorch_model.bin": 41,
                 "text_encoder/model.safetensors": 50, "tokenizer/spiece.model": 5, "tokenizer/tokenizer.json": 6,
                 "scheduler/scheduler_config.json": 7, "assets/example.png": 99, "README.md": 8,
                 ".gitattributes": 9, ".cache/x.json": 10}
    got = select_files(diffusers)
    assert set(got) == set(diffusers) - {"vae/diffusion_pytorch_model.bin", "assets/example.png", "README.md",
                                         ".gitattributes", ".cache/x.json"}
    assert got["transformer/diffusion_pytorch_model-00002-of-00002.safetensors"] == 31
    assert select_files({"config.json": 1, "pytorch_model.bin": 2}) == {"config.json": 1, "pytorch_model.bin": 2}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"vision_tower.a": "s2", "vision_tower.b": "s2", "lm.x": "s1"}}))
    assert select_files({"s1": 10, "s2": 20, "config.json": 1, "model.safetensors.index.json": 2}, "vision_tower.",
                        index) == {"config.json": 1, "model.safetensors.index.json": 2, "s2": 20}
    with pytest.raises(KeyError, match="no tensor named mm_tower"):
        select_files({"s1": 10}, "mm_tower.", index)


def test_gpu_profile_checkpoints():
    got = [(c.where, c.ref, c.key_prefix) for c in checkpoints(load_profile("gpu"))]
    assert got == [("vlm.tower", "moonshotai/Kimi-K2.5", "vision_tower."), ("vlm.llm", "THUDM/GLM-4-9B-0414", None),
                   ("vlm.projector", "grafts/glm4-9b-moonvit/projector", None),
                   ("video.model", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", None),
                   ("tts.lm", "canopylabs/orpheus-3b-0.1-ft", None), ("tts.snac", "hubertsiuzdak/snac_24khz", None)]
    assert checkpoints(load_profile("cpu")) == []  # everything there is built by `chimera prepare`


def test_dry_run_lists_only_the_tower_shard_and_the_engine_files(mirror):
    root, kimi, _, prof, models = mirror
    r = CliRunner().invoke(cli, ["prepare", "--profile", str(prof), "--mirror", str(root), "--dry-run"])
    assert r.exit_code == 1, r.output  # the trained projector is a local directory that is not there
    listed = dict((f, int(n)) for n, f in re.findall(r"^\s+(\d+)\s+(\S+)$", r.output, re.M))
    tower_files = {"config.json", "model.safetensors.index.json", "model-00002-of-00003.safetensors",
                   "preprocessor_config.json", "tiktoken.model"}
    assert set(listed) == tower_files | {"tokenizer.json", "model.safetensors"}  # config.json appears for both
    for f in tower_files:
        assert listed[f] == (kimi / f).stat().st_size or f == "config.json"
    n_tower = sum((kimi / f).stat().st_size for f in tower_files)
    assert f"vlm.tower      {TOWER_REPO} -> {models / TOWER_REPO}  would fetch 5 files, {n_tower} bytes" in r.output
    total = n_tower + sum(p.stat().st_size for p in (root / LLM_REPO).iterdir() if p.suffix != ".bin")
    assert f"total to fetch: {total} bytes" in r.output
    assert "vlm.projector" in r.output and "MISSING" in r.output and "chimera graft train" in r.output
    assert not models.exists()  # a dry run writes nothing


def test_prepare_fetches_the_tower_shard_and_the_loader_finds_it(mirror):
    root, _, tower, prof, models = mirror
    (models / "grafts/glm4-9b-moonvit/projector").mkdir(parents=True)
    r = CliRunner().invoke(cli, ["prepare", "--profile", str(prof), "--mirror", str(root)])
    assert r.exit_code == 0, r.output
    dest = models / TOWER_REPO
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [MANIFEST, "config.json", "model.safetensors.index.json", "model-00002-of-00003.safetensors",
         "preprocessor_config.json", "tiktoken.model"])
    assert sorted(p.name for p in (models / LLM_REPO).iterdir()) == sorted(
        [MANIFEST, "config.json", "model.safetensors", "tokenizer.json"])
    path = resolve_path(models, TOWER_REPO)  # how VLMEngine.from_config resolves the profile's tower
    assert path == str(dest)
    loaded = load_tower(path, key_prefix="vision_tower.")
    for k, v in tower.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    again = CliRunner().invoke(cli, ["prepare", "--profile", str(prof), "--mirror", str(root)])
    assert again.exit_code == 0 and again.output.count("up to date") == 2, again.output
    assert "vlm.projector" in again.output and "local directory" in again.output


def test_offline_refuses_with_the_checkpoints_it_would_need(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "CHIMERA_MODEL_DIR": str(tmp_path)}
    for extra in ([], ["--dry-run"]):
        r = CliRunner().invoke(cli, ["prepare", "--profile", "gpu", *extra], env=env)
        assert r.exit_code == 2, r.output
        assert "HF_HUB_OFFLINE is set" in r.output
        assert f"vlm.tower: moonshotai/Kimi-K2.5 -> {tmp_path / 'moonshotai/Kimi-K2.5'}" in r.output
        assert "tts.snac: hubertsiuzdak/snac_24khz" in r.output and "--mirror" in r.output
    assert list(tmp_path.iterdir()) == []


def test_a_mirror_without_the_repo_is_a_clear_error(mirror, tmp_path):
    _, _, _, prof, _ = mirror
    r = CliRunner().invoke(cli, ["prepare", "--profile", str(prof), "--mirror", str(tmp_path / "empty")])
    assert r.exit_code == 2 and f"{TOWER_REPO} is not in the mirror" in r.output, r.output


def test_an_unreachable_hub_is_a_fetch_error_naming_the_repo(tmp_path, monkeypatch):
    """Port 9 on the loopback refuses connections: the hub client's error becomes a FetchError, no traceback."""
    from services.config.weights import FetchError, HubSource, plan

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("CHIMERA_MODEL_DIR", str(tmp_path))
    with pytest.raises(FetchError, match=r"moonshotai/Kimi-K2\.5: hub request failed: ConnectError"):
        plan(load_profile("gpu"), HubSource(endpoint="http://127.0.0.1:9"), tmp_path)
