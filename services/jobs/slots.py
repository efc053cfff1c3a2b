"""The worker half of the job manager: one :class:`services.jobs.runner.JobWorker` actor per slot, its engine load
watched and retried (:data:`services.jobs.manager.ENGINE_LOAD_ATTEMPTS`), and one job run at a time on an idle
slot's worker (first in, first out), its outcome recorded in the store.

:class:`WorkerSlots` is a base class of :class:`services.jobs.manager.JobManager` and uses its state (``cfg``,
``store``, ``workers``, ``slot_state``, ``idle``, ``busy``, ``watchers``, ...), set in the manager's constructor.
"""

from __future__ import annotations

import asyncio
import logging

from ..boundary import unwrap

log = logging.getLogger("chimera")


class WorkerSlots:
    """Worker slots of the job manager (see the module doc); not used on its own."""

    def _new_worker(self):
        """A fresh JobWorker actor (its engine loads at once, on the GPU Ray gives it)."""
        import ray

        from .runner import JobWorker

        jobs = self.cfg.jobs
        return ray.remote(JobWorker).options(num_gpus=jobs.gpus_per_job, num_cpus=jobs.cpus_per_job,
                                             max_restarts=0, max_concurrency=1).remote(
            self.cfg_json, self.model_dir, jobs.gpus_per_job)

    def _start_worker(self, slot: int) -> None:
        """Put a fresh worker in ``slot``; the slot takes jobs once its engine has loaded (:meth:`_load`)."""
        self.workers[slot] = self._new_worker()
        self.starts[slot] += 1
        self.slot_state[slot] = "loading"
        if self._watching_loads:
            self._spawn_load(slot)

    def _watch_loads(self) -> None:
        """Start watching the engine load of every slot's worker (once; first contact, on the event loop)."""
        if not self._watching_loads:
            self._watching_loads = True
            for slot in range(len(self.workers)):
                self._spawn_load(slot)

    def _spawn_load(self, slot: int) -> None:
        task = asyncio.get_running_loop().create_task(self._load(slot, self.workers[slot]))
        self._loading.add(task)
        task.add_done_callback(self._loading.discard)

    async def _load(self, slot: int, worker) -> None:
        """Wait for ``worker``'s engine. Loaded: the slot takes jobs. Not loaded (an error, or the process died
        while loading): the worker is killed and another started, unless ``load_attempts`` in a row failed; then
        the slot is given up, and once every slot is, :attr:`engine_error` is set and the waiting jobs woken."""
        import ray

        try:
            error = (await worker.status.remote())["error"]
        except ray.exceptions.RayActorError as exc:
            error = f"the worker process died while loading the engine: {type(exc).__name__}: {exc}"[:2000]
        if self.workers[slot] is not worker:  # replaced meanwhile (a cancel killed it)
            return
        if error is None:
            self.load_failures[slot] = 0
            self.slot_state[slot] = "ready"
            self.idle.put_nowait(slot)
            return
        self.load_failures[slot] += 1
        self.load_errors[slot] = error
        ray.kill(worker, no_restart=True)
        if self.load_failures[slot] < self.load_attempts:
            self._start_worker(slot)
            return
        self.slot_state[slot] = "failed"
        log.error("video job worker %d: the engine did not load %d times in a row, slot given up: %s", slot,
                  self.load_failures[slot], error)
        if all(st == "failed" for st in self.slot_state):
            self.engine_error = (f"no video job worker could load its engine ({self.load_failures[slot]} "
                                 f"attempts per worker): {error}")
            self.idle.put_nowait(None)  # wakes the waiting jobs: each fails and passes it on

    def _replace_worker(self, slot: int) -> None:
        """Kill the worker in ``slot`` (no restart: its GPU is free at once) and put a fresh one there."""
        import ray

        ray.kill(self.workers[slot], no_restart=True)
        self._start_worker(slot)

    def _launch(self, row: dict) -> None:
        if row["id"] not in self.watchers:
            self.watchers[row["id"]] = asyncio.get_running_loop().create_task(self._watch(row))

    async def _watch(self, row: dict) -> None:
        """Wait for an idle worker, run the job there, record the outcome; the worker's slot is given back."""
        import ray

        job_id, slot, worker = row["id"], None, None
        ttl = self.cfg.jobs.ttl_s
        try:
            from video.request import seconds_label

            slot = await self.idle.get()
            if slot is None:  # every slot was given up: pass the wake-up on to the next waiting job
                self.idle.put_nowait(None)
                from core.llm_client import EngineUnavailableError

                raise EngineUnavailableError(self.engine_error)
            worker = self.workers[slot]
            if not await self._io(self.store.update_if_active, job_id, status="queued"):  # deleted while it waited
                return
            self.busy[job_id] = slot
            result = await worker.run.remote(job_id, str(self.store.job_dir(job_id)), row["params"], self._handle())
            now = self.clock()
            row = await self._io(self.store.get, job_id)
            await self._io(self.store.update_if_active, job_id, status="completed", phase="encoding", progress=100,
                           seconds=seconds_label(result["frames"], result["fps"]),
                           clips_done=row["clips_total"] if row else 0, completed_at=now,
                           expires_at=now + ttl, worker_started_at=result["started"],
                           worker_finished_at=result["finished"])
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
            if self.workers[slot] is worker:  # not already replaced by a cancel
                self._replace_worker(slot)
            now = self.clock()
            await self._io(self.store.update_if_active, job_id, status="failed", error_code="worker_died",
                           error_message=f"the job's worker stopped: {type(exc).__name__}: {exc}"[:2000],
                           completed_at=now, expires_at=now + ttl)
        except Exception as exc:  # noqa: BLE001 - recorded on the job
            cause = unwrap(exc)
            code = getattr(cause, "code", None) or ("invalid_input" if isinstance(cause, ValueError)
                                                    else "generation_failed")
            now = self.clock()
            await self._io(self.store.update_if_active, job_id, status="failed", error_code=str(code),
                           error_message=f"{type(cause).__name__}: {cause}"[:2000], completed_at=now,
                           expires_at=now + ttl)
        finally:
            self.busy.pop(job_id, None)
            self.watchers.pop(job_id, None)
            if slot is not None and self.workers[slot] is worker:  # a replaced worker's slot returns once loaded
                self.idle.put_nowait(slot)
