"""vLLM's sleep for the server's vLLM sampler, safe against vLLM's device-wide memory check.

vLLM 0.26's worker (``Worker.sleep``) first releases its memory -- the weights copied to host memory (level 1) or
dropped (level 2), the KV cache dropped -- and then compares the *device's* free memory before and after, failing with
``AssertionError("Memory usage increased after sleeping.")`` when it fell. Another process allocating on the same
GPU during the sleep (several runs side by side on one card) makes it fall although the release happened. vLLM's
executor sets its ``is_sleeping`` only after the worker returns, so the engine is then left counted awake with its
memory unmapped and its scheduler paused: a later ``wake_up`` does nothing, and the next weight load or step touches
unmapped memory (``CUDA error: invalid argument``).

:func:`fall_asleep` brings such an engine back to a state vLLM knows -- the worker's memory mapped again by the
worker's own ``wake_up`` (through ``collective_rpc``, the call vLLM's executor sends on a wake), the scheduler resumed
(``wake_up(tags=["scheduling"])``) -- and tries again, a few times. If the check keeps failing, the engine stays awake
and usable and :class:`SleepRefused` says why: an HTTP 503, which the adapter retries. Any other failure of the sleep
is raised as it is.

What is not here: the sampler's own record of what sleeps (:mod:`.vllm_sampler`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from arctic_rl.server.errors import ApiError

__all__ = ["ATTEMPTS", "DEVICE_CHECK", "SleepRefused", "fall_asleep", "is_device_check"]

logger = logging.getLogger("arctic_rl.server")

#: the text of vLLM's check that the device's free memory did not fall during the sleep
DEVICE_CHECK = "Memory usage increased after sleeping"
#: how many times one ``/sleep-inference`` tries before it answers 503
ATTEMPTS = 3
#: the pause before the second attempt (doubled before the third, ...)
PAUSE_S = 0.2


class SleepRefused(ApiError):
    """The sampler could not be put to sleep; it stays awake and usable (503: the client may try again)."""

    status_code = 503


def is_device_check(exc: BaseException) -> bool:
    """Whether ``exc`` is vLLM's device-wide free-memory check after a completed release (nothing else is): the
    ``AssertionError`` itself, or -- the engine core in a process of its own (``--vllm-engine-process own``) -- the
    plain ``Exception`` vLLM's client raises with the failed call's text."""
    return (isinstance(exc, AssertionError) or type(exc) is Exception) and DEVICE_CHECK in str(exc)


def _map_again(llm: Any) -> None:
    """Undo a release that vLLM's executor did not record: the worker maps its memory again (level 1: the weights
    come back from host memory), then the paused scheduler resumes."""
    llm.collective_rpc("wake_up", kwargs={"tags": None})
    llm.wake_up(tags=["scheduling"])


def fall_asleep(llm: Any, level: int, *, attempts: int = ATTEMPTS, pause_s: float | None = None) -> int:
    """``llm.sleep(level=level)``, tried again after vLLM's device-wide check failed (module docstring); the
    attempts it took. Raises :class:`SleepRefused` after ``attempts`` such failures, with the engine awake (at level 2
    its weights are then gone: the caller must say so)."""
    pause_s = PAUSE_S if pause_s is None else pause_s
    for attempt in range(1, attempts + 1):
        try:
            llm.sleep(level=level)
            return attempt
        except Exception as exc:
            if not is_device_check(exc):
                raise
        _map_again(llm)
        last = attempt == attempts
        logger.warning(
            "vLLM sampler: sleep attempt %d of %d released the memory but failed vLLM's check of the device's free "
            "memory (another process allocated on the GPU meanwhile); memory mapped again, %s",
            attempt, attempts, "the sampler stays awake" if last else "trying again",
        )
        if not last:
            time.sleep(pause_s * 2 ** (attempt - 1))
    raise SleepRefused(
        f"the vLLM sampler could not be put to sleep: {attempts} attempts released its memory and then failed vLLM's "
        "check that the device's free memory did not fall (another process allocated on this GPU meanwhile); it "
        "stays awake and usable -- try again, or give the server a GPU of its own",
        field="level", allowed="a sleep while no other process allocates on the GPU", received=level,
    )
