"""Start and supervise an engine server process (vLLM's OpenAI-compatible server) on a local port.

The serving layer owns its engine processes (the VLM deployment its vLLM server, the speech LM's next): model code
never sees this module, it gets a client (:mod:`core.vllm_client`) by injection.

Why a process and not a library: vLLM pins its own torch and transformers, so it lives in its own venv
(``make install`` builds ``.venv-vllm``) and cannot share the service's interpreter; its OpenAI server is its
public, versioned, typed interface (the same boundary vLLM itself draws between its API server and its engine).

:class:`ServerProcess` runs ``<python> -m <module> <args>`` under :mod:`services.engines.guard` in its own session
(process group). The guard gets ``PR_SET_PDEATHSIG(SIGTERM)``, so the kernel signals it when the supervising
thread's process dies, even by SIGKILL, and it then kills the whole group (vLLM's API server spawns engine-core and
worker processes that would otherwise outlive it); if the guard is SIGKILLed too (Ray kills a dying replica's
children), every engine process follows its dead parent (``services/engines/engine_site/sitecustomize.py``); ``atexit``
stops it on a clean exit: it is never orphaned. One supervisor thread spawns it (``PR_SET_PDEATHSIG`` fires when the
*thread* that forked exits, so every spawn happens on that one long-lived thread), polls ``GET /health``, and
when the process dies or stops answering kills its whole group (vLLM's engine-core workers included) and starts
it again. ``state`` tells callers whether it can serve (``ready``) or not (``starting`` | ``restarting`` |
``failed`` | ``stopped``).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1
_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


# Ray's default worker ports (``ray start --min-worker-port/--max-worker-port``): a server port is not taken there.
RAY_WORKER_PORTS = range(10002, 20000)


def _ephemeral_ports() -> range:
    """The kernel's ephemeral port range (``/proc/sys/net/ipv4/ip_local_port_range``, Linux's default 32768-60999),
    from which it picks the local port of every outgoing connection and of every ``bind(port 0)``."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, for a server that will bind it a moment later.

    Picked at random between Ray's worker ports and the kernel's ephemeral range (:func:`_ephemeral_ports`), never
    from the ephemeral range itself: there the kernel hands the port to the next outgoing connection or ``bind(0)``
    of any process (Ray alone opens dozens of gRPC connections while a service starts), and the server's later
    bind then fails (``Failed to bind to address '127.0.0.1:36535'``, seen in CI). Falls back to a port the OS picks
    when that gap is under 1,000 ports (a host whose ephemeral range starts low). Raises OSError when no port
    is free."""
    ephemeral = _ephemeral_ports()
    gap = range(RAY_WORKER_PORTS.stop, ephemeral.start)
    rng = random.Random(os.urandom(8))  # not the global generator, which a seeded test would make repeat
    candidates = [rng.choice(gap) for _ in range(64)] if len(gap) >= 1000 else []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use (or in TIME_WAIT): try the next
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


GUARD = str(Path(__file__).resolve().parent / "guard.py")
ENGINE_SITE = str(Path(__file__).resolve().parent / "engine_site")


def _die_with_parent() -> None:  # runs in the guard between fork and exec: SIGTERM lets it sweep its group
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ServerSpec:
    """How to run one engine server.

    ``python``: the interpreter of the engine's venv; ``module``: run with ``-m``; ``args``: its arguments
    (without host/port, which the supervisor adds as ``--host``/``--port``); ``env``: extra environment
    variables; ``startup_timeout_s``: seconds from spawn to the first healthy ``/health`` before the start
    counts as failed; ``health_period_s``: seconds between health checks; ``health_timeout_s``: seconds one check
    may take (generous: a busy 2-core machine must not look like a hung engine); ``max_health_failures``: consecutive
    failed checks of a ready server before it is killed and restarted; ``max_start_failures``: consecutive
    failed starts before giving up (state ``failed``); ``log_path``: where its stdout/stderr go (a temporary
    file when None, removed by ``stop()``).
    """

    python: str
    module: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    health_period_s: float = 1.0
    health_timeout_s: float = 10.0
    max_health_failures: int = 3
    max_start_failures: int = 3
    log_path: str | None = None


class ServerProcess:
    """Supervisor of one engine server process (see the module docstring).

    ``start()`` returns at once; ``wait_ready(timeout)`` blocks until healthy. ``base_url`` keeps its port across
    restarts after a death; after a failed start the port is chosen afresh (another process may have taken it
    between the choice and the server's bind), so read ``base_url`` per request. ``restarts`` counts restarts after deaths; ``pid`` is the
    current process's id (None when none runs). ``stop()`` kills the group and ends supervision; idempotent.
    Raises FileNotFoundError from ``start()`` when ``spec.python`` does not exist (run ``make install``).
    """

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.port = free_port(spec.host)
        self.base_url = f"http://{spec.host}:{self.port}"
        self.state = "stopped"
        self.restarts = 0
        self.last_error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._changed = threading.Condition()
        # Held by a spawn (from its check of _stop until the new process is in _proc) and by stop()'s kill: a stop
        # that lands during a spawn waits for it and kills what it started; a spawn after a stop starts nothing.
        self._spawn_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._owns_log = spec.log_path is None  # a temporary log is ours to remove when stopped
        self.log_path = spec.log_path or tempfile.mkstemp(prefix="engine-", suffix=".log")[1]

    # ---------------------------------------------------------------------------------------- public
    @property
    def pid(self) -> int | None:
        """Process id of the running guard (the process group has the same id), or None."""
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    @property
    def server_pid(self) -> int | None:
        """Process id of the server itself (the guard's child), or None when none runs."""
        import psutil

        pid = self.pid
        try:
            kids = psutil.Process(pid).children() if pid is not None else []
        except psutil.NoSuchProcess:
            return None
        return kids[0].pid if kids else None

    def start(self) -> "ServerProcess":
        """Begin supervising: spawn the server on the supervisor thread. Returns self."""
        if not Path(self.spec.python).exists():
            raise FileNotFoundError(f"engine interpreter {self.spec.python} not found (run `make install`)")
        if self._thread is not None:
            return self
        self._set_state("starting")
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the state is ``ready`` (True) or ``failed``/``stopped``/timeout (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while self.state not in ("ready", "failed", "stopped"):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            return self.state == "ready"

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop supervising and terminate the server's process group (SIGTERM, SIGKILL after ``grace_s``).
        A stop during a spawn waits for the spawn and terminates the process it started; no spawn starts after
        it. A temporary log (no ``spec.log_path``) is removed then: read ``log_tail()`` before stopping."""
        self._stop.set()
        with self._spawn_lock:
            self._terminate(grace_s)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=grace_s + 5)
        self._set_state("stopped")
        if self._owns_log:
            Path(self.log_path).unlink(missing_ok=True)

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the server's log (for error messages)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    # -------------------------------------------------------------------------------------- internals
    def _set_state(self, state: str) -> None:
        with self._changed:
            self.state = state
            self._changed.notify_all()

    def _spawn(self) -> bool:
        """Start the server process into ``_proc`` unless ``stop()`` was called; returns whether it started."""
        env = dict(os.environ)
        env.update(self.spec.env)
        # the engine's processes follow a dead parent down (services/engines/engine_site/sitecustomize.py)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ENGINE_SITE, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, GUARD, self.spec.python, "-m", self.spec.module, *self.spec.args,
                "--host", self.spec.host, "--port", str(self.port)]
        with self._spawn_lock:
            if self._stop.is_set():
                return False
            log = open(self.log_path, "ab")
            try:
                self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True,
                                              preexec_fn=_die_with_parent)
            finally:
                log.close()
        return True

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=self.spec.health_timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _terminate(self, grace_s: float) -> None:
        """Kill the current process group: SIGTERM, then SIGKILL to whatever is left after ``grace_s``."""
        p = self._proc
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:  # the leader exited: still sweep any worker left in its group
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break

    def _supervise(self) -> None:
        failed_starts = 0
        while self._spawn():
            started, failures = time.monotonic(), 0
            became_ready = False
            while not self._stop.is_set():
                if self._proc.poll() is not None:
                    self.last_error = f"engine process exited with code {self._proc.returncode}"
                    break
                if self._healthy():
                    failures = 0
                    if not became_ready:
                        became_ready, failed_starts = True, 0
                        self._set_state("ready")
                elif became_ready:
                    failures += 1
                    if failures >= self.spec.max_health_failures:
                        self.last_error = "engine stopped answering /health"
                        break
                elif time.monotonic() - started > self.spec.startup_timeout_s:
                    self.last_error = f"engine not healthy {self.spec.startup_timeout_s:.0f} s after start"
                    break
                self._stop.wait(self.spec.health_period_s)
            if self._stop.is_set():
                break
            self._set_state("restarting")
            self._terminate(grace_s=0.0)
            failed_starts += 0 if became_ready else 1
            if not became_ready:
                self.port = free_port(self.spec.host)
                self.base_url = f"http://{self.spec.host}:{self.port}"
            if failed_starts >= self.spec.max_start_failures:
                self.last_error = f"{self.last_error}; gave up after {failed_starts} failed starts"
                self._set_state("failed")
                return
            self.restarts += 1
            self._stop.wait(min(2.0 ** failed_starts, 30.0))


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        p.stop(grace_s=3.0)
