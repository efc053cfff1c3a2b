"""Which units to quantize: the selection methods of ``chimera quantize --select``.

All work on a ``kl_of(names) -> float`` function: the mean KL divergence (nats) of the model with exactly the
units ``names`` quantized, on the search prompts (never the held-out ones the report uses). The practitioners'
observation this tests is that errors of different units can cancel, so a jointly chosen set can quantize more at
a lower KL than a uniform recipe (``all``) or a per-unit ranking (``sensitivity``).

- ``none``: nothing quantized (the reference itself; KL 0).
- ``all``: every unit.
- ``sensitivity``: the ``n`` units with the lowest KL when each is quantized alone (one evaluation per unit).
- ``greedy``: start from nothing and add, one at a time, the unit whose addition gives the lowest joint KL (an
  addition may lower it: cancellation). Each step tries the ``shortlist`` remaining units ranked best by
  sensitivity (all remaining with ``shortlist=None``): ``n * shortlist`` evaluations instead of ``n * units``.
- ``random``: ``n`` units drawn uniformly with ``seed``.

``n = round(fraction * len(units))``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .units import Unit

METHODS = ("none", "all", "sensitivity", "greedy", "random")
KLFunction = Callable[[frozenset[str]], float]


def unit_count(units: list[Unit], fraction: float) -> int:
    """``round(fraction * len(units))``. Raises ValueError unless ``0 <= fraction <= 1``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction {fraction} is not in [0, 1]")
    return round(fraction * len(units))


def sensitivity(kl_of: KLFunction, units: list[Unit]) -> dict[str, float]:
    """KL with each unit quantized alone: ``{unit name: KL}`` (one ``kl_of`` call per unit)."""
    return {u.name: kl_of(frozenset({u.name})) for u in units}


def ranked(units: list[Unit], sens: dict[str, float]) -> list[Unit]:
    """``units`` from least to most sensitive (ties: layer order)."""
    return sorted(units, key=lambda u: (sens[u.name], u))


def greedy_path(kl_of: KLFunction, units: list[Unit], n: int, sens: dict[str, float],
                shortlist: int | None = 8, log: Callable[[str], None] | None = None) -> list[tuple[str, float]]:
    """The greedy joint search to ``n`` units: ``[(unit added, joint KL after it), ...]`` in order, so every
    prefix is the greedy set of its size. ``sens``: :func:`sensitivity` (orders the shortlist). Raises
    ValueError when ``n`` exceeds the units or ``shortlist < 1``."""
    if n > len(units) or (shortlist is not None and shortlist < 1):
        raise ValueError(f"greedy search to {n} of {len(units)} units with shortlist {shortlist}")
    chosen: set[str] = set()
    path = []
    order = [u.name for u in ranked(units, sens)]
    for step in range(n):
        left = [name for name in order if name not in chosen]
        tried = left if shortlist is None else left[:shortlist]
        kl, best = min((kl_of(frozenset(chosen | {name})), name) for name in tried)
        chosen.add(best)
        path.append((best, kl))
        if log:
            log(f"greedy {step + 1}/{n}: + {best} -> KL {kl:.5f}")
    return path


def random_subset(units: list[Unit], n: int, seed: int) -> list[str]:
    """``n`` unit names drawn uniformly without replacement by ``random.Random(seed)``, in layer order."""
    picked = set(random.Random(seed).sample([u.name for u in units], n))
    return [u.name for u in units if u.name in picked]


def selection_fraction(method: str, fraction: float | None) -> float:
    """The fraction of units ``method`` quantizes: 0.0 for ``none`` and 1.0 for ``all`` (``fraction`` None or that
    value), else ``fraction`` itself. The one check of a ``--select``/``--fraction`` pair (the CLI refuses with its
    message before any work). Raises ValueError for an unknown method, a fraction that contradicts ``none``/``all``,
    or a missing or out-of-range one for the others."""
    if method not in METHODS:
        raise ValueError(f"unknown selection --select {method!r}: one of {', '.join(METHODS)}")
    if method in ("none", "all"):
        fixed = 0.0 if method == "none" else 1.0
        if fraction is not None and fraction != fixed:
            raise ValueError(f"--select {method} quantizes {'no' if method == 'none' else 'every'} unit: no "
                             f"--fraction (its fraction is {fixed}, not {fraction})")
        return fixed
    if fraction is None or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--select {method} needs --fraction in [0, 1]" + ("" if fraction is None else
                                                                            f", not {fraction}"))
    return fraction


def select(method: str, units: list[Unit], fraction: float, kl_of: KLFunction, seed: int = 0,
           shortlist: int | None = 8, sens: dict[str, float] | None = None,
           log: Callable[[str], None] | None = None) -> list[str]:
    """The unit names ``method`` quantizes at ``fraction`` (checked by :func:`selection_fraction`: ``none`` and
    ``all`` take 0.0 and 1.0). ``sens``: a precomputed :func:`sensitivity` (else computed here when needed).
    Raises ValueError as :func:`selection_fraction` does."""
    n = unit_count(units, selection_fraction(method, fraction))
    if method == "random":
        return random_subset(units, n, seed)
    if method in ("none", "all"):
        return [u.name for u in units][:n]
    sens = sens if sens is not None else sensitivity(kl_of, units)
    if method == "sensitivity":
        return [u.name for u in ranked(units, sens)[:n]]
    return [name for name, _ in greedy_path(kl_of, units, n, sens, shortlist, log)]
