"""Runs the quantization worker (:mod:`core.quant.worker`) in its own environment, ``.venv-quant`` (llm-compressor
0.14 pins compressed-tensors 0.19 and transformers <= 5.17, which neither the service's venv nor vLLM's can
hold); the spec JSON and the prompt file are the interface, the worker's progress lines are relayed."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from core.config import in_project

QUANT_PYTHON = ".venv-quant/bin/python"
QUANT_PYTHON_ENV = "CHIMERA_QUANT_PYTHON"  # overrides the interpreter (as CHIMERA_VLLM_PYTHON does for vLLM)
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # where `core` is importable from


class WorkerError(RuntimeError):
    """A worker run by :func:`run_module` failed (``returncode`` 2: it refused the spec, the message says why) or its
    environment is missing (``returncode`` None)."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


class QuantizeError(WorkerError):
    """The quantization worker failed or is missing (:class:`WorkerError`)."""


def quant_python() -> str:
    """The worker's interpreter: ``$CHIMERA_QUANT_PYTHON``, else ``.venv-quant/bin/python`` under the project
    directory (:func:`core.config.in_project`)."""
    return os.environ.get(QUANT_PYTHON_ENV) or str(in_project(QUANT_PYTHON))


def run_module(python: str, module: str, spec: dict, spec_path: str | Path, error: type[WorkerError],
               what: str, echo: Callable[[str], None] = print, env: dict[str, str] | None = None) -> None:
    """Write ``spec`` to ``spec_path`` and run ``python -m module spec_path`` from the project root (``core``
    importable): the files-on-disk interface of the workers that live in their own environments
    (:mod:`core.quant.worker`, :mod:`core.spec.worker`). ``echo`` gets each stdout line as it comes; stderr goes
    to a file (a chatty stderr can never block the worker). ``env``: extra environment variables. Raises
    ``error(message, returncode)`` when ``python`` is missing (run ``make install``) or the worker exits non-zero:
    exit 2 (it refused the spec) with its last stderr line, else ``what`` failed with the last stderr lines."""
    if not Path(python).exists():
        raise error(f"the {what} environment is missing ({python}): run `make install`", None)
    Path(spec_path).write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1", **(env or {})}
    with tempfile.TemporaryFile("w+") as errf:
        proc = subprocess.Popen([python, "-m", module, str(spec_path)], cwd=PROJECT_ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=errf, text=True)
        try:
            for line in proc.stdout:
                echo(line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        errf.seek(0)
        err = errf.read()
    if rc != 0:
        tail = "\n".join(l for l in err.splitlines() if l.strip())[-2000:]
        raise error(tail.splitlines()[-1] if rc == 2 and tail else f"the {what} worker failed (exit {rc}):\n{tail}",
                    rc)


def run_worker(spec: dict, spec_path: str | Path, echo: Callable[[str], None] = print) -> dict:
    """Write ``spec`` to ``spec_path``, run the worker on it (:func:`run_module`) and return the ``fidelity.json``
    it wrote in ``spec["out"]``. ``echo`` gets each progress line. Raises QuantizeError when the interpreter is
    missing (run ``make install``) or the worker fails (its last stderr lines in the message)."""
    run_module(quant_python(), "core.quant.worker", spec, spec_path, QuantizeError, "quantization", echo,
               {"LLM_COMPRESSOR_LOG_LEVEL": "ERROR"})
    from .fidelity import read_fidelity

    return read_fidelity(spec["out"])
