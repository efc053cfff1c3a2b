"""core.quant without a worker: llama.cpp's KL statistics against a hand-computed case, the units of a Llama model,
the selection methods on a synthetic KL with a cancelling pair, the schemes' host checks, fidelity.json's checks,
the profile option and the CLI's refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from core.quant.fidelity import QuantizedCheckpointError, verify_checkpoint, weights_sha256, write_fidelity
from core.quant.kld import concat, position_stats, summarize
from core.quant.schemes import UnsupportedSchemeError, host_refusal, require_host
from core.quant.search import greedy_path, random_subset, select, sensitivity, unit_count
from core.quant.units import Unit, llama_units

LN2 = math.log(2)


def _hand_case():
    """Two positions over 3 tokens. 1: P = (1/2, 1/4, 1/4), Q = (1/4, 1/2, 1/4), text token 0. 2: P = Q =
    (0.2, 0.3, 0.5), token 2."""
    base = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]).log()
    q = torch.tensor([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]]).log()
    return base, q, torch.tensor([0, 2])


def test_kld_statistics_match_a_hand_computed_case():
    """KLD_1 = 1/2 ln 2 - 1/4 ln 2 = ln2/4, KLD_2 = 0; same top p: 1 of 2; Δp = (-1/4, 0); PPL(base) = exp(-(ln 1/2 +
    ln 1/2)/2) = 2, PPL(Q) = exp(-(ln 1/4 + ln 1/2)/2) = sqrt 8. Computed in float64 from float32 logits of exact
    powers of two and 0.2/0.3/0.5 (float32 logs: relative error < 1e-7), hence the 1e-6 bound."""
    s = summarize(concat([position_stats(*_hand_case())]))
    a = LN2 / 4
    assert s["n"] == 2
    assert s["kld_mean"] == pytest.approx(a / 2, abs=1e-6)
    assert s["kld_se"] == pytest.approx(a / 2, abs=1e-6)  # sample std of (a, 0) is a/sqrt2, over sqrt2
    assert s["kld_percentiles"]["p100"] == pytest.approx(a, abs=1e-6)
    assert s["kld_percentiles"]["p50"] == pytest.approx(a / 2, abs=1e-6)
    assert s["kld_percentiles"]["p0"] == pytest.approx(0.0, abs=1e-6)
    assert s["same_top_pct"] == 50.0 and s["same_top_se_pct"] == pytest.approx(50.0)
    assert s["dp_mean_pct"] == pytest.approx(-12.5, abs=1e-4)
    assert s["dp_rms_pct"] == pytest.approx(100 * math.sqrt(0.0625 / 2), abs=1e-4)
    assert s["ppl_base"] == pytest.approx(2.0, abs=1e-6)
    assert s["ppl_q"] == pytest.approx(math.sqrt(8), abs=1e-6)
    assert s["ppl_ratio"] == pytest.approx(math.sqrt(2), abs=1e-6)
    assert s["ln_ppl_ratio_mean"] == pytest.approx(LN2 / 2, abs=1e-6)


def test_kld_of_identical_distributions_is_zero_and_chunks_concatenate():
    base, _, tokens = _hand_case()
    one = position_stats(base, base, tokens)
    s = summarize(concat([one, one]))
    assert s["n"] == 4 and s["kld_mean"] == 0.0 and s["same_top_pct"] == 100.0 and s["ppl_ratio"] == 1.0


def test_kld_refuses_mismatched_shapes_and_no_positions():
    base, q, tokens = _hand_case()
    with pytest.raises(ValueError, match="want"):
        position_stats(base, q[:1], tokens)
    with pytest.raises(ValueError, match="no scored positions"):
        concat([])


def _tiny_llama_names(layers: int = 2) -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1)
    return [n for n, _ in LlamaForCausalLM(cfg).named_modules()]


def test_llama_units_are_the_four_fused_groups_per_layer():
    units = llama_units(_tiny_llama_names(2))
    assert [u.name for u in units] == ["0.qkv", "0.o", "0.gate_up", "0.down", "1.qkv", "1.o", "1.gate_up", "1.down"]
    assert units[0].modules == ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                "model.layers.0.self_attn.v_proj")
    assert units[2].modules == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert all("lm_head" not in m for u in units for m in u.modules)
    with pytest.raises(ValueError, match="no Llama decoder layers"):
        llama_units(["encoder.block.0", "lm_head"])
    names = [n for n in _tiny_llama_names(1) if not n.endswith("o_proj")]
    with pytest.raises(ValueError, match="lacks model.layers.0.self_attn.o_proj"):
        llama_units(names)


def _units(n: int) -> list[Unit]:
    return [Unit(i, "down", (f"model.layers.{i}.mlp.down_proj",)) for i in range(n)]


def _kl(costs: dict[str, float], pair: tuple[str, str], joint: float):
    """Additive KL per unit, except that ``pair`` together cost ``joint`` (their errors cancel)."""
    calls = []

    def kl_of(names: frozenset[str]) -> float:
        calls.append(names)
        total = sum(costs[n] for n in names)
        if set(pair) <= names:
            total += joint - costs[pair[0]] - costs[pair[1]]
        return total
    return kl_of, calls


def test_greedy_finds_a_cancelling_pair_that_the_ranking_misses():
    """Units 0..3 cost 0.15, 0.2, 0.1, 0.3 alone; 2 and 3 together 0.05. At 2 units the ranking takes the two
    cheapest alone (2 and 0: 0.25); greedy adds 2, then the unit giving the lowest joint KL, 3 (0.05) - if the
    shortlist reaches 3, the most sensitive unit; with a shortlist of 2 it tries only 0 and 1."""
    units = _units(4)
    kl_of, calls = _kl({"0.down": 0.15, "1.down": 0.2, "2.down": 0.1, "3.down": 0.3}, ("2.down", "3.down"), 0.05)
    sens = sensitivity(kl_of, units)
    assert sens == {"0.down": 0.15, "1.down": 0.2, "2.down": 0.1, "3.down": 0.3}
    assert select("sensitivity", units, 0.5, kl_of, sens=sens) == ["2.down", "0.down"]
    path = greedy_path(kl_of, units, 2, sens, shortlist=None)
    assert [n for n, _ in path] == ["2.down", "3.down"] and path[1][1] == pytest.approx(0.05)
    calls.clear()
    short = greedy_path(kl_of, units, 2, sens, shortlist=2)
    assert [n for n, _ in short] == ["2.down", "0.down"]
    assert len(calls) == 4  # 2 steps x 2 candidates


def test_select_none_all_random_and_fraction_checks():
    units = _units(8)
    kl_of, calls = _kl({u.name: 0.1 for u in units}, ("0.down", "1.down"), 0.2)
    assert select("none", units, 0.0, kl_of) == []
    assert select("all", units, 1.0, kl_of) == [u.name for u in units]
    assert calls == []  # none, all and random need no evaluation
    r = select("random", units, 0.5, kl_of, seed=3)
    assert len(r) == 4 and r == random_subset(units, 4, 3) and r == sorted(r, key=lambda n: int(n.split(".")[0]))
    assert random_subset(units, 4, 4) != r or random_subset(units, 4, 5) != r  # the seed draws
    assert unit_count(units, 0.75) == 6
    with pytest.raises(ValueError, match="not in"):
        unit_count(units, 1.5)
    with pytest.raises(ValueError, match="quantizes every unit"):
        select("all", units, 0.5, kl_of)
    with pytest.raises(ValueError, match="unknown selection"):
        select("best", units, 0.5, kl_of)


def test_schemes_refused_where_the_host_cannot_serve_them():
    assert host_refusal("w8a8-int8", "cpu", {"avx2", "fma"}) is None
    assert "avx512f" in host_refusal("w4a16", "cpu", {"avx2"})
    assert host_refusal("w4a16", "cpu", {"avx2", "avx512f"}) is None
    assert "CUDA only" in host_refusal("fp8", "cpu", {"avx512f"})
    assert host_refusal("fp8", "cuda") is None
    with pytest.raises(UnsupportedSchemeError, match="avx512f"):
        require_host("w4a16", "cpu", {"avx2"})
    with pytest.raises(UnsupportedSchemeError, match="unknown quantization scheme 'int3'"):
        require_host("int3", "cpu")


def _checkpoint(tmp_path, scheme="w8a8-int8", quant_method="compressed-tensors"):
    ref = tmp_path / "ref"
    ref.mkdir(parents=True)
    (ref / "model.safetensors").write_bytes(b"reference weights")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": quant_method}}))
    write_fidelity(ck, {"scheme": scheme, "reference": {"sha256": weights_sha256(ref)}})
    return ref, ck


def test_verify_checkpoint_accepts_its_own_reference(tmp_path):
    ref, ck = _checkpoint(tmp_path)
    assert verify_checkpoint(ck, ref, "cuda")["scheme"] == "w8a8-int8"  # cuda: no CPU-flag dependence


def test_verify_checkpoint_refusals(tmp_path):
    ref, ck = _checkpoint(tmp_path)
    (ref / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(QuantizedCheckpointError, match="made from other weights"):
        verify_checkpoint(ck, ref)
    (ck / "fidelity.json").unlink()
    with pytest.raises(QuantizedCheckpointError, match="fidelity.json is missing"):
        verify_checkpoint(ck, ref)
    (ck / "fidelity.json").write_text("{not json")
    with pytest.raises(QuantizedCheckpointError, match="unreadable"):
        verify_checkpoint(ck, ref)
    ref2, ck2 = _checkpoint(tmp_path / "b", quant_method="gguf")
    with pytest.raises(QuantizedCheckpointError, match="no compressed-tensors"):
        verify_checkpoint(ck2, ref2)
    ref3, ck3 = _checkpoint(tmp_path / "c", scheme="fp8")
    with pytest.raises(QuantizedCheckpointError, match="CUDA only"):
        verify_checkpoint(ck3, ref3, "cpu")


def test_profile_refuses_quantized_without_the_vllm_backend():
    from core.config import VLLMOptions
    from grafting.config import VLMConfig

    with pytest.raises(ValueError, match="served only with backend: vllm"):
        VLMConfig(backend="transformers", vllm=VLLMOptions(quantized="vlm/llm-w8a8"))
    assert VLMConfig(backend="vllm", vllm=VLLMOptions(quantized="vlm/llm-w8a8")).vllm.quantized == "vlm/llm-w8a8"


def test_served_checkpoint_refuses_a_foreign_checkpoint(tmp_path):
    from core.config import VLLMOptions
    from grafting.config import VLMConfig
    from services.engines.vllm_server import served_checkpoint

    ref, ck = _checkpoint(tmp_path)
    ok = VLMConfig(backend="vllm", llm=str(ref), vllm=VLLMOptions(quantized=str(ck)))
    assert served_checkpoint(ok) == str(ck)
    assert served_checkpoint(VLMConfig(backend="vllm", llm=str(ref))) == str(ref)
    (ref / "model.safetensors").write_bytes(b"retrained")
    with pytest.raises(QuantizedCheckpointError, match="other weights"):
        served_checkpoint(ok)


@pytest.mark.parametrize("args, message", [
    (["--scheme", "fp8"], "CUDA only"),
    (["--scheme", "int3"], "unknown quantization scheme"),
    (["--select", "best"], "--select 'best'"),
    (["--select", "all", "--fraction", "0.5"], "no --fraction"),
    (["--select", "greedy"], "needs --fraction"),
    (["--family", "video"], "--family 'video'"),
    (["--fraction", "0.5", "--compare", "0.5,2"], "every fraction must be in (0, 1)"),
    (["--family", "tts", "--fraction", "0.5", "--scene-prompts", "4"], "the speech LM has none"),
])
def test_quantize_cli_refusals(args, message):
    from typer.testing import CliRunner

    from services.cli import app

    r = CliRunner().invoke(app, ["quantize", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_quantize_report_refuses_a_folder_without_fidelity(tmp_path):
    from typer.testing import CliRunner

    from services.cli import app

    r = CliRunner().invoke(app, ["quantize", "report", str(tmp_path)])
    assert r.exit_code == 2 and "fidelity.json is missing" in r.output


def test_runner_without_the_environment(tmp_path, monkeypatch):
    from core.quant.runner import QuantizeError, run_worker

    monkeypatch.setenv("CHIMERA_QUANT_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(QuantizeError, match="run `make install`"):
        run_worker({"out": str(tmp_path)}, tmp_path / "spec.json")


def test_prompt_file_round_trip_with_score_vocab(tmp_path):
    from core.quant.prompts import PromptSet, read_prompts, write_prompts

    sets = {"search": PromptSet("search", "ids", [torch.tensor([1, 2, 3])]),
            "scene": PromptSet("heldout", "embeds", [torch.ones(4, 8), torch.zeros(2, 8)])}
    path = write_prompts(tmp_path / "p.safetensors", sets, (100, 200))
    back, vocab = read_prompts(path)
    assert vocab == (100, 200) and list(back) == ["search", "scene"]
    assert back["search"].prompts[0].tolist() == [1, 2, 3] and back["scene"].prompts[1].shape == (2, 8)
    assert read_prompts(write_prompts(tmp_path / "q.safetensors", sets))[1] is None
    with pytest.raises(ValueError, match="want"):
        write_prompts(tmp_path / "r.safetensors", {"s": PromptSet("search", "", [torch.ones(3)])})
    with pytest.raises(ValueError, match="role"):
        write_prompts(tmp_path / "r.safetensors", {"s": PromptSet("fit", "", [torch.tensor([1])])})


def test_tts_prompts_are_the_engines_prompts(profile, model_dir):
    """The speech prompts are what the engine sends its LM (one builder: ``TokenLayout.speech_prompt``), and the
    score vocabulary is the layout's audio range."""
    from transformers import AutoTokenizer

    from audio.layout import TokenLayout
    from audio.quant_prompts import HELDOUT_TEXTS, tts_prompt_sets
    from core.config import resolve_path

    cfg = profile.tts.engine
    sets, vocab = tts_prompt_sets(cfg, model_dir, search=2)
    layout = TokenLayout(cfg.layout)
    assert vocab == (layout.audio_start, layout.audio_end)
    assert len(sets["speech"].prompts) == len(HELDOUT_TEXTS) and len(sets["search"].prompts) == 2
    tok = AutoTokenizer.from_pretrained(resolve_path(model_dir, cfg.tokenizer or cfg.lm))
    assert sets["speech"].prompts[1].tolist() == layout.speech_prompt(tok, cfg.voices[1], HELDOUT_TEXTS[1])
    assert sets["speech"].prompts[0][-1].item() == cfg.layout.start_of_speech


