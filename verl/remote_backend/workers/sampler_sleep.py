"""The sampler's sleep between generation phases (verl's sync mode), for the generic rollout server.

Stock verl frees its vLLM rollout's memory after every generation phase: the sync V1 trainer calls
``checkpoint_manager.sleep_replicas()`` in ``on_sample_end`` -- each replica server's ``sleep()`` -- and
vLLM's server sleeps when ``actor_rollout_ref.rollout.free_cache_engine`` is true (verl's default). The
weight sync then restores the weights and the next generation the KV cache. Through a remote backend the
same knob decides: :class:`SamplerNap` (one per rollout server)

* on ``sleep()`` starts the backend's ``sleep_sampler(level)`` when the backend declares
  :class:`~verl.remote_backend.protocols.SamplerSleep` and sleeping is enabled (:func:`sleep_settings`), and
  returns without waiting for it: the sleep runs while verl computes the advantages and sends the next phase's
  call, rather than inside verl's generation phase. The backend's server keeps the memory bound itself -- the
  reference server's passes wait for a sleep in progress (``arctic_rl.server.jobs.sleep_gate``);
* before the next ``generate`` waits for that sleep (a failed sleep is raised there) and wakes the sampler (all
  parts), once, under an asyncio lock, so that the calls of a generation phase wait for one wake rather than
  each sending their own. A sleep the server *declined* -- HTTP 429 or 503 once the transport's retries are spent:
  nothing slept (the reference server's answer when vLLM's memory check keeps failing on a shared GPU) -- is not a
  failure: the sampler stays awake for the next phase, with a warning, counted (``gen/sampler_sleep_declined``, logged
  by the trainer as ``perf/remote_backend/sampler_sleeps_declined``).

Enabled when ``free_cache_engine`` is true and the run is not asynchronous -- the mode actually run
(:func:`~verl.remote_backend.async_trainer.async_running`): an asynchronous run generates while the actor
side trains, and nothing sleeps; a run that asked for the asynchronous mode and fell back to sync (a server
without ``concurrent_jobs``) sleeps as a sync run does. The level is 1 (KV cache freed, weights kept in host
memory): verl 0.9.1 has no key for it (its vLLM server picks 1 or 2 itself). A backend without the
capability: ``sleep()`` stays a no-op (logged once at info level). A backend with it whose server keeps its
sampler resident answers ``sleep_sampler`` with ``{"skipped": true}`` (the Arctic adapter against a server
that does not list ``sampler_sleep``): the sampler is then taken as awake, and not asked again. The seconds
spent are reported with the generation timings (``gen/sampler_sleep``, ``gen/sampler_wake``) once the sampler
has really slept, and never otherwise (the sleep's seconds are its own, run beside the step's next phases, and
reported at the first collect after it ended): a sampler that stays resident reports no sleep timings, not zeros. The
memory the backend says it released around them (``gen/sampler_released_bytes``, from the answers'
``released_bytes`` when a backend reports it) is reported the same way.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verl.remote_backend.errors import RemoteServerError
from verl.remote_backend.logs import module_logger
from verl.remote_backend.protocols import sleeper_of
from verl.remote_backend.strict_config import select

__all__ = ["DECLINED_METRIC", "DECLINED_STATUS", "FREE_CACHE_KEY", "RELEASED", "SKIPPED", "SLEEP_LEVEL", "SamplerNap",
           "sleep_settings"]

logger = module_logger(__name__)

#: verl's key (default true) that decides whether the rollout frees its memory after generation
FREE_CACHE_KEY = "actor_rollout_ref.rollout.free_cache_engine"
#: the level asked of the backend: KV cache freed, weights kept (restored by the next weight sync either way)
SLEEP_LEVEL = 1
#: the key of a ``sleep_sampler`` answer saying that nothing slept (the backend's server keeps its sampler resident)
SKIPPED = "skipped"
#: the optional key of a sleep or wake answer: device memory the backend's server released around it, in bytes
RELEASED = "released_bytes"
#: the step metric those bytes are summed under (the rollout servers' sleeps and wakes, and the worker's weight syncs)
RELEASED_METRIC = "gen/sampler_released_bytes"
#: the statuses of a sleep the server declined without sleeping (its sampler stays awake), and their step metric;
#: not every retryable status (``RemoteServerError.retryable``): after a 502/504 from a proxy the sleep may have run
DECLINED_STATUS = (429, 503)
DECLINED_METRIC = "gen/sampler_sleep_declined"


def sleep_settings(main_config: Any) -> tuple[bool, str]:
    """``(enabled, why)``: whether the rollout server sleeps the sampler between generation phases."""
    from verl.remote_backend.async_trainer import async_running  # the trainer imports the workers

    if not bool(select(main_config, FREE_CACHE_KEY, True)):
        return False, f"{FREE_CACHE_KEY}=false"
    if async_running(main_config):
        return False, "the asynchronous mode keeps the sampler generating while the actor side trains"
    return True, f"{FREE_CACHE_KEY}=true, sync mode"


class SamplerNap:
    """Sleep/wake of one rollout server's backend sampler (see the module docstring)."""

    def __init__(self, backend: object, *, enabled: bool, why: str = "", level: int = SLEEP_LEVEL) -> None:
        self._sleeper = sleeper_of(backend)
        self._backend_name = type(backend).__name__
        self.enabled = bool(enabled)
        self.why = why
        self.level = int(level)
        self.asleep = False
        #: the backend answered that its sampler stays resident: no more sleep calls
        self.resident = False
        self.sleeps = 0
        self.wakes = 0
        self._lock: asyncio.Lock | None = None
        #: the sleep started by :meth:`sleep` and not yet awaited by :meth:`ensure_awake` / :meth:`settled`
        self._pending: asyncio.Task | None = None
        self._told = False
        self._seconds = {"sleep": 0.0, "wake": 0.0}
        self._released: float | None = None
        self._declined = 0  # since the last collect

    def _count_released(self, answer: Any) -> None:
        value = answer.get(RELEASED) if isinstance(answer, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._released = (self._released or 0.0) + float(value)

    def _lock_for_loop(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _tell_once(self, message: str, *args: Any) -> None:
        if not self._told:
            self._told = True
            logger.info(message, *args)

    async def sleep(self) -> None:
        """verl's ``sleep()``: start the sampler's sleep when enabled and the backend can (not waiting for it);
        else nothing."""
        if not self.enabled:
            self._tell_once("rollout server: the sampler is not put to sleep between phases (%s)", self.why)
            return
        if self._sleeper is None:
            self._tell_once("rollout server: backend %s does not declare SamplerSleep; its sampler stays resident "
                            "between generation phases", self._backend_name)
            return
        async with self._lock_for_loop():
            if self.asleep or self.resident or self._pending is not None:
                return
            self.asleep = True  # from here the next generate waits for this sleep, then wakes the sampler
            self._pending = asyncio.get_running_loop().create_task(self._sleep_now(self._sleeper))

    async def _sleep_now(self, sleeper: Any) -> None:
        start = time.monotonic()
        try:
            out = dict(await asyncio.to_thread(sleeper.sleep_sampler, self.level) or {})
        except Exception as exc:  # the task keeps it: the next generate raises it (ensure_awake)
            self.asleep = False
            if isinstance(exc, RemoteServerError) and exc.status in DECLINED_STATUS:
                self._declined += 1
                logger.warning("rollout server: the server declined the sampler's sleep (%s); the sampler stays awake "
                               "for the next phase", exc)
                return
            logger.warning("rollout server: the sampler's sleep failed (%s: %s); the next generate raises it",
                           type(exc).__name__, exc)
            raise
        if out.get(SKIPPED) is True:
            self.asleep = False
            self.resident = True
            self._tell_once("rollout server: backend %s keeps its sampler resident between generation phases "
                            "(its sleep was skipped)", self._backend_name)
            return
        self._seconds["sleep"] += time.monotonic() - start
        self._count_released(out)
        self.sleeps += 1
        logger.debug("rollout server: sampler asleep (level %d) in %.2f s", self.level, time.monotonic() - start)

    async def _settle(self) -> None:
        """Await the sleep :meth:`sleep` started, if any (its error, if it failed, is raised here, once)."""
        task, self._pending = self._pending, None
        if task is not None:
            await task

    async def settled(self) -> None:
        """Wait for a sleep started by :meth:`sleep` to end (raising its error, if it failed)."""
        async with self._lock_for_loop():
            await self._settle()

    async def ensure_awake(self) -> None:
        """Before a ``generate``: wait for a sleep this server started, then wake the sampler (all parts) if it
        slept."""
        if not self.asleep and self._pending is None:
            return
        async with self._lock_for_loop():
            await self._settle()
            if not self.asleep or self._sleeper is None:
                return
            start = time.monotonic()
            answer = await asyncio.to_thread(self._sleeper.wake_sampler, None)
            self._seconds["wake"] += time.monotonic() - start
            self._count_released(dict(answer or {}))
            self.asleep = False
            self.wakes += 1

    def collect(self) -> dict[str, float]:
        """Seconds spent sleeping and waking the sampler since the last collect, and the bytes the backend released
        around them where it says (none until it has really slept: sleeping off, no capability, or a sampler the
        backend keeps resident), and how many sleeps the server declined, if any."""
        out: dict[str, float] = {DECLINED_METRIC: float(self._declined)} if self._declined else {}
        self._declined = 0
        if not self.sleeps:
            return out
        out.update({"gen/sampler_sleep": self._seconds["sleep"], "gen/sampler_wake": self._seconds["wake"]})
        if self._released is not None:
            out[RELEASED_METRIC] = self._released
        self._seconds, self._released = {"sleep": 0.0, "wake": 0.0}, None
        return out
