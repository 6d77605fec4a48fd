"""A job's building and warm-up as one background task: ``/initialize`` answers once the engine is built, and the
warm-up's compiles run while the client starts the rest of its loop.

A training or log_prob job's warm-up (:mod:`arctic_rl.server.engines.warmup`) compiles the graphs of its first
calls. Run inside ``/initialize``, its seconds came on top of the client's own start-up; yet a client has more to
start once its jobs exist. verl creates them in its driver, then starts its Ray workers, agent loop, reward and
data processes, and makes its first call on them (the initial weight sync) 90 s later on the SmolLM2 recipe (one
H100, benchmarks/RESULTS.md §2y), while the warm-up took 32 s there, and 136 s with ZoRRO's passes. So
``/initialize`` now answers when the engine is built, and the warm-up goes on beside the client's start-up.

What waits, so that nothing a client sees changes but the timing:

* **the job's own calls** -- the task holds the job's lock from the building to the warm-up's end; the calls then
  run in arrival order on compiled graphs, as before;
* **the samplers** -- asleep for the warm-up as for the building (:mod:`.setup_hold`): a ``/generate`` waits, and
  so do a ``/weight-sync``, ``/sleep-inference`` or ``/wake-inference`` (they take the sampler's lock);
* **every other job's compute call and every other ``/initialize``** -- they wait until no job is being built or
  warmed up (:meth:`BackgroundSetups.idle`): one compute at a time on the device at start-up, and the warm-up's
  process-wide state (the LM-head chunk budget of its second shape; the RNG and the device's peak statistics,
  which it restores) is never seen by a real call.

A warm-up that fails is logged and its job runs on (its first calls compile), as before; a ``/destroy`` that
arrives meanwhile runs once the warm-up ends (it takes the job's lock). ``GET /job/{id}`` says ``warming_up``
until then, and ``warm_up_s`` after.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from arctic_rl.server.jobs.gc_freeze import freeze_long_lived
from arctic_rl.server.jobs.registry import Job, JobState
from arctic_rl.server.jobs.setup_hold import RunInThread, samplers_asleep

if TYPE_CHECKING:
    from arctic_rl.server.settings import ServerSettings

__all__ = ["BackgroundSetups", "job_setup"]

logger = logging.getLogger("arctic_rl.server")

#: a job's setup: builds the engine, calls ``built()`` once the job accepts calls, then warms it up
Setup = Callable[[Callable[[], None]], Awaitable[None]]


def job_setup(job: Job, others: list[Job], settings: ServerSettings, run: RunInThread) -> Setup:
    """``job``'s setup, for :meth:`BackgroundSetups.run`: under the job's lock and with the samplers among
    ``others`` asleep (:func:`~.setup_hold.samplers_asleep`), build its engine, mark it running and built, then warm it
    up where the settings want that (``run(fn, *args)`` runs a blocking call in a worker thread)."""
    from arctic_rl.server.engines import create_engine
    from arctic_rl.server.engines.warmup import warm_up, warm_up_wanted

    async def setup(built: Callable[[], None]) -> None:
        async with job.lock, samplers_asleep(others, job.job_type, run):
            if job.job_dir is not None:
                job.job_dir.mkdir(parents=True, exist_ok=True)
            job.engine = await run(create_engine, job.config, settings, job.job_dir)
            job.warming_up = warm_up_wanted(job.engine, settings)
            job.state = JobState.RUNNING
            if job.warming_up:
                built()  # answer now; the samplers wake once the warm-up has ended
                try:
                    await run(warm_up, job.engine, settings)  # compiles before step 1
                finally:
                    job.warming_up = False
                # what the warm-up compiled, and the job's objects, outside later collections (vLLM's sleep runs one)
                await run(freeze_long_lived, settings.gc_freeze, f"after the warm-up of job {job.job_id}")
        built()  # no warm-up: answered once the samplers are awake again, as before

    return setup


class BackgroundSetups:
    """The jobs being built or warmed up now, and the gate that every other compute call waits at."""

    def __init__(self) -> None:
        self._tasks: dict[int, asyncio.Task] = {}
        self._idle: asyncio.Event | None = None  # made in the server's event loop, at first use

    def _event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            self._idle.set()
        return self._idle

    def running(self) -> list[int]:
        """The ids of the jobs being built or warmed up now."""
        return sorted(self._tasks)

    async def idle(self) -> None:
        """Return once no job is being built or warmed up (at once, without yielding, when none is). Checked again
        after each wake-up: of two ``/initialize`` calls woken together, the first to run starts a setup and the
        other waits for it."""
        event = self._event()
        while not event.is_set():
            await event.wait()

    async def run(self, job_id: int, setup: Setup) -> None:
        """Start ``setup`` as job ``job_id``'s background task and return once it calls ``built()``; an error
        raised before that is raised here (the task ends with it), and a caller cancelled before that cancels the
        task. What it raises after is logged."""
        if job_id in self._tasks:
            raise RuntimeError(f"job {job_id} is being set up already")
        built: asyncio.Future = asyncio.get_running_loop().create_future()

        def mark_built() -> None:
            if not built.done():
                built.set_result(None)

        self._event().clear()
        task = asyncio.get_running_loop().create_task(self._run(job_id, setup, mark_built, built),
                                                      name=f"setup of job {job_id}")
        self._tasks[job_id] = task
        try:
            await asyncio.shield(built)
        except asyncio.CancelledError:  # the caller went away: a job still building goes with it, as it did before
            if not built.done():
                task.cancel()
            raise

    async def _run(self, job_id: int, setup: Setup, mark_built: Callable[[], None], built: asyncio.Future) -> None:
        try:
            await setup(mark_built)
        except BaseException as exc:  # handed to the caller, or logged once the job was built
            if not built.done():
                if isinstance(exc, asyncio.CancelledError):
                    built.cancel()
                else:
                    built.set_exception(exc)
            elif isinstance(exc, asyncio.CancelledError):
                logger.info("job %d: warm-up cancelled", job_id)
            else:
                logger.exception("job %d: warm-up ended with an error; the job runs on", job_id)
        finally:
            self._tasks.pop(job_id, None)
            if not self._tasks:
                self._event().set()

    async def cancel(self) -> None:
        """Cancel the running setups (the server shuts down) and wait for them to end."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
