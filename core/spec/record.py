"""``speculator.json``: what ``chimera speculator train`` measured for a draft head, and the check a server runs
before it serves one.

The file sits in the head's folder beside ``config.json`` (speculators' format). It records the verifier's
SHA-256 (:func:`core.quant.fidelity.weights_sha256`), the training settings, the prompt sets and the acceptance
per set (:func:`core.spec.acceptance.acceptance_summary`), so a head trained for other weights than the profile's
LLM is refused instead of served (it would stay lossless, but propose garbage).
"""

from __future__ import annotations

from pathlib import Path

from core.quant import fidelity
from core.vllm_marker import head_embed_rows

SPECULATOR_FILE = "speculator.json"
FORMAT_VERSION = 1


class SpeculatorError(ValueError):
    """A draft head that must not be served: no or unreadable ``speculator.json``, trained for other weights, or
    not an EAGLE-3 checkpoint in speculators' format. The message names the fix."""


def write_record(head_dir: str | Path, record: dict) -> Path:
    """Write ``record`` (with ``format`` added) as ``<head_dir>/speculator.json``; returns its path."""
    return fidelity.write_record(Path(head_dir) / SPECULATOR_FILE, FORMAT_VERSION, record)


def read_record(head_dir: str | Path) -> dict:
    """The parsed ``speculator.json`` of ``head_dir``. Raises SpeculatorError when it is missing, unreadable or of
    another format version."""
    return fidelity.read_record(Path(head_dir) / SPECULATOR_FILE, FORMAT_VERSION, SpeculatorError, "speculator",
                                "a head written by `chimera speculator train` (which measures its acceptance)",
                                "train the head again")


def verify_head(head_dir: str | Path, verifier_dir: str | Path) -> dict:
    """Check that the EAGLE-3 head in ``head_dir`` was trained for the LLM in ``verifier_dir`` and return its
    record: ``speculator.json`` readable, its verifier hash equal to that of ``verifier_dir``, ``config.json`` a
    speculators ``eagle3`` config, the rows of the head's own embedding table (if it carries one) those its config
    declares (:func:`core.vllm_marker.head_embed_rows`). Raises SpeculatorError naming the first failed check."""
    record = read_record(head_dir)
    fidelity.check_made_from(record.get("verifier_sha256"), verifier_dir, SpeculatorError,
                             f"{head_dir} was trained for other weights than",
                             "train it again with `chimera speculator train`")
    cfg = fidelity.read_config(head_dir, SpeculatorError)
    if cfg.get("speculators_model_type") != "eagle3":
        raise SpeculatorError(f"{head_dir}/config.json is not a speculators EAGLE-3 config")
    try:
        head_embed_rows(head_dir)
    except (OSError, ValueError) as exc:
        raise SpeculatorError(f"{exc}; train the head again with `chimera speculator train`") from None
    return record
