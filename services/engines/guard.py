"""Process-group guard: run a command as a child and take its whole process group down with it.

Usage: ``python guard.py <command> [args...]`` (run by file path, stdlib only, so any interpreter can run it).
:class:`services.engines.process.ServerProcess` starts this guard as the leader of a new session with
``PR_SET_PDEATHSIG(SIGTERM)``; the guard starts the engine server in the same process group. vLLM's API server
spawns its engine-core and worker processes, which outlive a killed API server unless someone reaps them: the
guard is that someone. When the command exits (crash, kill), or when the guard gets SIGTERM/SIGINT/SIGHUP
(supervisor stopping it, or the supervisor's process dying), it sends SIGTERM to the command, waits up to
``GRACE_S`` seconds, then SIGKILLs every other process left in the group and exits. Those signals are unblocked
at start (a mask inherited from a thread that blocks them would hold the parent-death SIGTERM pending forever).
Should the guard be SIGKILLed itself, the command dies with it (``PR_SET_PDEATHSIG``) and the command's own Python children follow their
parents down (``services/engines/engine_site/sitecustomize.py``, activated by ``CHIMERA_ENGINE_DIE_WITH_PARENT=1``). Exit status: the command's
(128 + N when the command, or the guard itself, was killed by signal N).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0
DOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


def _die_with_guard() -> None:  # in the command's process, between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, DOWN_SIGNALS)  # the engine starts with no signal blocked


def kill_group_but_me() -> None:
    """SIGKILL every process of this process group except this one (found through ``/proc``)."""
    me, group = os.getpid(), os.getpgrp()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.getpgid(int(name)) == group:
                os.kill(int(name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def main(argv: list[str]) -> int:
    """Run ``argv`` guarded (see the module docstring); returns the command's exit status."""
    # engine_site/sitecustomize.py, for the command: follow the parent down, and know it even if it died first
    env = dict(os.environ, CHIMERA_ENGINE_DIE_WITH_PARENT="1", CHIMERA_ENGINE_PARENT_PID=str(os.getpid()))
    child = subprocess.Popen(argv, env=env, preexec_fn=_die_with_guard)

    def down(signum, frame):
        try:
            child.terminate()
            deadline = time.monotonic() + GRACE_S
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            kill_group_but_me()
            os._exit(128 + signum)

    for sig in DOWN_SIGNALS:
        signal.signal(sig, down)
    # The signal mask is inherited across fork and exec: spawned from a thread that blocks SIGINT/SIGTERM (Ray's
    # worker threads do), the guard never saw its parent-death SIGTERM and stayed, with the engine, orphaned.
    # Unblocked only now that the handlers are in place (a SIGTERM pending since start is handled at once).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, DOWN_SIGNALS)
    code = child.wait()
    kill_group_but_me()  # the command's own children (vLLM's engine core and workers)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
