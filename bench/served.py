"""``chimera serve`` as a benchmark runs it: a subprocess on a free port in its own process group, with a profile
name or a profile dict, waited for until ready, stopped so that nothing of it is left (the next measurement gets
the cores to itself), and measured (resident memory of its whole process tree)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from services.engines.process import free_port
from services.api.readiness import wait_ready

ROOT = Path(__file__).resolve().parent.parent


def tree_rss(pid: int) -> int:
    """Resident set size in bytes of a process and all its descendants (Ray's GCS, raylet, replicas, vLLM)."""
    root = psutil.Process(pid)
    total = 0
    for p in [root] + root.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class ServedChimera:
    """A running ``chimera serve``. ``profile``: a profile name (configs/<name>.yaml) or a whole profile dict
    (written to a temporary YAML file). Raises SystemExit naming the log when it exits or is not ready within
    ``ready_ceiling_s`` seconds. ``startup_s``: seconds from spawn to /readyz 200; ``base``: its URL."""

    def __init__(self, profile: str | dict, ready_ceiling_s: float = 900):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._profile_file = None
        if isinstance(profile, dict):
            f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
            yaml.safe_dump(profile, f)
            f.close()
            self._profile_file = f.name
        self.log = tempfile.NamedTemporaryFile("w+", prefix="chimera-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([str(ROOT / ".venv/bin/chimera"), "serve", "--profile",
                                      self._profile_file or profile, "--port", str(self.port)], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.startup_s = wait_ready(self.base, ready_ceiling_s, alive=lambda: self.proc.poll() is None, poll_s=1)
        except RuntimeError as exc:
            self.stop()
            raise SystemExit(f"{exc}; log: {self.log.name}") from None

    def rss(self) -> int:
        """Resident bytes of the whole service process tree now."""
        return tree_rss(self.proc.pid)

    def members(self, marker: str) -> list[psutil.Process]:
        """Processes of the service tree whose command line (Ray's process title, e.g.
        ``ServeReplica:chimera:tts``, ``JobManager``, ``ProxyActor``) contains ``marker``."""
        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if marker in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def stop(self, grace_s: float = 120) -> int | None:
        """SIGTERM to the CLI alone (as `kill <pid>` does: it stops Serve, then the Ray it started), SIGKILL to
        its group after ``grace_s`` seconds; returns once no process of the group is left. Returns the CLI's exit
        code (None when it had to be killed)."""
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                rc = None
        deadline = time.monotonic() + 60
        while _group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                raise SystemExit(f"processes of group {self.proc.pid} survive SIGKILL")
            os.killpg(self.proc.pid, signal.SIGKILL)
            time.sleep(0.5)
        if self._profile_file:
            os.unlink(self._profile_file)
            self._profile_file = None
        return rc

    def __enter__(self) -> "ServedChimera":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """True while any process of the group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
