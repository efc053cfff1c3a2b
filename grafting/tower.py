"""The frozen vision tower: Kimi K2.5/K2.6 MoonViT (``transformers.Kimi_K25VisionModel``).

MoonViT (Kimi-VL, arXiv:2504.07491; Kimi K2.5) is a NaViT-style ViT: patch 14, packed variable-resolution
images, 2-D RoPE plus an interpolated learned position grid, and a 2x2 patch merge at the output. The real
tower has 27 layers, hidden 1152, 16 heads (~417M params); its weights sit under ``vision_tower.*`` inside the
sharded Kimi checkpoint, so :func:`load_tower_from_checkpoint` reads only those shards.

The cpu profile may instead build :class:`MoonViTConvStem` (``TowerBuild.patch_stem: conv``): MoonViT with its
linear 14-px patch embedding replaced by a small convolutional stem (Xiao et al. 2021, "Early convolutions help
transformers see better", arXiv:2106.14881); blocks, 2-D RoPE, position grid and 2x2 merge are MoonViT's, so the
processor, the token counts, the projector and the serving path are those of the real tower. GPU profiles keep the
real ``Kimi_K25VisionModel``. :func:`tower_class` picks the class a saved tower folder needs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from huggingface_hub.dataclasses import strict
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModel, Kimi_K25VisionConfig, Kimi_K25VisionModel
from transformers.models.kimi_k25.modeling_kimi_k25 import (Kimi_K25PreTrainedModel, Kimi_K25VisionEncoderLayer,
                                                            Kimi_K25VisionPositionEmbeddings,
                                                            Kimi_K25VisionRotaryEmbedding)

PATCH_STEMS = ("linear", "conv")  # TowerBuild.patch_stem: MoonViT's own patch embedding, or MoonViTConvStem's


@strict
class MoonViTConvStemConfig(Kimi_K25VisionConfig):
    """:class:`~transformers.Kimi_K25VisionConfig` plus the layout of :class:`ConvStemPatchEmbed`: the widths and
    strides (1 or 2) of its 3x3 convolutions (``stem_channels``, ``stem_strides``) and the side in pixels each
    ``patch_size`` patch is resampled to first (``stem_patch``; ``patch_size``: no resampling). ``model_type``
    ``moonvit_conv_stem``, so a saved folder is never mistaken for (and loaded as) a linear-stem MoonViT.

    Defaults: one stride-2 and two stride-1 convolutions at half resolution, then a 7x7 stride-7 projection.
    ``stem_patch=16, stem_strides=[2, 2, 2, 2]`` (with a 1x1 projection) is Xiao et al.'s stem."""

    model_type = "moonvit_conv_stem"
    stem_channels: list[int] | tuple[int, ...] = (24, 48, 48)
    stem_strides: list[int] | tuple[int, ...] = (2, 1, 1)
    stem_patch: int = 14


