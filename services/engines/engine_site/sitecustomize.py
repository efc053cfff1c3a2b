"""Imported at start-up by every Python process of a supervised engine server: its parent-death watch, and the
AMX switch of a float32 int8 engine (``CHIMERA_ENGINE_NO_AMX``, at the end).

:class:`services.engines.process.ServerProcess` puts this folder first on the engine's ``PYTHONPATH``, and
:mod:`services.engines.guard` sets ``CHIMERA_ENGINE_DIE_WITH_PARENT=1`` for the command it runs, so the engine server and every
Python process it spawns (vLLM's engine core, its workers, multiprocessing's resource tracker: all fresh
interpreters) start a daemon thread that SIGKILLs its own process once its parent has died (``os.getppid()``
changed: the process was re-parented; one whose parent died before it started is caught too, see
:func:`_parent`). The guard sweeps the group when it can; this covers the case where it
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


PARENT_ENV = "CHIMERA_ENGINE_PARENT_PID"  # the pid of the process that spawned this one, when it set it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parent() -> int:
    """The parent to follow. ``os.getppid()`` read now is wrong when the parent died between spawning this process
    and this interpreter's start (the process is already re-parented): the spawner's pid, exported by its own
    copy of this module (or by the guard) in ``CHIMERA_ENGINE_PARENT_PID``, tells. If the spawner is dead, this
    process is already orphaned (SIGKILL now); if it lives but is not the parent (a non-Python process in between),
    the parent is whoever ``os.getppid()`` says."""
    ppid = os.getppid()
    spawner = int(os.environ.get(PARENT_ENV) or ppid)
    if spawner != ppid and not _alive(spawner):
        os.kill(os.getpid(), signal.SIGKILL)
    return ppid


def _watch(parent: int) -> None:
    while True:
        time.sleep(PERIOD_S)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("CHIMERA_ENGINE_DIE_WITH_PARENT") == "1" \
        and "multiprocessing.resource_tracker" not in " ".join(getattr(sys, "orig_argv", [])):
    threading.Thread(target=_watch, args=(_parent(),), name="engine-parent-watch", daemon=True).start()
    os.environ[PARENT_ENV] = str(os.getpid())  # for the processes this one spawns


NO_AMX_ENV = "CHIMERA_ENGINE_NO_AMX"  # set by services.engines.vllm_server for a float32 int8 checkpoint

if os.environ.get(NO_AMX_ENV) == "1":
    # torch.cpu._is_amx_tile_supported() is what vLLM's CPU kernels ask at each choice; the AMX kernels need bf16
    # or fp16 activations, so for a float32 engine "no AMX" picks the kernels it can run (oneDNN int8, vec attention)
    import torch.cpu

    torch.cpu._is_amx_tile_supported = lambda: False
