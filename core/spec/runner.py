"""Runs the speculator worker (:mod:`core.spec.worker`) in its own environment, ``.venv-spec`` (speculators 0.9
pins torch and transformers that neither the service's venv nor vLLM's holds; ``make install`` builds it): the spec
JSON and the prompt file (:mod:`core.quant.prompts`) are the interface, the worker's progress lines are relayed
(:func:`core.quant.runner.run_module`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from core.config import in_project
from core.quant.runner import WorkerError, run_module

SPEC_PYTHON = ".venv-spec/bin/python"
SPEC_PYTHON_ENV = "CHIMERA_SPEC_PYTHON"  # overrides the interpreter (as CHIMERA_QUANT_PYTHON does for quantize)


class SpeculatorTrainError(WorkerError):
    """The speculator worker failed or is missing (:class:`core.quant.runner.WorkerError`)."""


def spec_python() -> str:
    """The worker's interpreter: ``$CHIMERA_SPEC_PYTHON``, else ``.venv-spec/bin/python`` under the project
    directory (:func:`core.config.in_project`)."""
    return os.environ.get(SPEC_PYTHON_ENV) or str(in_project(SPEC_PYTHON))


def train_head(spec: dict, spec_path: str | Path, echo: Callable[[str], None] = print) -> dict:
    """Write ``spec`` (keys: :func:`core.spec.worker.run`) to ``spec_path``, run the worker on it and return the
    ``speculator.json`` it wrote in ``spec["out"]``. ``echo`` gets each progress line. Raises SpeculatorTrainError
    when the interpreter is missing (run ``make install``) or the worker fails (its last stderr lines)."""
    run_module(spec_python(), "core.spec.worker", spec, spec_path, SpeculatorTrainError, "speculator", echo)
    from .record import read_record

    return read_record(spec["out"])
