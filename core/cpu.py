"""The host CPU as ``/proc/cpuinfo`` describes it: one reader for every check that depends on the ISA (the sparse
attention kernel's choice in ``video/sparse/cpu_kernels.py``, the quantization schemes vLLM's CPU backend can run
in :mod:`core.quant.schemes`)."""

from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_flags() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("?", empty set) where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = re.search(r"^model name\s*:\s*(.*)$", text, re.M).group(1).strip()
        return model, set(re.search(r"^flags\s*:\s*(.*)$", text, re.M).group(1).split())
    except (OSError, AttributeError):
        return "?", set()
