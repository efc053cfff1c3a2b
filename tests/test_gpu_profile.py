"""The GPU profile: it validates against the same schema, and the real architectures it names have the published
sizes (built on the meta device: nothing is downloaded or allocated)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from accelerate import init_empty_weights
from transformers import Kimi_K25VisionModel

from grafting.projector import GraftProjector, GraftProjectorConfig
from grafting.tower import build_tower_config
from services.config.profiles import CONFIG_DIR, load_profile, parse_profile

CONFIG_PUBLISHED = CONFIG_DIR / "published"


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
    from services.config.profiles import ProfileError, parse_profile

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
    from services.config.profiles import ProfileError, parse_profile
    from services.engines.vllm_server import server_spec

    data = load_profile("gpu").model_dump(mode="json")
    v = data["vlm"]["engine"]["vllm"]
    assert v["speculative"] is None  # off until verified with this profile's vLLM (configs/gpu.yaml)
    v["speculative"] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
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


def test_cpu_profile_vllm_kv_caches_hold_their_batches_and_no_more_than_needed(model_dir):
    """On CPU vLLM allocates its whole KV cache at start and it stays resident, so the cpu profile sizes each
    (``--kv-cache-memory-bytes``): at least ``max_batch_size`` full-length sequences of the real configs (KV bytes
    per token from grafting.memory), and for the tiny speech LM far below vLLM's CPU default of 4 GiB."""
    from core.memory import kv_bytes_per_token, read_config
    from services.engines.vllm_server import server_spec, speech_server_spec

    prof = load_profile("cpu")
    for spec, cfg, llm in ((server_spec(prof.vlm.engine, "llm"), prof.vlm.engine, prof.vlm.engine.llm),
                           (speech_server_spec(prof.tts.engine, "lm"), prof.tts.engine, prof.tts.engine.lm)):
        a = spec.args
        kv, ctx = int(a[a.index("--kv-cache-memory-bytes") + 1]), int(a[a.index("--max-model-len") + 1])
        per_token = kv_bytes_per_token(read_config(model_dir / llm), 4)  # fp32
        assert kv // (per_token * ctx) >= cfg.max_batch_size, (llm, kv, per_token, ctx)
        assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env
    assert kv <= 64 << 20  # the speech LM: 512 B a token


def test_a_float32_int8_engine_is_told_there_is_no_amx(model_dir):
    """vLLM 0.32's CPU int8 linear takes its AMX kernel on AMX CPUs whatever the activations' dtype, and that kernel
    refuses float32 ("expect A to be bfloat16 or half": the engine dies at its first request; seen on an Intel Xeon
    with AMX, tests/test_quant_vllm.py). A quantized checkpoint served in float32 gets CHIMERA_ENGINE_NO_AMX=1, and
    engine_site/sitecustomize.py then answers vLLM's ``torch.cpu._is_amx_tile_supported()`` with False; bf16 and
    unquantized engines keep AMX."""
    import os
    import subprocess
    import sys

    import torch.cpu

    from services.engines.process import ENGINE_SITE
    from services.engines.vllm_server import NO_AMX_ENV, server_spec

    engine = load_profile("cpu").vlm.engine
    assert engine.vllm.dtype in (None, "float32") and NO_AMX_ENV not in server_spec(engine, "llm").env
    quantized = engine.model_copy(update={"vllm": engine.vllm.model_copy(update={"quantized": "q"})})
    assert server_spec(quantized, "llm").env[NO_AMX_ENV] == "1"
    bf16 = quantized.model_copy(update={"vllm": quantized.vllm.model_copy(update={"dtype": "bfloat16"})})
    assert NO_AMX_ENV not in server_spec(bf16, "llm").env
    probe = "import torch.cpu; print(torch.cpu._is_amx_tile_supported())"
    for flag, want in (("1", "False"), (None, None)):
        env = {k: v for k, v in os.environ.items() if k != NO_AMX_ENV} | {"PYTHONPATH": ENGINE_SITE}
        if flag:
            env[NO_AMX_ENV] = flag
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == (want or str(torch.cpu._is_amx_tile_supported()))  # unset: the CPU's answer


# --- memory plan (services/config/memory_plan.py; model math in grafting/video/audio .memory) ---------------------------

GB = 10**9  # GPU sizes as sold: "80 GB" (H100/A100) and "141 GB" (H200), in decimal bytes (74.5 / 131.3 GiB)


