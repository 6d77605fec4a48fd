"""Python's garbage collector and the jobs' long-lived objects: frozen once a job has warmed up.

A full ``gc.collect()`` walks every container object of the process. Once a job is built and warmed up, the
server's process holds the models, DeepSpeed's engine, vLLM's engine and, above all, what ``torch.compile`` left
(graphs, guards, symbolic sizes): on a CPU with a tiny model, 839k objects and 1.0-1.2 s per collection after the
warm-up, against 0.2 s before it. vLLM's sleep (``CuMemAllocator.sleep``) ends with such a collection, and verl's
old-log-prob ``/forward`` waits for the sampler's sleep (:mod:`.sleep_gate`): on an H100 a sleep took 0.015 s before
the training job was built and 0.38-0.45 s in the loop (benchmarks/RESULTS.md §2za), most of the step's old-log-prob
overhead. (vLLM freezes the heap itself at the end of its engine's start, ``freeze_gc_heap``: what the sampler's
start made is skipped already, what the training job and its compiles make after it is not.) Python's own automatic
collections of the oldest generation walk the same objects, at moments nobody chooses.

:func:`freeze_long_lived` (at the end of each job's warm-up, :mod:`.background_setup`) collects once and then
``gc.freeze()``\\ s what is left: those objects move to a permanent generation that later collections skip (on the
same CPU: 0.0000 s per collection after it). They are still freed by reference counting; only garbage in reference
cycles among them waits. So :func:`thaw` runs before a job is destroyed -- its model and engines may sit in cycles
that hold device memory -- and :func:`freeze_long_lived` again after. A job without a warm-up (no ``torch.compile``:
the CPU's default) freezes nothing: its objects are few, and each freeze's full collection would cost its
``/initialize`` and ``/destroy`` more than it saves. ``--gc-freeze off``
(:data:`~arctic_rl.server.settings.GC_FREEZE_MODES`) leaves the collector as Python runs it.

What is not here: when a job is set up or destroyed (:mod:`.background_setup`, :mod:`.service`).
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["freeze_long_lived", "thaw"]

logger = logging.getLogger("arctic_rl.server")


def freeze_long_lived(mode: str, why: str) -> int:
    """With ``mode`` ``on``: a full collection, then every object alive moves to the permanent generation. Returns
    the objects frozen now (0 with ``mode`` ``off``); logs them and the seconds taken, naming ``why``."""
    if mode != "on":
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("gc: %d objects frozen %s in %.2fs (later collections skip them)", frozen, why,
                time.perf_counter() - t0)
    return frozen


def thaw(mode: str) -> bool:
    """With ``mode`` ``on``: the frozen objects back in the collector's care (before a job's objects are let go).
    Whether any were frozen (then the caller freezes what is left once the job is gone)."""
    if mode != "on" or not gc.get_freeze_count():
        return False
    gc.unfreeze()
    return True
