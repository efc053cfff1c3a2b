"""The GPU profile: it validates against the same schema, and the real architectures it names have the published
sizes (built on the meta device: nothing is downloaded or allocated)."""

from __future__ import annotations

import json

import pytest
from accelerate import init_empty_weights
from transformers import Kimi_K25VisionModel

from grafting.projector import GraftProjector, GraftProjectorConfig
from grafting.tower import build_tower_config
from services.profiles import load_profile


def test_gpu_profile_validates_without_cpu_builds():
    p = load_profile("gpu")
    assert set(p.model_ids()) == {"chimera-vlm", "chimera-video", "chimera-tts"}
    assert p.vlm.engine.build is None and p.video.engine.build is None and p.tts.engine.build is None
    assert p.vlm.engine.tower_key_prefix == "vision_tower."
    assert p.video.engine.jobs.gpus_per_job == 1
    assert p.vlm.deployment.num_gpus == 2 and p.vlm.engine.device == "auto"


def test_real_moonvit_and_projector_sizes_on_meta():
    with init_empty_weights():
        tower = Kimi_K25VisionModel(build_tower_config())  # K2.5 MoonViT: 27 layers, hidden 1152, 16 heads
        proj = GraftProjector(GraftProjectorConfig(vision_hidden_size=1152, merge_size=4, llm_hidden_size=6144))
    n_tower = sum(p.numel() for p in tower.parameters())
    n_proj = sum(p.numel() for p in proj.parameters())
    assert all(p.is_meta for p in tower.parameters())
    assert abs(n_tower - 417e6) / 417e6 < 0.005      # "about 417M params"
    assert abs(n_proj - 49.5e6) / 49.5e6 < 0.005     # GLM-5.2 graft projector 4608 -> 4608 -> 6144
    assert tower.config.merge_kernel_size == [2, 2] and tower.config.patch_size == 14


def test_gpu_profile_serves_glm4_9b_on_vllm_bf16_across_the_deployment_gpus():
    p = load_profile("gpu")
    e = p.vlm.engine
    assert e.backend == "vllm" and e.llm == "THUDM/GLM-4-9B-0414"
    assert e.vllm.dtype == "bfloat16" and e.vllm.tensor_parallel_size == p.vlm.deployment.num_gpus == 2
    assert e.vllm.python == ".venv-vllm/bin/python"


def test_vllm_tensor_parallel_must_match_the_deployment_gpus():
    from services.profiles import ProfileError, parse_profile

    data = load_profile("gpu").model_dump(mode="json")
    data["vlm"]["engine"]["vllm"]["tensor_parallel_size"] = 1
    with pytest.raises(ProfileError, match="tensor_parallel_size .1. must equal vlm.deployment.num_gpus .2."):
        parse_profile(data)
    data["vlm"]["engine"]["backend"] = "transformers"  # the transformers backend spreads by device map instead
    assert parse_profile(data).vlm.engine.backend == "transformers"
    data["vlm"]["engine"]["backend"] = "tgi"
    with pytest.raises(ProfileError, match="vlm.engine.backend"):
        parse_profile(data)


def test_speculative_decoding_is_a_typed_profile_option_passed_as_speculative_config():
    from services.profiles import ProfileError, parse_profile
    from services.vllm_server import server_spec

    data = load_profile("gpu").model_dump(mode="json")
    v = data["vlm"]["engine"]["vllm"]
    assert v["speculative"]["method"] == "ngram"  # the gpu profile's choice (no EAGLE head for GLM-4-9B-0414)
    args = server_spec(parse_profile(data).vlm.engine, "llm").args
    assert json.loads(args[args.index("--speculative-config") + 1]) == v["speculative"]
    v["speculative"] = {"method": "eagle3", "model": "org/draft", "num_speculative_tokens": 3}
    args = server_spec(parse_profile(data).vlm.engine, "llm").args
    assert json.loads(args[args.index("--speculative-config") + 1]) == v["speculative"]
    v["speculative"] = None
    assert "--speculative-config" not in server_spec(parse_profile(data).vlm.engine, "llm").args
    assert load_profile("cpu").vlm.engine.vllm.speculative is None  # off by default on the cpu profile
    bad = {"vlm.engine.vllm.speculative.ngram.num_speculative_tokens": {"method": "ngram", "num_speculative_tokens": 0},
           "vlm.engine.vllm.speculative.ngram.prompt_lookup_typo": {"method": "ngram", "num_speculative_tokens": 2,
                                                                    "prompt_lookup_typo": 3},
           "vlm.engine.vllm.speculative.ngram: Value error, prompt_lookup_min .5. must be <= prompt_lookup_max .2.":
               {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
           "vlm.engine.vllm.speculative.eagle.model": {"method": "eagle", "num_speculative_tokens": 2},
           "vlm.engine.vllm.speculative: Input tag 'medusa'": {"method": "medusa", "num_speculative_tokens": 2}}
    for key, spec in bad.items():
        v["speculative"] = spec
        with pytest.raises(ProfileError, match=key):
            parse_profile(data)
