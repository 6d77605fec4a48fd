"""A training or log-prob pass waits for a sampler that is falling asleep: sync mode's memory bound, kept on the
server once the client stops waiting for the sleep.

In sync mode the client puts the sampler to sleep after each generation phase (``/sleep-inference``, verl's
``free_cache_engine``), so that the passes that follow never run beside its KV cache -- what stock verl does with its
vLLM rollout. The adapter no longer waits for the sleep's answer before going on with the step
(``verl.remote_backend.workers.sampler_sleep``): the sleep then overlaps the client's own work after a phase (the
advantages, the next call's layout and upload). The bound is kept here instead: :class:`SleepGate` counts the sleeps
the server is running, from the request's arrival to its answer, and a ``/forward`` or ``/forward-backward`` parses
its batch and then waits (:meth:`SleepGate.wait_settled`, in its worker thread) until none is running before its
pass starts. With no sleep running -- the asynchronous mode never sleeps the sampler -- the wait costs nothing.

What is not here: the sleep itself (the sampling engine) and the routes (:mod:`arctic_rl.server.http.control`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["WAIT_LIMIT_S", "SleepGate"]

logger = logging.getLogger("arctic_rl.server")

#: the longest a pass waits for a sampler's sleep before it runs anyway (with a warning)
WAIT_LIMIT_S = 120.0


class SleepGate:
    """The sampler sleeps running now, and a wait for them to end (thread-safe: entered from the event loop, waited
    on from the worker threads that run the passes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0

    @property
    def running(self) -> int:
        """How many sleeps are running (requests arrived and not yet answered)."""
        with self._cond:
            return self._running

    @contextlib.contextmanager
    def sleeping(self) -> Iterator[None]:
        """Around one sleep request, from its arrival (before it queues for the job's lock) to its answer, error or
        not."""
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                if not self._running:
                    self._cond.notify_all()

    def _wait(self, timeout: float | None) -> tuple[bool, float]:
        """``(settled, seconds waited)``: whether no sleep was running when the wait ended."""
        start = time.monotonic()
        with self._cond:
            settled = self._cond.wait_for(lambda: not self._running, timeout=timeout)
        return settled, time.monotonic() - start

    def wait_settled(self, timeout: float | None = None) -> float:
        """Block until no sleep is running; the seconds waited. ``timeout``: give up after that many seconds (the
        pass then runs anyway: a wait bounds memory, it is never what decides a result)."""
        return self._wait(timeout)[1]

    def before_pass(self, job_id: int) -> float:
        """In a pass's worker thread, before the pass of job ``job_id``: wait for the sleeps running now (at most
        :data:`WAIT_LIMIT_S`); logged when it waited. The seconds waited."""
        settled, waited = self._wait(WAIT_LIMIT_S)
        if not settled:
            logger.warning("job %d: a sampler sleep still runs after %.0f s; the pass runs beside it", job_id,
                           WAIT_LIMIT_S)
        elif waited > 1e-3:
            logger.info("job %d waited %.3fs for the sampler to fall asleep", job_id, waited)
        return waited
