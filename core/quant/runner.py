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


class QuantizeError(RuntimeError):
    """The worker failed (``returncode`` 2: it refused the spec, the message says why) or is missing."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode


def quant_python() -> str:
    """The worker's interpreter: ``$CHIMERA_QUANT_PYTHON``, else ``.venv-quant/bin/python`` under the project
    directory (:func:`core.config.in_project`)."""
    return os.environ.get(QUANT_PYTHON_ENV) or str(in_project(QUANT_PYTHON))


def run_worker(spec: dict, spec_path: str | Path, echo: Callable[[str], None] = print) -> dict:
    """Write ``spec`` to ``spec_path``, run the worker on it and return the ``fidelity.json`` it wrote in
    ``spec["out"]``. ``echo`` gets each progress line. Raises QuantizeError when the interpreter is missing (run
    ``make install``) or the worker fails (its last stderr lines in the message)."""
    python = quant_python()
    if not Path(python).exists():
        raise QuantizeError(f"the quantization environment is missing ({python}): run `make install`")
    Path(spec_path).write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error", "LLM_COMPRESSOR_LOG_LEVEL": "ERROR", "TQDM_DISABLE": "1"}
    with tempfile.TemporaryFile("w+") as errf:  # a file, not a pipe: a chatty stderr can never block the worker
        proc = subprocess.Popen([python, "-m", "core.quant.worker", str(spec_path)], cwd=PROJECT_ROOT, env=env,
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
        raise QuantizeError(tail.splitlines()[-1] if rc == 2 and tail else f"the quantization worker failed "
                            f"(exit {rc}):\n{tail}", rc)
    from .fidelity import read_fidelity

    return read_fidelity(spec["out"])