def test_kv_cache_and_latent_grid_math_on_the_published_configs():
    from core.memory import causal_lm_params, kv_bytes_per_token, read_config
    from services.config.memory_plan import PUBLISHED
    from video.memory import latent_grid

    glm = read_config(PUBLISHED / "THUDM/GLM-4-9B-0414")
    orpheus = read_config(PUBLISHED / "canopylabs/orpheus-3b-0.1-ft")
    assert kv_bytes_per_token(glm, 2) == 2 * 40 * 2 * 128 * 2            # K+V x layers x kv heads x dim x bf16
    assert kv_bytes_per_token(glm, 2, tp=2) == 2 * 40 * 1 * 128 * 2      # one KV head per GPU at tp=2
    assert kv_bytes_per_token(orpheus, 2) == 2 * 28 * 8 * 128 * 2
    assert abs(causal_lm_params(glm) - 9.40e9) / 9.40e9 < 0.005          # "GLM-4-9B": 9.40B with embeddings
    assert abs(causal_lm_params(orpheus) - 3.30e9) / 3.30e9 < 0.005      # Llama-3.2-3B + audio rows
    wan22 = PUBLISHED / "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    tr, vae = read_config(wan22, "transformer"), read_config(wan22, "vae")
    assert latent_grid(121, 1280, 704, vae, tr) == (31, 44, 80, 31 * 22 * 40)
    wan21_vae = {"scale_factor_temporal": 4, "scale_factor_spatial": 8}   # Wan2.1: 8x spatial, patch 1x2x2
    assert latent_grid(81, 832, 480, wan21_vae, {"patch_size": [1, 2, 2]}) == (21, 60, 104, 21 * 30 * 52)


def _by_owner(p):
    return {pl.owner: pl for pl in p.placements}


@pytest.mark.parametrize("gpu_gb", [80, 141])
def test_gpu_profile_fits_80_and_141_gb_gpus_as_configured(gpu_gb):
    from services.config.memory_plan import GIB, plan

    p = plan(load_profile("gpu"), gpu_gb * GB)
    assert p.fits, p.problems
    owners = _by_owner(p)
    assert {o: pl.gpus for o, pl in owners.items()} == {"vlm[0]": [0, 1], "tts[0]": [2], "video job worker 0": [3]}
    vlm = owners["vlm[0]"]
    share = vlm.per_gpu[0]
    assert share.what == "vLLM share" and share.bytes == int(0.85 * gpu_gb * GB)
    weights = {x.what: x.bytes for pl in p.placements for x in pl.first}
    assert weights["tower weights"] == 416866032 * 2                     # MoonViT 27 x 1152, bf16
    assert weights["transformer weights"] == 4999787712 * 2              # Wan2.2-TI2V-5B, bf16
    assert weights["text encoder weights"] == 5680910336 * 2             # UMT5-XXL encoder, bf16
    assert weights["vae weights"] == 704688668 * 4                       # Wan2.2 VAE, fp32
    assert weights["snac weights"] == 19842914 * 4                       # SNAC 24 kHz, fp32
    tts = owners["tts[0]"]  # the speech LM on vLLM: its share on GPU 2, SNAC in the replica beside it
    assert tts.per_gpu[0].what == "vLLM share" and tts.per_gpu[0].bytes == int(0.85 * gpu_gb * GB)
    assert p.used[2] == tts.per_gpu[0].bytes + sum(x.bytes for x in tts.first)
    assert "lm weights" not in {x.what for x in tts.first}
    # GPU 0 = vLLM's share + what the replica keeps there (tower, projector, activations, CUDA context)
    assert p.used[0] == share.bytes + sum(x.bytes for x in vlm.first) and p.used[1] == share.bytes
    assert max(p.used) <= gpu_gb * GB
    seqs = int(re.search(r"holds (\d+) full-length sequences", " ".join(vlm.notes)).group(1))
    assert seqs >= 16  # every sequence vLLM decodes together (max_num_seqs) fits at full length
    assert p.used[3] / GIB < 30  # one video job at 1152x800x121 (the limits' largest clip)


