"""Issue 25 (packaging): ``pip install .`` (not editable) gives a package that works outside the source tree.

The wheel is built from a copy of the source tree (no venvs, no models, no git) with this venv's setuptools, so no
network is used; it is installed with ``--no-deps --target`` into a folder of its own, which goes first on
``PYTHONPATH`` (ahead of this venv's editable install of the checkout), and ``chimera profile show`` runs from a
directory outside both trees. Relative paths of a profile (``model_dir``, ``vllm.python``) point into the project
directory (``$CHIMERA_HOME`` or the current directory), never into the installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The distribution's top-level import names: the packages the project was specified with, plus the ground layer.
TOP_LEVEL = {"audio", "configs", "core", "grafting", "services", "video"}
# Runtime files that are not Python modules of a package, each of which the service reads at run time.
DATA_FILES = ["configs/cpu.yaml", "configs/gpu.yaml", "configs/graft/cpu.yaml",
              "configs/published/THUDM/GLM-4-9B-0414/config.json", "configs/published/moonshotai/Kimi-K2.5/config.json",
              "services/api/static/index.html", "services/api/static/app.js", "services/engines/engine_site/sitecustomize.py",
              "audio/vllm_ext/chimera_frame_constraint.py", "grafting/assets/cpu_scenes224/graft.json"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, set[str]]:
    """(the folder the wheel was installed into, the names inside the wheel)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", ".chimera", "__pycache__", "build",
                                                            "dist", "*.egg-info", "runs", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "wheel"), str(src)], check=True, cwd=tmp)
    [whl] = (tmp / "wheel").glob("chimera-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target", str(site),
                    str(whl)], check=True, cwd=tmp)
    return site, names


def _run(site: Path, cwd: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(site), **env})


def test_the_wheel_holds_every_runtime_file_and_only_our_top_level_names(installed):
    _, names = installed
    assert [f for f in DATA_FILES if f not in names] == []
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == TOP_LEVEL, top
    assert not [n for n in names if n.startswith(("tests/", "bench/", "notebooks/"))]


def test_installed_package_runs_outside_the_source_tree(installed, tmp_path):
    site, _ = installed
    where = _run(site, tmp_path / "elsewhere", "-c", "import audio, configs, core, grafting, services, video; "
                 "print('\\n'.join(m.__file__ for m in (audio, configs, core, grafting, services, video)))")
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    cpu = _run(site, tmp_path / "elsewhere", "-m", "services.cli", "profile", "show", "--profile", "cpu")
    assert (cpu.returncode, cpu.stdout) == (0, "profile cpu: no deployment asks for a GPU (nothing to plan)\n"), \
        cpu.stderr[-3000:]
    # the gpu profile's plan reads the model math and the published model shapes from the installed package
    gpu = _run(site, tmp_path / "elsewhere", "-m", "services.cli", "profile", "show", "--profile", "gpu")
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert "profile gpu: 4 GPUs x 74.5 GiB (80.0 GB)" in gpu.stdout and "video job worker 0 on GPU 3" in gpu.stdout


def test_paths_are_found_by_configuration_not_by_the_package(installed, tmp_path):
    """The profile's relative ``vllm.python`` and ``model_dir`` are resolved against ``$CHIMERA_HOME`` (else the
    current directory); ``$CHIMERA_VLLM_PYTHON`` and ``$CHIMERA_MODEL_DIR`` override them."""
    site, _ = installed
    code = ("from services.config.profiles import load_profile; from services.engines.vllm_server import server_spec; "
            "p = load_profile('cpu'); print(server_spec(p.vlm.engine, 'llm').python); print(p.resolved_model_dir())")
    home = tmp_path / "project"
    home.mkdir()
    expected = f"{home}/.venv-vllm/bin/python\n{home}/.chimera/models/cpu\n"
    by_home = _run(site, tmp_path / "elsewhere", "-c", code, CHIMERA_HOME=str(home))
    assert by_home.stdout == expected, by_home.stderr
    by_cwd = _run(site, home, "-c", code, CHIMERA_HOME="")
    assert by_cwd.stdout == expected, by_cwd.stderr
    by_env = _run(site, home, "-c", code, CHIMERA_VLLM_PYTHON="/opt/vllm/bin/python", CHIMERA_MODEL_DIR="/srv/models")
    assert by_env.stdout == "/opt/vllm/bin/python\n/srv/models\n", by_env.stderr
