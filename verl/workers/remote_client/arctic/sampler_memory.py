"""The sampler-memory role of the Arctic adapter: sleep and wake of the sampling job.

verl's generic rollout server sleeps the backend's sampler after each generation phase in sync mode and
wakes it before the next (:mod:`verl.remote_backend.workers.sampler_sleep`); the client implements that
capability (:class:`~verl.remote_backend.protocols.SamplerSleep`) with the vendor's routes:

* ``sleep`` -- ``POST /sleep-inference?job_id=<sampling>`` with ``{level}``;
* ``wake`` -- ``POST /wake-inference?job_id=<sampling>`` with ``{tags}`` (``null``: all parts);
* ``before_weight_sync`` -- wakes the ``weights`` part when the run sleeps the sampler, since a server may
  not wake a sleeping sampler's weights itself before loading into them.

Only on a server that lists ``sampler_sleep`` in ``/health`` (the reference server: waking an awake part is
a no-op there, and its weight sync wakes the weights itself). The vendor's server lists no features: there
the calls are skipped (logged once) and its sampler stays resident -- its ``/sleep-inference`` exists, but
whether its pool's ``wake_up`` on an awake pool is harmless cannot be checked here, and its CPU harness's
sampling pool has no ``sleep`` at all (the route answers 500). A skipped call answers ``{"skipped": true}``
(:data:`~verl.remote_backend.workers.sampler_sleep.SKIPPED`): the rollout server then stops asking and reports
no sleep or wake seconds for a sleep that did not happen.
"""

from __future__ import annotations

import logging
from typing import Any

from arctic_rl.protocol import Features, JobType, Paths
from verl.remote_backend.workers.sampler_sleep import RELEASED, SKIPPED

from .dialect import Payload
from .request import JobRequest
from .session import JobCalls
from .state import RunState

__all__ = ["SamplerMemory", "with_released"]

logger = logging.getLogger(__name__)

_WEIGHTS = "weights"
#: the reference server's sleep/wake answer (under ``sampling``): bytes of unused cached blocks its allocator released
_SERVER_RELEASED = "allocator_released_bytes"


def with_released(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` with :data:`~verl.remote_backend.workers.sampler_sleep.RELEASED` set from the server's
    ``sampling.allocator_released_bytes`` when present (the reference server's; the vendor's answer has none)."""
    sampling = answer.get("sampling")
    value = sampling.get(_SERVER_RELEASED) if isinstance(sampling, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {**answer, RELEASED: int(value)}
    return answer


class SamplerMemory:
    """Sleep/wake of the run's sampling job (see the module docstring).

    ``sleep_between_phases``: the run sleeps the sampler after its generation phases (verl's
    ``rollout.free_cache_engine`` in sync mode); only then does ``before_weight_sync`` wake the weights.
    """

    def __init__(self, calls: JobCalls, state: RunState, *, sleep_between_phases: bool) -> None:
        self._calls = calls
        self._state = state
        self.sleep_between_phases = bool(sleep_between_phases)
        self._told = False

    @property
    def supported(self) -> bool:
        """The server says its sampler can sleep and wake (``sampler_sleep`` in ``/health``)."""
        return Features.SAMPLER_SLEEP in self._state.features

    def _skip(self, verb: str) -> dict[str, Any]:
        if not self._told:
            self._told = True
            logger.info("arctic: the server does not list %r; the sampler is not put to sleep (%s skipped), it "
                        "stays resident", Features.SAMPLER_SLEEP, verb)
        return {SKIPPED: True}

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = JobRequest("POST", path, op="weight_sync", idempotent=True, job=JobType.SAMPLING,
                             payload=Payload(json=body))
        resp = self._calls.call(request).answer(request.what)
        out = resp.json() if resp.content else {}
        return out if isinstance(out, dict) else {}

    def sleep(self, level: int) -> dict[str, Any]:
        """``/sleep-inference`` with ``{level}``; the answer, with the bytes the server released as
        ``released_bytes`` where it says (:func:`with_released`)."""
        if not self.supported:
            return self._skip(Paths.SLEEP_INFERENCE)
        return with_released(self._post(Paths.SLEEP_INFERENCE, {"level": int(level)}))

    def wake(self, tags: list[str] | None = None) -> dict[str, Any]:
        """``/wake-inference`` with ``{tags}`` (``None``: all parts); ``released_bytes`` as for :meth:`sleep`."""
        if not self.supported:
            return self._skip(Paths.WAKE_INFERENCE)
        return with_released(self._post(Paths.WAKE_INFERENCE, {"tags": list(tags) if tags is not None else None}))

    def before_weight_sync(self) -> int | None:
        """Wake the sampler's weights before they are synced into (when the run sleeps it between phases); the
        bytes the server released first, where it says (the first wake after training: training's cached
        blocks go there, before the KV cache wakes), else ``None``."""
        if not (self.sleep_between_phases and self.supported):
            return None
        return with_released(self._post(Paths.WAKE_INFERENCE, {"tags": [_WEIGHTS]})).get(RELEASED)
