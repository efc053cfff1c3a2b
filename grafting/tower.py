"""The frozen vision tower: Kimi K2.5/K2.6 MoonViT (``transformers.Kimi_K25VisionModel``).

MoonViT (Kimi-VL, arXiv:2504.07491; Kimi K2.5) is a NaViT-style ViT: patch 14, packed variable-resolution
images, 2-D RoPE plus an interpolated learned position grid, and a 2x2 patch merge at the output. The real
tower has 27 layers, hidden 1152, 16 heads (~417M params); its weights sit under ``vision_tower.*`` inside the
sharded Kimi checkpoint, so :func:`load_tower_from_checkpoint` reads only those shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Kimi_K25VisionConfig, Kimi_K25VisionModel


def build_tower_config(
    hidden_size: int = 1152,
    num_hidden_layers: int = 27,
    num_attention_heads: int = 16,
    intermediate_size: int = 4304,
    pos_emb_height: int = 64,
    pos_emb_width: int = 64,
) -> Kimi_K25VisionConfig:
    """A MoonViT config (patch 14, 2x2 merge); the defaults are the real K2.5 tower's sizes."""
    return Kimi_K25VisionConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        pos_emb_height=pos_emb_height,
        pos_emb_width=pos_emb_width,
        patch_size=14,
        merge_kernel_size=[2, 2],
    )


def build_random_tower(config: Kimi_K25VisionConfig, seed: int = 0) -> Kimi_K25VisionModel:
    """A MoonViT with seeded random weights (real architecture, used by the cpu profile)."""
    torch.manual_seed(seed)
    return Kimi_K25VisionModel(config).eval()


def freeze(module: torch.nn.Module) -> torch.nn.Module:
    """Put a module in eval mode and turn off gradients of all its parameters (in place)."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def load_tower(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               key_prefix: str | None = None) -> Kimi_K25VisionModel:
    """Load a frozen MoonViT with ``from_pretrained``, or only its tensors out of a larger checkpoint.

    Args:
        path: a ``Kimi_K25VisionModel`` directory (``save_pretrained``), or with ``key_prefix`` a full VLM
            checkpoint directory whose ``model.safetensors.index.json`` maps ``{key_prefix}*`` tensors to shards.
        dtype: parameter dtype. device: ``cpu``/``cuda:N``.
    Returns: the tower, frozen, in eval mode.
    Raises: FileNotFoundError if the checkpoint files are missing; KeyError if no tensor has the prefix.
    """
    if key_prefix:
        model = load_tower_from_checkpoint(path, key_prefix=key_prefix, dtype=dtype)
    else:
        model = Kimi_K25VisionModel.from_pretrained(str(path), dtype=dtype)
    return freeze(model.to(device))


def tower_shards(index_path: str | Path, key_prefix: str = "vision_tower.") -> dict[str, list[str]]:
    """Read a ``model.safetensors.index.json`` and map each shard file to the tensor names under ``key_prefix``.

    Returns ``{shard_file: [tensor names]}`` for only the shards that hold tower tensors.
    Raises KeyError when no tensor starts with ``key_prefix``.
    """
    weight_map: dict[str, str] = json.loads(Path(index_path).read_text())["weight_map"]
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if name.startswith(key_prefix):
            shards.setdefault(shard, []).append(name)
    if not shards:
        raise KeyError(f"no tensor named {key_prefix}* in {index_path}")
    return shards


def load_tower_from_checkpoint(checkpoint_dir: str | Path, key_prefix: str = "vision_tower.",
                               dtype: torch.dtype = torch.float32,
                               config: Kimi_K25VisionConfig | None = None) -> Kimi_K25VisionModel:
    """Load MoonViT out of a sharded VLM checkpoint, opening only the shards that hold ``key_prefix`` tensors.

    The tower config is ``config``, else the ``vision_config`` of the checkpoint's ``config.json``.
    Raises FileNotFoundError (no index / shard), KeyError (no tower tensors), RuntimeError (missing or
    unexpected tower weights).
    """
    checkpoint_dir = Path(checkpoint_dir)
    index = checkpoint_dir / "model.safetensors.index.json"
    if not index.exists():
        raise FileNotFoundError(f"{index} not found")
    if config is None:
        full = json.loads((checkpoint_dir / "config.json").read_text())
        config = Kimi_K25VisionConfig(**{k: v for k, v in full["vision_config"].items() if k != "model_type"})
    with torch.device("meta"):
        model = Kimi_K25VisionModel(config)
    state: dict[str, torch.Tensor] = {}
    for shard, names in tower_shards(index, key_prefix).items():
        with safe_open(str(checkpoint_dir / shard), framework="pt") as f:
            for name in names:
                state[name[len(key_prefix):]] = f.get_tensor(name).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"tower weights do not match: missing={missing[:5]} unexpected={unexpected[:5]}")
    # Non-persistent buffers (time position table, rotary inv_freq) are not in the checkpoint: rebuild the
    # (small) modules that own them on the CPU and take their buffers.
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            fresh = type(module)(config)
            for attr, buf in fresh.named_buffers(recurse=False):
                module.register_buffer(attr, buf, persistent=False)
    return model.eval()