class ConvStemPatchEmbed(nn.Module):
    """Convolutional patch embedding with MoonViT's interface (Xiao et al. 2021, arXiv:2106.14881, adapted to 14 px).

    forward(pixel_values ``(P, 3, p, p)`` float, the processor's packed patches of every image in raster order,
    grid_thw ``(N, 3)`` long) -> ``(P, hidden)``, one row per patch in the same order, plus MoonViT's learned
    (bicubically resampled) position grid, exactly like ``Kimi_K25VisionPatchEmbed``.

    Each image's patches are put back together into its ``(t, 3, h*p, w*p)`` pixels (images of one size are batched),
    bilinearly resampled to ``(h*q, w*q)`` when ``stem_patch`` q differs from p, then ``Conv3x3/s -> BN -> GELU`` per
    ``stem_channels``/``stem_strides`` entry, and a ``k x k`` stride-``k`` convolution to ``hidden_size``
    (k = q / prod(strides); no norm, like Xiao's final 1x1): exactly one output per patch, so the grid and the token
    counts are the linear stem's. Unlike the linear stem, a patch's embedding is a non-linear function of its
    pixels and of its neighbours' border pixels. 14 is not a power of 2: either one stride-2 stage and a 7x7
    stride-7 projection (the default), or q = 16 and Xiao's four stride-2 convolutions with a 1x1 projection.
    Raises ValueError when q is not divisible by the strides' product."""

    def __init__(self, config: MoonViTConvStemConfig):
        super().__init__()
        p, q = config.patch_size, config.stem_patch
        widths, strides = list(config.stem_channels), list(config.stem_strides)
        if not isinstance(p, int) or not widths or len(widths) != len(strides) or any(s not in (1, 2) for s in strides):
            raise ValueError(f"bad conv stem: patch_size {p!r}, stem_channels {widths}, stem_strides {strides}")
        down = math.prod(strides)
        if q % down:
            raise ValueError(f"stem_patch {q} is not divisible by the stem's total stride {down}")
        self.patch_size, self.stem_patch = p, q
        layers: list[nn.Module] = []
        for c_in, c_out, st in zip([3, *widths[:-1]], widths, strides):
            layers += [nn.Conv2d(c_in, c_out, 3, st, 1, bias=False), nn.BatchNorm2d(c_out), nn.GELU()]
        self.stem = nn.Sequential(*layers)
        self.proj = nn.Conv2d(widths[-1], config.hidden_size, kernel_size=q // down, stride=q // down)
        self.pos_emb = Kimi_K25VisionPositionEmbeddings(config)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Stem + projection of whole images ``(T, 3, h*p, w*p)`` -> ``(T, hidden, h, w)``."""
        p, q = self.patch_size, self.stem_patch
        if q != p:
            h, w = pixels.shape[-2] // p, pixels.shape[-1] // p
            pixels = nn.functional.interpolate(pixels, size=(h * q, w * q), mode="bilinear", align_corners=False)
        return self.proj(self.stem(pixels))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs) -> torch.Tensor:
        """``(P, hidden)`` patch embeddings (with positions) of the packed ``(P, 3, p, p)`` patches."""
        p = self.patch_size
        grids = [tuple(g) for g in grid_thw.tolist()]
        counts = [t * h * w for t, h, w in grids]
        images = pixel_values.split(counts)
        out: list[torch.Tensor | None] = [None] * len(grids)
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, (_, h, w) in enumerate(grids):
            by_size.setdefault((h, w), []).append(i)
        for (h, w), idx in by_size.items():
            frames = torch.cat([images[i].view(grids[i][0], h, w, 3, p, p) for i in idx])  # (T, h, w, 3, p, p)
            pixels = frames.permute(0, 3, 1, 4, 2, 5).reshape(-1, 3, h * p, w * p)
            feats = self.features(pixels)  # (T, hidden, h, w)
            rows = feats.permute(0, 2, 3, 1).reshape(-1, h * w, feats.shape[1])
            start = 0
            for i in idx:
                t = grids[i][0]
                out[i] = rows[start:start + t].reshape(t * h * w, -1)
                start += t
        hidden_states = torch.cat(out) if out else pixel_values.new_zeros(0, self.proj.out_channels)
        return self.pos_emb(hidden_states, grid_thw, **kwargs)


class MoonViTConvStem(Kimi_K25VisionModel):
    """MoonViT (``Kimi_K25VisionModel``) whose patch embedding is :class:`ConvStemPatchEmbed`; everything else, and
    ``forward`` (``pixel_values (P, 3, 14, 14)``, ``grid_thw (N, 3)`` -> ``last_hidden_state (P, hidden)``,
    ``pooler_output (P/4, 4, hidden)``), is MoonViT's. The cpu profile's tower when ``TowerBuild.patch_stem`` is
    ``conv``: a from-scratch ViT on two CPU cores does not learn shape (docs/research/grafting.md), early convolutions
    give it the locality prior it lacks (arXiv:2106.14881)."""

    config_class = MoonViTConvStemConfig
    config: MoonViTConvStemConfig

    def __init__(self, config: MoonViTConvStemConfig):
        Kimi_K25PreTrainedModel.__init__(self, config)  # Kimi_K25VisionModel.__init__ with the stem swapped
        self.merge_kernel_size = config.merge_kernel_size
        self.patch_embed = ConvStemPatchEmbed(config)
        self.rotary_emb = Kimi_K25VisionRotaryEmbedding(config)
        self.layers = nn.ModuleList([Kimi_K25VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=1e-05)
        self.post_init()


AutoConfig.register(MoonViTConvStemConfig.model_type, MoonViTConvStemConfig, exist_ok=True)
AutoModel.register(MoonViTConvStemConfig, MoonViTConvStem, exist_ok=True)


def tower_class(path: str | Path) -> type[Kimi_K25VisionModel]:
    """The model class of a saved tower folder, from its ``config.json`` ``model_type``: :class:`MoonViTConvStem`
    for ``moonvit_conv_stem``, else ``Kimi_K25VisionModel`` (also for a hub id or a folder without ``config.json``,
    which ``from_pretrained`` then resolves or refuses as before)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return Kimi_K25VisionModel
    kind = json.loads(cfg.read_text()).get("model_type")
    return MoonViTConvStem if kind == MoonViTConvStemConfig.model_type else Kimi_K25VisionModel


def build_tower_config(
    hidden_size: int = 1152,
    num_hidden_layers: int = 27,
    num_attention_heads: int = 16,
    intermediate_size: int = 4304,
    pos_emb_height: int = 64,
    pos_emb_width: int = 64,
    patch_stem: str = "linear",
    stem_channels: list[int] | tuple[int, ...] = (24, 48, 48),
    stem_strides: list[int] | tuple[int, ...] = (2, 1, 1),
    stem_patch: int = 14,
) -> Kimi_K25VisionConfig:
    """A MoonViT config (patch 14, 2x2 merge); the defaults are the real K2.5 tower's sizes. ``patch_stem: conv``
    gives a :class:`MoonViTConvStemConfig` (stem layout ``stem_channels``/``stem_strides``/``stem_patch``) instead.
    Raises ValueError for another stem."""
    if patch_stem not in PATCH_STEMS:
        raise ValueError(f"patch_stem must be one of {PATCH_STEMS}, got {patch_stem!r}")
    extra = {"stem_channels": list(stem_channels), "stem_strides": list(stem_strides), "stem_patch": stem_patch}
    kind, extra = (MoonViTConvStemConfig, extra) if patch_stem == "conv" else (Kimi_K25VisionConfig, {})
    return kind(
        **extra,
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
    """A MoonViT with seeded random weights (real architecture, used by the cpu profile); a
    :class:`MoonViTConvStemConfig` gives a :class:`MoonViTConvStem`."""
    torch.manual_seed(seed)
    cls = MoonViTConvStem if isinstance(config, MoonViTConvStemConfig) else Kimi_K25VisionModel
    return cls(config).eval()


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
        path: a ``Kimi_K25VisionModel`` (or :class:`MoonViTConvStem`) directory (``save_pretrained``), or with ``key_prefix`` a full VLM
            checkpoint directory whose ``model.safetensors.index.json`` maps ``{key_prefix}*`` tensors to shards.
        dtype: parameter dtype. device: ``cpu``/``cuda:N``.
    Returns: the tower, frozen, in eval mode.
    Raises: FileNotFoundError if the checkpoint files are missing; KeyError if no tensor has the prefix.
    """
    if key_prefix:
        model = load_tower_from_checkpoint(path, key_prefix=key_prefix, dtype=dtype)
    else:
        model = tower_class(path).from_pretrained(str(path), dtype=dtype)
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
