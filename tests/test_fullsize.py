"""Real-size configs and the GPU scripts, checked on the CPU (no GPU, no network).

- bench.smoke_fullsize.FULLSIZE: each names a published config.json under configs/published, and the real architectures built from them on the
  meta device have their published sizes (MoonViT ~417M, GLM-4-9B 9.4B, Orpheus 3B 3.3B, Wan2.1-1.3B 1.42B
  parameters), so a mistyped width cannot pass.
- bench/gpu_check.sh and bench/gpu_scale.sh run with --dry-run (imports, argument parsing, profile and configs,
  meta-device shapes) so they cannot rot; make smoke-fullsize itself runs outside make test (minutes).
- gpu_scale's lever table (bench/video_speed.py's rows, bench/gpu_checks.py wan21_step_table): its dry run runs
  every row once on a tiny Wan on the CPU with the gpu profile's cache options and fast step count, and prints
  each row once, with its step count and no figure.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.smoke_fullsize import FULLSIZE, PUBLISHED, fullsize_config  # noqa: E402


def test_every_fullsize_config_is_a_published_file():
    assert set(FULLSIZE) == {"moonvit", "glm4_9b_0414", "umt5_xxl", "wan22_ti2v_5b_transformer", "wan22_vae",
                             "wan21_t2v_1_3b_transformer", "wan21_vae", "orpheus_3b", "snac_24khz"}
    listed = (PUBLISHED / "README.md").read_text()
    for name, rel in FULLSIZE.items():
        assert (PUBLISHED / rel).is_file(), rel
        assert rel.split("/")[1] in listed, f"{rel} not described in configs/published/README.md"
        cfg = fullsize_config(name)
        assert cfg and not any(k.startswith("_") or k in ("architectures", "model_type") for k in cfg)


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_meta_models_have_the_published_sizes():
    from diffusers import WanTransformer3DModel
    from transformers import Glm4Config, Glm4ForCausalLM, Kimi_K25VisionConfig, Kimi_K25VisionModel
    from transformers import LlamaConfig, LlamaForCausalLM, UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        glm = Glm4ForCausalLM(Glm4Config(**fullsize_config("glm4_9b_0414")))
        vit = Kimi_K25VisionModel(Kimi_K25VisionConfig(**fullsize_config("moonvit")))
        orpheus = LlamaForCausalLM(LlamaConfig(**fullsize_config("orpheus_3b")))
        wan21 = WanTransformer3DModel(**fullsize_config("wan21_t2v_1_3b_transformer"))
        wan22 = WanTransformer3DModel(**fullsize_config("wan22_ti2v_5b_transformer"))
        umt5 = UMT5EncoderModel(UMT5Config(**fullsize_config("umt5_xxl")))
    # published totals (model cards), to the rounding they are quoted at
    assert round(_params(glm) / 1e9, 1) == 9.4
    assert round(_params(vit) / 1e6) in range(410, 425)  # "~417M" (grafting/tower.py)
    assert round(_params(orpheus) / 1e9, 1) == 3.3  # Llama-3.2-3B 3.21B + 28,684 extra embedding rows
    assert round(_params(wan21) / 1e9, 1) == 1.4  # "1.3B": 1.42B with embeddings
    assert round(_params(wan22) / 1e9) == 5  # "5B"
    assert round(_params(umt5) / 1e9, 1) == 5.7  # UMT5-XXL encoder
    assert glm.lm_head.weight.shape == (151552, 4096) and vit.config.hidden_size == 1152


LEVER_ROWS = ["dense", "sparse 0.125", "cache mag", "cache first_block", "cache taylorseer", "sparse 0.125 + mag",
              "sparse 0.125 + first_block", "sparse 0.125 + taylorseer", "distilled: 3 steps"]


def _check_lever_table(stdout: str) -> None:
    """gpu_scale --dry-run's lever table: the header names the gpu profile's fast profile, every row appears
    once in order with its step count (4 full, the fast profile's 3) and no figure."""
    from services.config.profiles import load_profile

    assert load_profile("gpu").video.engine.fast.num_inference_steps == 3  # the distilled row's step count
    lines = stdout.splitlines()
    head = [ln for ln in lines if ln.startswith("Wan2.1 loop table")]
    assert len(head) == 1 and "4 Euler steps" in head[0] and "256 tokens" in head[0], stdout
    assert "distilled = gpu profile fast: 3 steps, FlowMatchEulerDiscreteScheduler" in head[0]
    rows = [ln for ln in lines if ln.startswith("Wan2.1 loop: ")]
    names = [ln[len("Wan2.1 loop: "):].split("  ")[0].strip() for ln in rows]
    assert names == LEVER_ROWS, stdout
    for ln, name in zip(rows, names):
        steps = 3 if name.startswith("distilled") else 4
        assert ln.split()[-2:] == [str(steps), "steps"] and "ran (tiny, CPU)" in ln, ln
    assert " s/step" not in stdout and "x vs dense" not in stdout  # no figure from a CPU dry run


@pytest.mark.parametrize("script,expect", [
    ("gpu_check.sh", ["gpu_check --dry-run", "cpu profile"]),
    ("gpu_scale.sh", ["gpu_scale --dry-run", "Wan2.1-1.3B transformer", "(21, 30, 52) = 32760 tokens",
                      "296 blocks", "GLM-4-9B-0414", "9.40B params", "Orpheus 3B LM", "MoonViT tower",
                      *(f"Wan2.1 loop: {r}" for r in LEVER_ROWS), "quantization part: 8 commands validated",
                      "speculator part: 3 commands validated"]),
])
def test_gpu_scripts_dry_run(script, expect):
    proc = subprocess.run(["bash", str(ROOT / "bench" / script), "--dry-run"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    for text in expect:
        assert text in proc.stdout, proc.stdout
    if script == "gpu_scale.sh":
        _check_lever_table(proc.stdout)


def test_gpu_scripts_reject_a_bad_argument():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "scale", "--keep", "x",
                           "--dry-run"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "invalid float value" in proc.stderr
