"""The quantization schemes ``chimera quantize`` writes and where vLLM can serve each, checked before any work
starts (a scheme the host cannot run is refused with the reason, never a crash inside vLLM).

Facts (vLLM 0.32 CPU backend, ``model_executor/kernels/linear/scaled_mm/cpu.py``; compressed-tensors presets):

- ``w8a8-int8``: int8 weights (symmetric, per output channel, round-to-nearest) and int8 activations (symmetric,
  per token, dynamic); llm-compressor's ``W8A8`` preset. vLLM runs it on CPU (oneDNN, AVX2 or AVX512) and CUDA.
- ``w4a16``: int4 weights (groups of 128), 16-bit activations; ``W4A16``. On CPU only where AVX512 is present
  (the AVX2 build of vLLM has no kernel for it); CUDA.
- ``fp8``: FP8 E4M3 weights (per channel) and dynamic per-token activations; ``FP8_DYNAMIC``. CUDA only.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.cpu import cpu_flags


class UnsupportedSchemeError(ValueError):
    """A scheme this host cannot serve, or an unknown one; the message gives the reason."""


@dataclass(frozen=True)
class Scheme:
    """A quantization scheme: ``name`` (the CLI's), ``preset`` (llm-compressor / compressed-tensors preset name),
    ``cpu_flags`` (the CPU flags vLLM's CPU kernel needs; None: no CPU kernel), ``cuda`` (vLLM serves it on CUDA),
    ``weight_bits`` (bits per quantized weight, for the memory plan)."""

    name: str
    preset: str
    cpu_flags: frozenset[str] | None
    cuda: bool
    weight_bits: int


SCHEMES = {s.name: s for s in (
    Scheme("w8a8-int8", "W8A8", frozenset({"avx2"}), True, 8),
    Scheme("w4a16", "W4A16", frozenset({"avx512f"}), True, 4),
    Scheme("fp8", "FP8_DYNAMIC", None, True, 8),
)}


def scheme(name: str) -> Scheme:
    """The :class:`Scheme` called ``name``. Raises UnsupportedSchemeError for an unknown name."""
    if name not in SCHEMES:
        raise UnsupportedSchemeError(f"unknown quantization scheme {name!r}: one of {', '.join(SCHEMES)}")
    return SCHEMES[name]


def host_refusal(name: str, device: str, flags: set[str] | None = None) -> str | None:
    """Why ``device`` (``"cpu"`` or ``"cuda"``) of this host cannot serve scheme ``name`` with vLLM, or None when
    it can. ``flags``: the CPU's flags (default: this host's, :func:`core.cpu.cpu_flags`)."""
    s = scheme(name)
    if device == "cuda":
        return None if s.cuda else f"{name} has no CUDA kernel in vLLM"
    if s.cpu_flags is None:
        return f"{name} has no CPU kernel in vLLM (CUDA only): use w8a8-int8 on CPU"
    have = cpu_flags()[1] if flags is None else flags
    missing = sorted(s.cpu_flags - have)
    if missing:
        return (f"{name} needs the CPU flags {', '.join(missing)} for vLLM's CPU kernel and this CPU "
                f"({cpu_flags()[0]}) lacks them: use w8a8-int8")
    return None


def require_host(name: str, device: str, flags: set[str] | None = None) -> Scheme:
    """The scheme ``name`` when :func:`host_refusal` finds no reason against it. Raises UnsupportedSchemeError
    with the reason otherwise (also for an unknown name)."""
    reason = host_refusal(name, device, flags)
    if reason:
        raise UnsupportedSchemeError(reason)
    return scheme(name)
