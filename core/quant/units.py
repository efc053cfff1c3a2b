"""The choosable units of a Llama-architecture language model for mixed-precision quantization.

vLLM fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``, and a fused layer's shards must share
one scheme, so a decoder layer has four units: ``qkv`` (q_proj, k_proj, v_proj), ``o`` (o_proj), ``gate_up``
(gate_proj, up_proj) and ``down`` (down_proj). ``lm_head`` (tied to the input embeddings in SmolLM2) and the
embeddings are never units.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNIT_KINDS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
              "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
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
        if m and m["rest"] in {r for rs in UNIT_KINDS.values() for r in rs}:
            layers[int(m["index"])] = m["prefix"]
    if not layers:
        raise ValueError("no Llama decoder layers (layers.<i>.self_attn.q_proj ...) among the module names")
    units = []
    for i in sorted(layers):
        for kind, rests in UNIT_KINDS.items():
            mods = tuple(f"{layers[i]}.{i}.{r}" for r in rests)
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