def test_units_of_a_checkpoint_with_fused_gate_up_and_their_sizes():
    """GLM-4 stores gate and up fused (``mlp.gate_up_proj``): the same four units. Sizes from a config by hand:
    hidden 8, 2 heads of 4, 1 KV head, MLP 16: qkv 8 x (2 + 2) x 4 = 128, o 64, gate_up 256, down 128."""
    from core.quant.units import quantized_weight_saving, unit_params

    names = [f"model.layers.0.{r}" for r in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    units = llama_units(names)
    assert [u.name for u in units] == ["0.qkv", "0.o", "0.gate_up", "0.down"]
    assert units[2].modules == ("model.layers.0.mlp.gate_up_proj",)
    cfg = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1}
    assert [unit_params(cfg, k) for k in ("qkv", "o", "gate_up", "down")] == [128, 64, 256, 128]
    assert quantized_weight_saving(cfg, ["0.qkv", "0.down"], 4, 8) == (128 + 128) * 3  # fp32 -> int8


def test_serve_refuses_a_quantized_checkpoint_before_ray_starts(tmp_path, profile, model_dir):
    """``chimera serve`` with ``vlm.engine.vllm.quantized`` naming a folder without ``fidelity.json``: exit 2 with
    the reason, and no Ray started (the check runs before it)."""
    import yaml
    from typer.testing import CliRunner

    from services.cli import app

    data = profile.model_dump(mode="json")
    data["model_dir"] = str(model_dir)
    data["vlm"]["engine"]["vllm"]["quantized"] = str(tmp_path / "not-quantized")
    (tmp_path / "not-quantized").mkdir()
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(app, ["serve", "--profile", str(path)])
    assert r.exit_code == 2, r.output
    assert "vlm.engine.vllm.quantized:" in r.output and "fidelity.json is missing" in r.output


