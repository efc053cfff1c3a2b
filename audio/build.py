"""Writing the cpu profile's speech models (``chimera prepare``).

- ``tts/lm``: a seeded random-weight ``LlamaForCausalLM`` with the Orpheus token layout placed above SmolLM2's
  49,152-token vocabulary (vocabulary = highest layout id + 1), saved with ``save_pretrained`` together with
  SmolLM2's tokenizer (``core.smollm2.smollm2_tokenizer``), so it loads like a real Orpheus checkpoint.
- ``tts/snac``: a seeded random-weight ``SNAC(**config)`` of the real 24 kHz architecture (19.8M params), as
  ``config.json`` + ``pytorch_model.bin``: the layout ``SNAC.from_pretrained`` reads from a directory.
Both are skipped when the profile has no ``build`` block (real checkpoints) or the files already exist.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from core.config import resolve_path
from core.smollm2 import smollm2_tokenizer

from .config import TTSConfig
from .layout import TokenLayout
from .snac_stream import SNAC_24KHZ_CONFIG


def build_lm(cfg: TTSConfig, out_dir: Path, tokenizer) -> None:
    """Save a seeded random ``LlamaForCausalLM`` of ``cfg.build`` sizes whose vocabulary holds the layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    b = cfg.build
    layout = TokenLayout(cfg.layout)
    lcfg = LlamaConfig(vocab_size=layout.vocab_size_needed, hidden_size=b.hidden_size,
                       intermediate_size=b.intermediate_size, num_hidden_layers=b.num_hidden_layers,
                       num_attention_heads=b.num_attention_heads, num_key_value_heads=b.num_key_value_heads,
                       max_position_embeddings=b.max_position_embeddings, tie_word_embeddings=True,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=cfg.layout.end_of_speech,
                       pad_token_id=cfg.layout.pad)
    torch.manual_seed(b.seed)
    model = LlamaForCausalLM(lcfg).eval()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():  # a model of other sizes: swap it out (a rename each, so readers see one or the other)
        old = out_dir.with_name(out_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out_dir)


def lm_matches(cfg: TTSConfig, lm_dir: Path) -> bool:
    """Whether ``lm_dir`` holds an LM of ``cfg.build``'s sizes and the layout's vocabulary (``config.json``)."""
    try:
        have = json.loads((lm_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    b = cfg.build
    want = {"hidden_size": b.hidden_size, "intermediate_size": b.intermediate_size,
            "num_hidden_layers": b.num_hidden_layers, "num_attention_heads": b.num_attention_heads,
            "num_key_value_heads": b.num_key_value_heads, "vocab_size": TokenLayout(cfg.layout).vocab_size_needed}
    return all(have.get(k) == v for k, v in want.items())


def build_snac(out_dir: Path, seed: int = 0) -> None:
    """Save a seeded random ``SNAC`` of the 24 kHz config as ``config.json`` + ``pytorch_model.bin``."""
    from snac import SNAC

    torch.manual_seed(seed)
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(SNAC_24KHZ_CONFIG, indent=1))
    torch.save(model.state_dict(), tmp / "pytorch_model.bin")
    tmp.rename(out_dir)


def prepare(cfg: TTSConfig, model_dir: Path) -> bool:
    """Build the cpu speech models into ``model_dir`` if missing (the LM also when its sizes differ from
    ``cfg.build``, e.g. after a profile change). Returns True when something was written,
    False when everything existed already (idempotent) or the profile uses real checkpoints (no ``build``)."""
    if cfg.build is None:
        return False
    model_dir = Path(model_dir)
    lm_dir, snac_dir = (Path(resolve_path(model_dir, p, local=True)) for p in (cfg.lm, cfg.snac))
    wrote = False
    if not lm_matches(cfg, lm_dir):
        lm_dir.parent.mkdir(parents=True, exist_ok=True)
        build_lm(cfg, lm_dir, smollm2_tokenizer(model_dir))
        wrote = True
    if not (snac_dir / "pytorch_model.bin").exists():
        snac_dir.parent.mkdir(parents=True, exist_ok=True)
        build_snac(snac_dir, cfg.build.seed)
        wrote = True
    return wrote
