"""``chimera serve`` as a user runs it: started as a subprocess, stopped with SIGTERM (``kill <pid>``) or SIGINT to
its process group (what a terminal's Ctrl-C does) or SIGTERM to its process group (`timeout`, container runtimes,
systemd KillMode=control-group). Issue 10, defect 8: stopping took about 36 s with SIGTERM and
logged a controller timeout ("Controller failed to shut down within 30.0s"), about 9 s with Ctrl-C; SIGTERM to the
group then still took 38-41 s and logged that timeout (it reached Ray's own processes).

Starts the Ray Serve stack: run under the e2e lock (``flock /tmp/chimera-e2e.lock``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from services.api.readiness import wait_ready
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
# A ceiling far above a clean stop (a few seconds, printed by the test) and far below a hang; it does not have to
# track machine speed: a shutdown that waits on a timeout (Serve's controller gives up after 30 s, replicas after
# 20 s) would still pass a tighter-looking bound on a fast machine, which is why the log is checked as well
# (Serve logs "Controller failed to shut down within 30.0s" then).
STOP_CEILING_S = 120
READY_CEILING_S = 600  # start-up (the VLM, vLLM's server for one case) on a loaded 2-core machine
SERVING = "Chimera is serving"
# Log lines of a shutdown that was not clean: a wait that ran out, or Serve's controller killed before it finished
# (issue 24: "ServeController.graceful_shutdown failed ... killed by ray.kill").
UNCLEAN = ("timeout", "timed out", "failed to shut down", "graceful_shutdown failed", "killed by ray.kill")


def _tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (Ray's GCS, raylet, workers and replicas all descend from the CLI)."""
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def _profile_arg(vlm_backend: str, tmp_path: Path) -> str:
    """The cpu profile with the VLM family only (issue 24: a service start without the speech and video families
    takes half the time, and the stop paths under test -- the CLI's signal handling, Serve's controller, Ray's
    processes, the VLM's decode thread or vLLM's server process -- are the same with one family as with three):
    the VLM's LLM in a vLLM server process as the cpu profile ships it (``vllm``), or on the in-process
    ``transformers`` backend (its batcher thread decodes; no vLLM start)."""
    import yaml

    from services.config.profiles import load_profile

    data = load_profile("cpu").model_dump(mode="json")
    data["video"] = data["tts"] = None
    data["vlm"]["engine"]["backend"] = vlm_backend
    path = tmp_path / f"cpu-vlm-{vlm_backend}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def start_serve(profile: str, port: int, log_path: Path) -> subprocess.Popen:
    """``chimera serve --profile <profile> --port <port>`` as a user starts it, in a session of its own (so its
    process group can be signalled), its output in ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--profile", profile, "--port",
                                 str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for_line(proc: subprocess.Popen, log_path: Path, line: str, ceiling_s: float = READY_CEILING_S) -> str:
    """Wait until a line of the log of ``proc`` (:func:`start_serve`) starts with ``line``; returns the log. Fails
    when the process exits first or after ``ceiling_s`` (a hang). Only a line's start counts: a traceback quotes
    the source around the failing call, ``typer.echo(f"Chimera is serving ...")`` included."""
    deadline = time.monotonic() + ceiling_s
    while True:
        text = log_path.read_text()
        if any(s.startswith(line) for s in text.splitlines()):
            return text
        assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
        time.sleep(0.5)


def kill_serve(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (a test's cleanup after a failure) and reap it; nothing when it exited."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# With the VLM on the transformers backend, whose decode thread must stop too. SIGTERM to the group (containers,
# systemd) with the VLM on vLLM as shipped, where every process, vLLM's server included, gets the signal at once, is
# tests/test_spec_swap.py's stop (after a reload, with two vLLM servers started); vLLM's own shutdown when its
# replica dies is tests/test_engine_process.py's never-orphaned cases.
@pytest.mark.parametrize("signame,vlm_backend", [("SIGTERM", "transformers"), ("SIGINT-group", "transformers")])
def test_serve_stops_fast_and_clean(signame, vlm_backend, model_dir, tmp_path):
    """After /readyz and one chat answer (so the VLM's decoding has run), the signal makes ``chimera serve`` exit
    with code 0 within STOP_CEILING_S, print "shutting down", leave no process of its tree alive, and log no
    timeout and no traceback."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    proc = start_serve(_profile_arg(vlm_backend, tmp_path), port, log_path)
    try:
        base = f"http://127.0.0.1:{port}"
        # issue 24: "Chimera is serving" was printed when the deployments were constructed, a minute before
        # /readyz was 200 (vLLM's server still loading); it is printed once /readyz is 200
        wait_for_line(proc, log_path, SERVING)
        assert httpx.get(f"{base}/readyz", timeout=30).status_code == 200, log_path.read_text()[-3000:]
        wait_ready(base, READY_CEILING_S, alive=lambda: proc.poll() is None)
        # /readyz answered every poll while starting (before, polls hung past their timeout and the abandoned
        # ones were counted as 500s that were never sent)
        scraped = httpx.get(f"{base}/metrics", timeout=30).text
        assert 'endpoint="/readyz",method="GET",status="200"' in scraped
        assert not re.search(r'endpoint="/readyz",method="GET",status="(500|499)"', scraped), scraped
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="chimera-vlm", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
        tree = _tree(proc.pid)
        assert len(tree) > 3  # GCS, raylet and workers are there to be checked

        t0 = time.monotonic()
        sig = signal.SIGINT if signame.startswith("SIGINT") else signal.SIGTERM
        if signame.endswith("-group"):
            # Ctrl-C: the terminal signals the whole foreground group; SIGTERM to the group is what `timeout`,
            # container runtimes and systemd (KillMode=control-group) send. Either reaches Ray's processes too.
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        rc = proc.wait(STOP_CEILING_S)
        stop_s = time.monotonic() - t0
        print(f"\nchimera serve: {signame} -> exit {rc} in {stop_s:.1f} s")
        assert rc == 0
        # the kernel ends Ray's workers once their raylet is gone; give it the same ceiling, then none may be left
        _, alive = psutil.wait_procs(tree[1:], timeout=STOP_CEILING_S)
        assert alive == [], [(p.pid, p.name()) for p in alive]
        text = log_path.read_text()
        assert "shutting down" in text
        lower = text.lower()
        assert not any(w in lower for w in UNCLEAN), text[-3000:]
        at = text.find("Traceback")
        assert at < 0, text[max(0, at - 500):at + 4000]  # the traceback itself, not the log's tail
    finally:
        kill_serve(proc)