def _gpu_scale_commands(qd) -> list[list[str]]:
    """Every ``run_q`` command of bench/gpu_scale.sh (continuation lines joined), its variables as the script sets
    them (``$QD`` = ``qd``), split as bash would (no other expansion is used there)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "bench/gpu_scale.sh").read_text().replace("\\\n", " ")
    lines = [ln.strip()[len("run_q "):] for ln in text.splitlines() if ln.strip().startswith("run_q ")]
    subst = {"CHIMERA": ".venv/bin/chimera", "PY": ".venv/bin/python", "QD": str(qd)}
    return [shlex.split(re.sub(r"\$(\w+)", lambda m: subst[m.group(1)], ln)) for ln in lines]


def test_gpu_scale_quantization_commands_parse_with_the_cli_as_it_is(tmp_path):
    """bench/gpu_scale.sh's FP8 rows cannot run here (no GPU, no GLM-4-9B/Orpheus weights): each of its commands
    is parsed by the parser of the program it calls (typer for chimera, argparse for the benches), its values
    checked as the CLI would (FP8 on CUDA, the selection and fraction, the --compare list, the profile), and the
    one-GPU profiles it writes name the FP8 checkpoints as ``vllm.quantized``."""
    from bench.gpu_quant import one_gpu_profile, validate
    from services.config.profiles import load_profile

    one_gpu_profile(tmp_path / "gpu1-bf16.yaml")
    one_gpu_profile(tmp_path / "gpu1-fp8.yaml", str(tmp_path / "vlm/llm-fp8-greedy-0.75"),
                    str(tmp_path / "tts/lm-fp8-greedy-0.75"))
    fp8 = load_profile(tmp_path / "gpu1-fp8.yaml")
    assert fp8.vlm.engine.vllm.quantized.endswith("llm-fp8-greedy-0.75")
    assert fp8.vlm.engine.vllm.tensor_parallel_size == 1
    assert fp8.tts.engine.vllm.quantized.endswith("lm-fp8-greedy-0.75")
    cmds = _gpu_scale_commands(tmp_path)
    assert len(cmds) >= 8
    programs = {c[1] if c[0].endswith("chimera") else c[1].rsplit("/", 1)[-1] for c in cmds}
    assert programs == {"quantize", "profile", "quantization.py", "tts_concurrency.py", "speculator", "speculator.py"}
    train = next(c for c in cmds if c[1:3] == ["speculator", "train"])
    assert train[train.index("--device") + 1] == "cuda"
    assert sum("fp8" in c and "quantize" in c[1:2] and "report" not in c for c in cmds) == 2  # vlm and tts
    for c in cmds:
        validate(c)


@pytest.mark.parametrize("bad", [
    [".venv/bin/chimera", "quantize", "--family", "vlm", "--profile", "gpu", "--scheme", "fp8", "--method", "greedy"],
    [".venv/bin/chimera", "quantize", "--family", "vlm", "--profile", "gpu", "--scheme", "fp4"],
    [".venv/bin/chimera", "quantize", "--profile", "gpu", "--scheme", "fp8", "--select", "all", "--fraction", "0.5"],
    [".venv/bin/chimera", "quantize", "--profile", "gpu-one", "--scheme", "fp8"],
    [".venv/bin/chimera", "quantize", "--profile", "gpu", "--compare", "0.5,1.5"],
    [".venv/bin/python", "bench/quantization.py", "--profile", "gpu", "--select", "random"],
    [".venv/bin/python", "bench/quantization.py", "--profile", "gpu", "--questions", "many"],
    [".venv/bin/python", "bench/tts_concurrency.py", "--profile", "gpu", "--stream-count", "8"],
    [".venv/bin/chimera", "profile", "show", "--profile", "gpu", "--gpu", "1"],
    [".venv/bin/chimera", "serve", "--profile", "gpu"],
    [".venv/bin/chimera", "speculator", "train", "--profile", "gpu", "--device", "tpu"],
    [".venv/bin/chimera", "speculator", "train", "--profile", "gpu", "--train-kinds", "images"],
    [".venv/bin/chimera", "speculator", "train", "--profile", "gpu", "--draft-tokens", "3"],
    [".venv/bin/chimera", "speculator", "show", "runs/x"],
    [".venv/bin/python", "bench/speculator.py", "--profile", "gpu", "--concurrency"],
])
def test_gpu_scale_command_validator_refuses_what_the_cli_would(bad):
    from bench.gpu_quant import validate

    with pytest.raises(ValueError):
        validate(bad)


def test_paired_difference_counts_the_discordant_questions():
    """5 questions: base right on 1,2,5, other on 1,3. b = 2 (2, 5), c = 1 (3): difference -20 points, SE
    sqrt(3 - 1/5) / 5 = 33.47 points, exact McNemar p = 2 * P(X <= 1 | 3, 1/2) = 1."""
    from grafting.train.freeform import paired_difference

    d = paired_difference([True, True, False, False, True], [True, False, True, False, False])
    assert (d["n"], d["base_only"], d["other_only"]) == (5, 2, 1)
    assert d["acc_base"] == pytest.approx(0.6) and d["acc_other"] == pytest.approx(0.4)
    assert d["diff_points"] == pytest.approx(-20.0) and d["se_points"] == pytest.approx(100 * math.sqrt(2.8) / 5)
    assert d["p_mcnemar"] == 1.0
    assert paired_difference([True] * 10, [False] * 10)["p_mcnemar"] == pytest.approx(2 / 2**10)
    assert paired_difference([True], [True])["se_points"] == 0.0
    with pytest.raises(ValueError):
        paired_difference([True], [True, False])


def test_split_roles_names_the_fitted_and_held_out_sets_or_refuses():
    """Both workers' one check of a prompt file's roles: the ``fit`` sets and the held-out sets in file order; a file
    without either is refused naming the path."""
    import torch

    from core.quant.prompts import PromptSet, split_roles

    one = [torch.tensor([1, 2])]
    sets = {"fit_a": PromptSet("search", "a", one), "chat": PromptSet("heldout", "c", one),
            "train": PromptSet("train", "t", one), "scene": PromptSet("heldout", "s", one)}
    assert split_roles("p.safetensors", sets, "search") == (["fit_a"], ["chat", "scene"])
    assert split_roles("p.safetensors", sets, "train") == (["train"], ["chat", "scene"])
    with pytest.raises(ValueError, match=r"p.safetensors: needs a search set and a held-out set, has \['chat'\]"):
        split_roles("p.safetensors", {"chat": sets["chat"]}, "search")