def test_a_profile_too_big_for_its_gpus_is_refused_at_serve_start_with_the_numbers(tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from services.cli import app as cli
    from services.config.memory_plan import PlanError, check, plan

    small = plan(load_profile("gpu"), 16 * GB)
    assert not small.fits
    text = "\n".join(small.problems)
    assert re.search(r"GPU 0: \d+\.\d\d GiB > 14\.90 GiB \(vlm\[0\] vLLM share 12\.67", text), text
    assert re.search(r"GPU 3: 2\d\.\d\d GiB > 14\.90 GiB \(video job worker 0 transformer weights 9\.31", text), text
    data = load_profile("gpu").model_dump(mode="json")
    data["ray"]["gpu_memory_gib"] = 16
    prof = tmp_path / "small.yaml"
    prof.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match="profile gpu does not fit its GPUs"):
        check(load_profile(prof))
    ray_starts = []  # refused before Ray starts (another test of the session may have a Ray running already)
    monkeypatch.setattr("services.serve_app.init_ray", lambda *a, **k: ray_starts.append(a))
    r = CliRunner().invoke(cli, ["serve", "--profile", str(prof)])
    assert r.exit_code == 2 and "does not fit" in r.output and "GPU 3:" in r.output, r.output
    assert ray_starts == []
    data["vlm"]["engine"]["vllm"]["gpu_memory_utilization"] = 0.3        # 0.3 x 24 GiB < 8.75 GiB of weights
    data["ray"]["gpu_memory_gib"] = 24
    prof.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match=r"vlm\[0\]: vLLM needs 1\d\.\d\d GiB per GPU .* but gets 7\.20 GiB"):
        check(load_profile(prof))


def test_a_speech_vllm_share_too_small_for_its_kv_cache_is_a_problem():
    """The speech LM's share holds its weights and the KV cache of max_ongoing_requests full sentences (vLLM
    refuses to start otherwise): 0.2 x 80 GB = 14.9 GiB < 6.15 + 14.90 + ... GiB is named as a problem."""
    from services.config.memory_plan import plan

    data = load_profile("gpu").model_dump(mode="json")
    data["tts"]["engine"]["vllm"]["gpu_memory_utilization"] = 0.2
    p = plan(parse_profile(data), 80 * GB)
    assert not p.fits
    assert any(re.match(r"tts\[0\]: vLLM needs 22\.\d\d GiB .* KV cache of 16 requests\) but gets 14\.90 GiB", x)
               for x in p.problems), p.problems


def test_profile_show_prints_the_plan(tmp_path):
    from typer.testing import CliRunner

    from services.cli import app as cli

    r = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu", "--gpu-memory-gib", "80"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "profile gpu: 4 GPUs x 80.0 GiB (85.9 GB)" and lines[-1] == "fits"
    assert "vlm[0] on GPU 0,1" in lines and "tts[0] on GPU 2" in lines and "video job worker 0 on GPU 3" in lines
    tts = lines.index("tts[0] on GPU 2")  # the speech LM in vLLM's share; SNAC in the replica beside it
    assert lines[tts + 1].split()[:4] == ["vLLM", "share", "68.00", "GiB"]
    assert re.match(r"\s+snac weights\s+0\.07 GiB  on GPU 2", lines[tts + 2])
    assert "  note: inside vLLM's share: lm weights 6.15 GiB, kv cache 14.90 GiB" in lines[tts + 4]
    assert "GPU 1: 68.00 of 80.00 GiB (73.01 of 85.90 GB)" in lines
    tiny = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu", "--gpu-memory-gib", "16"])
    assert tiny.exit_code == 1 and "DOES NOT FIT" in tiny.output
    cpu = CliRunner().invoke(cli, ["profile", "show", "--profile", "cpu"])
    assert cpu.exit_code == 0 and "nothing to plan" in cpu.output


def test_profile_show_without_a_gpu_size_plans_80_gb_gpus_and_says_so(monkeypatch):
    """Issue 24: on a machine without CUDA, ``profile show --profile gpu`` exited 2 unless ``--gpu-memory-gib``
    was given (the README shows it optional). Now it plans for 80 GB GPUs and says so; ``--gpu-memory`` takes a
    size with its unit (80GB decimal, 74.5GiB binary), and 80GB gives the README table's 80 GB row."""
    from typer.testing import CliRunner

    from services.cli import app as cli

    monkeypatch.setattr("services.config.memory_plan.local_gpu_bytes", lambda: None)  # as on a CPU-only machine
    r = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("GPU size: no ray.gpu_memory_gib in the profile and no CUDA device here; "
                               "planning for 74.5 GiB (80.0 GB) GPUs"), lines[0]
    assert lines[1] == "profile gpu: 4 GPUs x 74.5 GiB (80.0 GB)" and lines[-1] == "fits"
    gb = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu", "--gpu-memory", "80GB"])
    assert gb.exit_code == 0 and gb.output.splitlines() == lines[1:]
    # the README table's "80 GB (74.5 GiB)" row: GPU 0 66.81 GiB, GPU 1 63.33, GPU 2 64.40, GPU 3 28.80
    assert [x.split(" of ")[0] for x in lines if x.startswith("GPU ") and " of " in x] == [
        "GPU 0: 66.81", "GPU 1: 63.33", "GPU 2: 64.40", "GPU 3: 28.80"]
    gib = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu", "--gpu-memory", "80 gib"])
    same = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu", "--gpu-memory-gib", "80"])
    assert gib.exit_code == 0 and gib.output == same.output and "x 80.0 GiB (85.9 GB)" in gib.output
    for bad in ("80", "80TB", "-1GB", "0GiB"):
        r = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu", "--gpu-memory", bad])
        assert r.exit_code == 2 and "with its unit, e.g. 80GB or 74.5GiB" in r.output, (bad, r.output)
    both = CliRunner().invoke(cli, ["profile", "show", "--profile", "gpu", "--gpu-memory", "80GB",
                                    "--gpu-memory-gib", "80"])
    assert both.exit_code == 2 and "once" in both.output


