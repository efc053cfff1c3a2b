"""Shared fixtures.

- ``profile`` / ``model_dir``: the cpu profile and its prepared model directory (``chimera prepare`` is run
  once, idempotently).
- ``ray_cluster``: Ray started once per session with 4 logical CPUs and 2 logical GPUs (one-GPU-per-job
  scheduling is testable without hardware).
- ``serve_url`` / ``openai_client``: the real Ray Serve application of the whole cpu profile, started once per
  session on a free port; the official ``openai`` SDK is the client.

Layers (pytest markers, given here so that each test's layer has one home; ``pytest -m unit`` runs one layer):

- ``e2e``: needs Ray (the ``ray_cluster`` fixture), the session's service (``serve_url``/``openai_client``), or
  starts ``chimera serve`` itself (:data:`SERVICE_FILES`). Run them under ``flock /tmp/chimera-e2e.lock``.
- ``vllm``: starts a real vLLM server of its own in this process (:data:`VLLM_FILES`; no Ray).
- ``slow``: no Ray and no vLLM, but whole notebooks, ``torch.compile``, real-size dry runs or supervised process
  groups (:data:`SLOW_FILES`, or marked ``@pytest.mark.slow`` at the test).
- ``unit``: everything else: models, engines, schemas, stand-ins in this process (``make test-unit``).
"""

from __future__ import annotations

import base64
import io
import os
import time

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from services.engines.process import free_port  # noqa: E402  (tests import it from here)
from services.api.readiness import wait_ready  # noqa: E402

# Test files that start the service themselves (``chimera serve`` or a Ray cluster of their own).
SERVICE_FILES = {"test_cli_serve.py", "test_crash_recovery.py", "test_cluster_config.py", "test_spec_swap.py"}
# Test files that start a real vLLM server in this process (``.venv-vllm``).
VLLM_FILES = {"test_vlm_vllm.py", "test_tts_vllm.py", "test_quant_vllm.py", "test_spec_vllm.py",
              "test_spec_ban_vllm.py", "test_traffic_head_vllm.py"}
# Test files that execute notebooks, run real-size dry runs, supervise process groups or build the wheel.
SLOW_FILES = {"test_graft_notebook.py", "test_video_notebook.py", "test_engine_process.py", "test_fullsize.py",
              "test_packaging.py"}
E2E_FIXTURES = {"serve_url", "openai_client", "ray_cluster"}


def pytest_collection_modifyitems(config, items):
    """Mark every test with its layer (``e2e``, ``vllm``, ``slow`` or ``unit``; see the module docstring)."""
    for item in items:
        name = item.path.name
        if name in SERVICE_FILES or E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        elif name in VLLM_FILES:
            item.add_marker(pytest.mark.vllm)
        elif name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session")
def profile(tmp_path_factory):
    """The cpu profile, with the video job store and results in a folder of this test session (so concurrent
    test sessions never recover, or count, each other's jobs)."""
    from services.config.profiles import load_profile

    prof = load_profile(os.environ.get("CHIMERA_TEST_PROFILE", "cpu"))
    if prof.video is not None:
        jobs_dir = tmp_path_factory.mktemp("video-jobs")
        jobs = prof.video.engine.jobs.model_copy(update={"store_url": f"sqlite:///{jobs_dir}/jobs.sqlite",
                                                         "results_dir": str(jobs_dir / "results")})
        engine = prof.video.engine.model_copy(update={"jobs": jobs})
        prof = prof.model_copy(update={"video": prof.video.model_copy(update={"engine": engine})})
    return prof


@pytest.fixture(scope="session")
def model_dir(profile):
    import importlib

    from services.cli import BUILDERS

    d = profile.resolved_model_dir()
    d.mkdir(parents=True, exist_ok=True)
    for fam, section in profile.families().items():
        importlib.import_module(BUILDERS[fam]).prepare(section.engine, d)
    return d


@pytest.fixture(scope="session")
def ray_cluster(profile):
    import ray

    from services.serve_app import init_ray

    if ray.is_initialized() and ray.cluster_resources().get("CPU") != 4:
        # something earlier in the session started a default Ray (ray.get_actor and friends auto-initialise one,
        # with as many CPUs as the machine has: 2 here); the service and the job workers need the 4 logical CPUs
        # of this fixture (with 2, the second video job worker waits forever for its CPU share)
        ray.shutdown()
    init_ray(profile, num_cpus=4, num_gpus=2)
    assert ray.cluster_resources().get("CPU") == 4 and ray.cluster_resources().get("GPU") == 2
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(profile, model_dir, ray_cluster):
    from ray import serve

    from services.serve_app import run

    port = free_port()
    url = run(profile, "127.0.0.1", port)
    wait_ready(url, 600)  # /readyz also waits for vLLM's server: 1-2 minutes on 2 busy cores
    yield url
    serve.shutdown()


@pytest.fixture(scope="session")
def openai_client(serve_url):
    import openai

    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def astronaut():
    """scikit-image's astronaut photograph (512x512 RGB) as a PIL image."""
    from PIL import Image
    from skimage import data

    return Image.fromarray(data.astronaut())


def data_url(img, fmt: str = "PNG") -> str:
    """A PIL image as a base64 data URL."""
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def wait_for_video(client, video_id: str, timeout: float = 240):
    """Poll ``client.videos.retrieve`` until the job leaves queued/in_progress; returns the Video object.
    Raises AssertionError after ``timeout`` seconds (a ceiling against a hang, measured on a monotonic clock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = client.videos.retrieve(video_id)
        if v.status not in ("queued", "in_progress"):
            return v
        time.sleep(0.3)
    raise AssertionError(f"video {video_id} still {v.status} ({v.progress}%) after {timeout} s")
