"""The choosable units of a Llama-architecture language model for mixed-precision quantization.

vLLM fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``, and a fused layer's shards must share
one scheme, so a decoder layer has four units: ``qkv`` (q_proj, k_proj, v_proj), ``o`` (o_proj), ``gate_up``
(gate_proj, up_proj; or one ``gate_up_proj`` where the checkpoint already fuses them, as GLM-4 does) and ``down``
(down_proj). ``lm_head`` (tied to the input embeddings in SmolLM2) and the embeddings are never units.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNIT_KINDS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
              "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
FUSED = {"gate_up": ("mlp.gate_up_proj",)}  # the same unit in checkpoints that store it fused
_LAYER = re.compile(r"^(?P<prefix>.*layers)\.(?P<index>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True, order=True)
class Unit:
    """One choosable unit: decoder layer ``layer``, ``kind`` (qkv, o, gate_up, down) and the full names of its
    ``modules`` (``model.layers.3.self_attn.q_proj``, ...). ``name`` is ``"<layer>.<kind>"``, e.g. ``"3.qkv"``."""

    layer: int
    kind: str
    modules: tuple[str, ...]

    @property
    def name(self) -> str:
        """``"<layer>.<kind>"``."""
        return f"{self.layer}.{self.kind}"


def llama_units(module_names: list[str]) -> list[Unit]:
    """The units of a model from its module names (``model.named_modules()`` names), in layer order then
    qkv, o, gate_up, down. Raises ValueError when a layer lacks one of a unit's modules (not a Llama layout)."""
    names = set(module_names)
    layers: dict[int, str] = {}
    for n in module_names:
        m = _LAYER.match(n)
        if m and m["rest"] in {r for rs in (*UNIT_KINDS.values(), *FUSED.values()) for r in rs}:
            layers[int(m["index"])] = m["prefix"]
    if not layers:
        raise ValueError("no Llama decoder layers (layers.<i>.self_attn.q_proj ...) among the module names")
    units = []
    for i in sorted(layers):
        for kind, rests in UNIT_KINDS.items():
            mods = tuple(f"{layers[i]}.{i}.{r}" for r in rests)
            fused = tuple(f"{layers[i]}.{i}.{r}" for r in FUSED.get(kind, ()))
            if fused and all(m in names for m in fused):
                mods = fused
            lacking = [m for m in mods if m not in names]
            if lacking:
                raise ValueError(f"layer {i} lacks {', '.join(lacking)}: not a Llama layout")
            units.append(Unit(i, kind, mods))
    return units


def unit_by_name(units: list[Unit], name: str) -> Unit:
    """The unit called ``name`` (``"3.qkv"``). Raises KeyError for an unknown name."""
    for u in units:
        if u.name == name:
            return u
    raise KeyError(f"no unit {name!r}")


def unit_params(cfg: dict, kind: str) -> int:
    """Weight parameters of one ``kind`` unit of a decoder layer of the Llama-style LM that ``cfg`` (its
    ``config.json``) describes: qkv ``h * (heads + 2 kv_heads) * head_dim``, o ``heads * head_dim * h``, gate_up
    ``2 h I``, down ``I h`` (biases left out). Raises KeyError for an unknown kind."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = int(cfg.get("head_dim") or h // heads)
    return {"qkv": h * (heads + 2 * kv) * hd, "o": heads * hd * h, "gate_up": 2 * h * inter, "down": inter * h}[kind]


def quantized_weight_saving(cfg: dict, unit_names: list[str], dtype_bytes: int, weight_bits: int) -> int:
    """Bytes saved when the units ``unit_names`` (``"3.qkv"``) hold ``weight_bits``-bit weights instead of
    ``dtype_bytes``-byte ones (scales not counted: one per output channel or per 128 weights, under 1 %)."""
    per_weight = dtype_bytes - weight_bits / 8
    return int(sum(unit_params(cfg, n.split(".", 1)[1]) for n in unit_names) * per_weight)