def test_a_fetched_checkpoint_config_is_used_before_the_published_one(tmp_path, monkeypatch):
    import json

    from services.config.memory_plan import plan

    d = tmp_path / "THUDM/GLM-4-9B-0414"
    d.mkdir(parents=True)
    glm = json.loads((CONFIG_PUBLISHED / "THUDM/GLM-4-9B-0414/config.json").read_text())
    glm["num_hidden_layers"] = 20  # a smaller variant in the model dir: the plan must count its weights
    (d / "config.json").write_text(json.dumps(glm))
    monkeypatch.setenv("CHIMERA_MODEL_DIR", str(tmp_path))
    full = plan(load_profile("gpu"), 80 * GB)
    monkeypatch.delenv("CHIMERA_MODEL_DIR")
    ref = plan(load_profile("gpu"), 80 * GB)
    note = " ".join(_by_owner(full)["vlm[0]"].notes)
    ref_note = " ".join(_by_owner(ref)["vlm[0]"].notes)
    w = float(re.search(r"llm weights (\d+\.\d\d) GiB", note).group(1))
    w_ref = float(re.search(r"llm weights (\d+\.\d\d) GiB", ref_note).group(1))
    assert w_ref == 8.75 and 4.5 < w < 5.5  # 20 of 40 layers plus the unchanged embeddings and head


def test_gpus_taken_by_replicas_leave_none_for_video_jobs():
    from services.config.memory_plan import plan, uses_gpus

    data = load_profile("gpu").model_dump(mode="json")
    data["video"]["deployment"]["num_gpus"] = 1  # the video front would hold a GPU of its own
    p = plan(parse_profile(data), 80 * GB)
    assert {pl.owner: pl.gpus for pl in p.placements} == {"vlm[0]": [0, 1], "video[0]": [2], "tts[0]": [3]}
    assert p.problems == ["video job worker 0 of 1 needs 1 GPUs; not enough free of 4"]
    assert not uses_gpus(load_profile("cpu")) and uses_gpus(load_profile("gpu"))


def test_every_video_job_worker_gets_its_gpus():
    """The job manager starts ``jobs.workers`` workers of ``gpus_per_job`` GPUs each: the plan places each one and
    counts their GPUs when the profile does not say how many there are."""
    from services.config.memory_plan import plan

    data = load_profile("gpu").model_dump(mode="json")
    data["video"]["engine"]["jobs"]["workers"] = 2
    data["ray"]["num_gpus"] = None
    p = plan(parse_profile(data), 80 * GB)
    assert {pl.owner: pl.gpus for pl in p.placements} == {"vlm[0]": [0, 1], "tts[0]": [2],
                                                          "video job worker 0": [3], "video job worker 1": [4]}
    assert p.problems == []
    p = plan(parse_profile(data), 80 * GB, n_gpus=4)
    assert p.problems == ["video job worker 1 of 2 needs 1 GPUs; not enough free of 4"]


