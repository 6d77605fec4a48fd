"""The sampler asleep while a training or log-prob job is built: the server's start-up peak, cut.

The jobs of one server share one GPU. Clients create the sampling job first (the vendor's client does, and so
does this project's adapter: vLLM sizes its KV cache from the memory free when it starts), then the log-prob and
training jobs. Building those -- DeepSpeed's
state, the model copies, and the warm-up's passes (:mod:`arctic_rl.server.engines.warmup`) -- used to run beside
the awake sampler's KV cache: on an H200 at 64 x 8 that was the run's memory peak (10.2 GiB against 9.5 in the
steps, benchmarks/RESULTS.md §2r), though no step ever holds both (in sync mode the sampler sleeps while the
server trains).

:func:`samplers_asleep` puts every awake sampling job to sleep (level 1: vLLM's weights to host memory, its KV cache
freed) for the time a training or log-prob job is built and warmed up (the warm-up runs after ``/initialize`` has
answered: :mod:`.background_setup`), and wakes it afterwards. Nothing a client sees changes
but the timing:

* the sampling job's lock is held throughout, so a client's ``/sleep-inference``, ``/wake-inference`` or
  ``/weight-sync`` on it waits and then runs as it would have (a client's sleep still puts it to sleep after the
  wake here);
* a ``/generate`` that arrives meanwhile waits (:attr:`Job.admitting`) and then runs on the woken sampler, rather
  than being refused as an asleep sampler refuses calls; calls already running finish first (a sleep waits for
  them);
* a sampler already asleep (the client's sleep) is left alone: it is not woken here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from arctic_rl.protocol import JobType
from arctic_rl.server.jobs.registry import Job, JobState

__all__ = ["HELD_FOR", "samplers_asleep"]

logger = logging.getLogger("arctic_rl.server")

#: the job types whose building puts the samplers to sleep
HELD_FOR = (JobType.TRAINING, JobType.LOG_PROB)

RunInThread = Callable[..., Awaitable[Any]]


@contextlib.asynccontextmanager
async def samplers_asleep(jobs: list[Job], building: JobType, run: RunInThread) -> AsyncIterator[list[int]]:
    """Sleep the awake, running sampling jobs among ``jobs`` while a ``building`` job is built (when it is one of
    :data:`HELD_FOR`); yields the ids put to sleep, and wakes them on the way out, error or not. ``run(fn, *args)``
    runs a blocking engine call in a worker thread."""
    held: list[Job] = []
    if building in HELD_FOR:
        for job in jobs:
            if job.job_type != JobType.SAMPLING or job.state != JobState.RUNNING or job.engine is None:
                continue
            await job.lock.acquire()
            if not job.engine.awake:  # asleep by the client's call: leave it
                job.lock.release()
                continue
            job.admitting.clear()
            held.append(job)
            try:
                t0 = time.perf_counter()
                await run(job.engine.sleep, 1)
                logger.info("initialize: sampling job %d asleep while a %s job is built (%.2fs)",
                            job.job_id, building.value, time.perf_counter() - t0)
            except BaseException:
                await _release(held, run)
                raise
    try:
        yield [job.job_id for job in held]
    finally:
        await _release(held, run)


async def _release(held: list[Job], run: RunInThread) -> None:
    """Wake the held samplers, admit their calls again and release their locks (each even if another fails)."""
    while held:
        job = held.pop()
        try:
            t0 = time.perf_counter()
            await run(job.engine.wake_up, None)
            logger.info("initialize: sampling job %d awake again (%.2fs)", job.job_id, time.perf_counter() - t0)
        except Exception:  # the sampler stays asleep; its calls say so (409) rather than wait
            logger.exception("initialize: sampling job %d did not wake; /wake-inference wakes it", job.job_id)
        finally:
            job.admitting.set()
            job.lock.release()
