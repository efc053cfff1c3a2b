"""Imported at start-up by every Python process of a supervised engine server: its parent-death watch.

:class:`services.engines.process.ServerProcess` puts this folder first on the engine's ``PYTHONPATH``, and
:mod:`services.engines.guard` sets ``CHIMERA_ENGINE_DIE_WITH_PARENT=1`` for the command it runs, so the engine server and every
Python process it spawns (vLLM's engine core, its workers, multiprocessing's resource tracker: all fresh
interpreters) start a daemon thread that SIGKILLs its own process once its parent has died (``os.getppid()``
changed: the process was re-parented). The guard sweeps the group when it can; this covers the case where it
cannot, e.g. when Ray kills a dying replica's child processes (the guard among them) with SIGKILL: each process
then follows its parent within ``PERIOD_S`` seconds, all the way down. The guard itself never activates it, nor
does multiprocessing's resource tracker, which exits by design when its parent is gone, after freeing the shared
memory the dead processes leaked (a SIGKILL would leave that memory in /dev/shm).
"""

import os
import signal
import sys
import threading
import time

PERIOD_S = 0.5


def _watch(parent: int) -> None:
    while True:
        time.sleep(PERIOD_S)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("CHIMERA_ENGINE_DIE_WITH_PARENT") == "1" \
        and "multiprocessing.resource_tracker" not in " ".join(getattr(sys, "orig_argv", [])):
    threading.Thread(target=_watch, args=(os.getppid(),), name="engine-parent-watch", daemon=True).start()