def test_kv_formula_equals_the_cache_transformers_really_allocates():
    """The KV bytes per token of the plan == the bytes of the cache a real forward pass fills, for Orpheus's and
    GLM-4's attention geometry (real head counts, head_dim and hidden size; 2 layers, a 256-wide MLP and a 1000-token
    vocabulary keep it small: none of those enters the per-layer cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.memory import kv_bytes_per_token, read_config
    from services.config.memory_plan import PUBLISHED

    for repo in ("canopylabs/orpheus-3b-0.1-ft", "THUDM/GLM-4-9B-0414"):
        cfg = {**read_config(PUBLISHED / repo), "num_hidden_layers": 2, "vocab_size": 1000, "intermediate_size": 256}
        cfg.pop("architectures")
        cfg.update(pad_token_id=0, eos_token_id=1)  # ids inside the small vocabulary
        hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf).eval()
        tokens = 7
        with torch.no_grad():
            cache = model(torch.arange(tokens)[None], use_cache=True).past_key_values
        got = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        b = next(model.parameters()).element_size()  # the config's torch_dtype, bfloat16: 2 bytes
        assert b == 2 and got == kv_bytes_per_token({**cfg, "num_hidden_layers": 2}, b) * tokens, repo


def test_memory_plan_counts_a_quantized_llm_at_its_weight_bits(tmp_path):
    """``vlm.engine.vllm.quantized`` (an FP8 checkpoint of GLM-4-9B with every unit quantized, as its
    fidelity.json lists them) shrinks the LLM weights in vLLM's share by the quantized units' bytes: per layer
    qkv 4096 x (32 + 2 x 2) x 128 = 18,874,368, o 16,777,216, gate_up 2 x 4096 x 13696 = 112,197,632, down
    56,098,816 = 203,948,032 weights, x 40 layers, 1 byte saved each (bf16 -> fp8), over the 2 GPUs of tensor
    parallelism. Before the checkpoint is made, the plan counts full precision and says so."""
    from core.quant.fidelity import write_fidelity
    from services.config.memory_plan import GIB, plan

    def llm_gib(p):
        vlm = next(pl for pl in p.placements if pl.owner == "vlm[0]")
        return float(re.search(r"llm weights ([0-9.]+) GiB", " ".join(vlm.notes)).group(1)), vlm.notes

    data = load_profile("gpu").model_dump(mode="json")
    base, _ = llm_gib(plan(parse_profile(data), 80 * GB))
    ck = tmp_path / "glm-fp8"
    data["vlm"]["engine"]["vllm"]["quantized"] = str(ck)
    missing, notes = llm_gib(plan(parse_profile(data), 80 * GB))
    assert missing == base and any("not made yet" in n for n in notes)
    ck.mkdir()
    units = [f"{i}.{k}" for i in range(40) for k in ("qkv", "o", "gate_up", "down")]
    write_fidelity(ck, {"scheme": "fp8", "quantized_units": units, "units_total": 160, "reference": {"sha256": "-"}})
    quant, _ = llm_gib(plan(parse_profile(data), 80 * GB))
    saved = 203_948_032 * 40 * 1 // 2
    assert quant == pytest.approx(base - saved / GIB, abs=0.011)  # both notes round to 0.01 GiB


def test_a_gpu_deployment_surges_only_when_asked_and_the_plan_counts_its_surge_replicas():
    """``max_surge_percent`` defaults to 100 without GPUs and 0 with them (a surge replica needs GPUs of its own);
    set on the GPU VLM, the plan places its surge replica (two more GPUs, a second vLLM share) after the replicas
    and, without a ``ray.num_gpus``, counts its GPUs."""
    from services.config.memory_plan import plan

    gpu, cpu = load_profile("gpu"), load_profile("cpu")
    assert (gpu.vlm.deployment.surge_percent(), gpu.tts.deployment.surge_percent()) == (0, 0)
    assert gpu.video.deployment.surge_percent() == 100 and gpu.server.ingress.surge_percent() == 100
    assert {f: s.deployment.surge_percent() for f, s in cpu.families().items()} == {"vlm": 100, "video": 100,
                                                                                    "tts": 100}
    assert [d.surge_replicas() for d in (gpu.vlm.deployment, cpu.vlm.deployment)] == [0, 1]
    data = gpu.model_dump(mode="json")
    data["vlm"]["deployment"]["max_surge_percent"] = 50
    p = plan(parse_profile(data), 80 * GB)  # 4 GPUs: vlm 0-1, its surge replica 2-3, nothing left for speech
    assert {pl.owner: pl.gpus for pl in p.placements} == {"vlm[0]": [0, 1], "vlm[surge 0]": [2, 3]}
    assert p.used[2] == p.used[0]
    assert p.problems[0] == "tts[0] needs 1 GPUs; not enough free of 4"
    data["ray"]["num_gpus"] = None
    p = plan(parse_profile(data), 80 * GB)
    assert p.n_gpus == 6 and p.fits, p.problems
